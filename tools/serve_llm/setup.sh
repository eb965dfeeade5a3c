#!/usr/bin/env bash
# The Ray Serve LLM test environment: the cached vllm-cpu 0.32.0 venv (tools/vllm_cpu/setup.sh)
# plus what `ray.serve.llm` needs besides vLLM, and kvbridge itself.
#
#   tools/serve_llm/setup.sh            # stdout: only the venv's python path
#
# On top of the vllm-cpu venv it installs ray[serve]==2.60.0 and ai-dynamo-runtime==1.6.1, and
# ray[llm]'s other requirements without its vllm==0.29.0 pin (pyarrow pandas jsonref hf_transfer
# pybind11 meson), then kvbridge's own requirements (read from pyproject.toml) and kvbridge:
#
#   - if the work tree already holds a built core (kvbridge/_core.abi3.so, an abi3 module that
#     loads on any CPython >= 3.11), the repo goes on the venv's path through a .pth file, as
#     `pip install -e` does, without rebuilding (a rebuild would replace the core that the
#     tree's own venv uses);
#   - otherwise `pip install -e` the repo (maturin builds the core; needs a Rust toolchain).
#
# Then it checks that `ray.serve.llm`, `kvbridge.ray_integration` and vLLM's CPU platform import
# in the venv. A stamp marks a finished install; it is redone when the stamp's text changes,
# the vllm-cpu venv was rebuilt, or the check fails.
#
# Output: progress on stderr, a few lines; pip's output goes to $VENV.serve-llm.log, whose tail
# is printed if a step fails.
#
# Environment: those of tools/vllm_cpu/setup.sh, and
#   KVBRIDGE_SERVE_LLM_FORCE=1   reinstall even if the stamp is present
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
say() { echo "serve_llm/setup.sh: $*" >&2; }
# shellcheck source=../setup_common.sh
source "$REPO/tools/setup_common.sh"

PY="$("$REPO/tools/vllm_cpu/setup.sh")"
VENV="$(dirname "$(dirname "$PY")")"
STAMP="$VENV/.kvbridge-serve-llm-stamp"
VLLM_STAMP="$VENV/.kvbridge-vllm-cpu-stamp"
LOG="$VENV.serve-llm.log"
REQUIREMENTS="ray[serve]==2.60.0 ai-dynamo-runtime==1.6.1 pyarrow pandas jsonref hf_transfer pybind11 meson"
PTH="$(ls "$VENV"/lib/python3*/site-packages -d | head -n 1)/kvbridge-repo.pth"

kvbridge_requirements() {
    "$PY" - "$REPO/pyproject.toml" <<'PYEOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(" ".join(tomllib.load(f)["project"]["dependencies"]))
PYEOF
}

check() {
    python_check '
import ray, ray.serve.llm, vllm, kvbridge.ray_integration, kvbridge._core
from ray.serve.llm.request_router import KVAwareRouter
from vllm.platforms import current_platform
assert current_platform.is_cpu()
print("ray", ray.__version__, "vllm", vllm.__version__, "kvbridge from", kvbridge.__file__)
' RAY_USAGE_STATS_ENABLED=0
}

exec 9>"$VENV.serve-llm.lock"
flock 9

stamp_text="$REQUIREMENTS; $(kvbridge_requirements); kvbridge from $REPO; on $(cat "$VLLM_STAMP")"
if [[ "${KVBRIDGE_SERVE_LLM_FORCE:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$stamp_text" ]]; then
    if check >&2; then
        say "reusing $VENV"
        echo "$PY"
        exit 0
    fi
    say "stamp present but the import check fails; reinstalling"
fi

start=$(date +%s)
: >"$LOG"
say "installing $REQUIREMENTS into $VENV; pip's output goes to $LOG"
# shellcheck disable=SC2086  # word splitting intended
pip_quiet install $REQUIREMENTS $(kvbridge_requirements)
if [[ -f "$REPO/kvbridge/_core.abi3.so" ]]; then
    say "kvbridge: $REPO on the venv's path ($PTH), using the tree's built core"
    echo "$REPO" >"$PTH"
else
    say "kvbridge: pip install -e $REPO (builds the Rust core)"
    rm -f "$PTH"
    pip_quiet install --no-deps -e "$REPO"
fi
# ray[serve] may bring back what tools/vllm_cpu/setup.sh removed.
pip_quiet uninstall --yes torchvision torchaudio torchcodec triton
if ! check >&2; then
    say "the import check failed after the install; see above and $LOG"
    exit 1
fi
echo "$stamp_text" >"$STAMP"
say "installed in $(( $(date +%s) - start )) s"
echo "$PY"
