# Sourced by the scripts beside it: creates .venv on first use (and again whenever
# pyproject.toml changes), with kvbridge installed editable and its dev extra.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.kvbridge-installed"
want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -e "$root[dev]" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
