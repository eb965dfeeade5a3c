# Sourced by the scripts beside it: creates .venv on first use, with kvbridge installed editable
# (its Rust core, native/, built by maturin) and its dev extra. The whole install is redone when
# pyproject.toml changes; the core alone is rebuilt when its sources change.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.kvbridge-installed"
core_stamp="$venv/.kvbridge-core-built"
want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
want_core=$(cd "$root" && find native -path native/target -prune -o -type f \( -name '*.rs' -o -name 'Cargo.*' \) -print \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
pip_quiet() {
  # pip is quiet unless it fails; then its whole log is shown.
  local log
  log=$(mktemp)
  if ! "$venv/bin/pip" install --quiet --disable-pip-version-check "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "kvbridge: installing into .venv (first run: about 2 minutes, ~850 MB; the Rust core is compiled)" >&2
  started=$SECONDS
  python3 -m venv "$venv"
  pip_quiet -e "$root[dev]"
  echo "$want" > "$stamp"
  echo "$want_core" > "$core_stamp"
  echo "kvbridge: installed in $((SECONDS - started)) s" >&2
elif [ "$(cat "$core_stamp" 2>/dev/null)" != "$want_core" ]; then
  echo "kvbridge: rebuilding the Rust core" >&2
  pip_quiet --no-deps -e "$root"
  echo "$want_core" > "$core_stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
