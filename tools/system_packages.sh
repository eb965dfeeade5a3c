#!/usr/bin/env bash
# The Debian packages some tests use: tmux (tests/test_watch_tmux.py drives `kvbridge watch` on
# a real terminal) and prometheus's promtool (tests/test_observability.py checks the alert rules
# and dashboard queries). Installed with apt-get when missing; without them (no root, no apt)
# those tests skip and say so. Quiet unless it fails; then one line says what is missing.
set -uo pipefail
missing=()
command -v tmux >/dev/null || missing+=(tmux)
command -v promtool >/dev/null || missing+=(prometheus)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "system_packages.sh: ${missing[*]} not installed (needs root and apt-get); their tests skip" >&2
    exit 0
fi
log=$(mktemp)
if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
             --no-install-recommends "${missing[@]}"; }; } >"$log" 2>&1; then
    echo "system_packages.sh: apt-get could not install ${missing[*]}; their tests skip" >&2
    tail -n 5 "$log" >&2
fi
rm -f "$log"
exit 0
