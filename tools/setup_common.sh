# Shell functions shared by tools/vllm_cpu/setup.sh and tools/serve_llm/setup.sh, which source
# this file (it is not run on its own). Before calling them a script sets PY (the venv's
# python), LOG (where pip's output goes) and defines say (a progress line on stderr).

# pip with its output in $LOG only; on failure, the log's tail on stderr.
pip_quiet() {
    echo "+ pip $*" >>"$LOG"
    if ! PIP_PROGRESS_BAR=off "$PY" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
        say "pip $* failed; the last lines of $LOG:"
        tail -n 30 "$LOG" >&2
        exit 1
    fi
}

# python_check CODE [VAR=value ...]: run CODE with $PY outside any source tree, offline (no
# usage stats, no Hugging Face Hub) and with the given variables. Prints its last line (the
# versions it reports), or on failure its last 20 lines (vLLM's log lines too), and fails.
python_check() {
    local code="$1" out
    shift
    if out=$(cd / && env VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 "$@" "$PY" -c "$code" 2>&1); then
        echo "${out##*$'\n'}"
        return 0
    fi
    echo "$out" | tail -n 20
    return 1
}
