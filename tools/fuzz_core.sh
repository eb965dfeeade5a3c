#!/usr/bin/env bash
# A bounded cargo-fuzz run of native/fuzz's `payload` target (kvbridge-core's decoder and
# normalizer, see native/fuzz/README.md) on the stable toolchain.
#
#   tools/fuzz_core.sh            # 180 seconds
#   tools/fuzz_core.sh 60         # 60 seconds
#   tools/fuzz_core.sh -runs=N    # N executions
#
# Installs cargo-fuzz into ~/.cargo/bin if it is missing. Prints the executions and the time
# they took; exits non-zero, with libFuzzer's report and the crashing input's path, if an input
# made the target panic. Extra arguments after the first go to libFuzzer (`-seed=1`, say).
# KVBRIDGE_FUZZ_SANITIZER=address builds with AddressSanitizer (3x slower, so the default is
# none; the core's only unsafe code is the AVX-512 token loop's, see native/fuzz/README.md).
set -euo pipefail
cd "$(dirname "$0")/../native/fuzz"

CARGO_FUZZ_VERSION=0.13.2
limit=${1:-180}
shift || true
case "$limit" in
    -runs=*) bound=("$limit") ;;
    *[!0-9]* | "") echo "usage: $0 [SECONDS|-runs=N] [libFuzzer flags...]" >&2; exit 2 ;;
    *) bound=("-max_total_time=$limit") ;;
esac

export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION (once, into ~/.cargo/bin)" >&2
    cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION" >&2
fi

# libFuzzer's instrumentation takes -Z flags, which stable rustc accepts only when bootstrapping.
export RUSTC_BOOTSTRAP=1
sanitizer=${KVBRIDGE_FUZZ_SANITIZER:-none}
flags=(--sanitizer "$sanitizer" --debug-assertions)

build_log=$(mktemp -t fuzz_core_build.XXXXXX.log)
if ! cargo fuzz build "${flags[@]}" payload >"$build_log" 2>&1; then
    cat "$build_log" >&2
    exit 1
fi
rm -f "$build_log"

# New inputs go to corpus/payload (ignored by git, kept between runs); seeds/ is read only.
mkdir -p corpus/payload artifacts/payload
log=$(mktemp -t fuzz_core.XXXXXX.log)
start=$(date +%s%N)
status=0
cargo fuzz run "${flags[@]}" payload corpus/payload seeds/payload -- \
    -dict=payload.dict -max_len=16384 -rss_limit_mb=2048 -print_final_stats=1 \
    "${bound[@]}" "$@" >"$log" 2>&1 || status=$?
ms=$((($(date +%s%N) - start) / 1000000))
elapsed=$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))

runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
if [ "$status" -ne 0 ]; then
    tail -n 60 "$log" >&2
    echo "fuzz_core: FAILED after ${runs:-?} executions (${elapsed} s); log: $log" >&2
    ls -1 artifacts/payload >&2 || true
    exit "$status"
fi
printf 'fuzz_core: %s executions in %s s, no crash (corpus: %s inputs)\n' \
    "${runs:-?}" "$elapsed" "$(find corpus/payload -type f | wc -l)"
rm -f "$log"
