#!/usr/bin/env bash
# A short run of every fuzz target (docs/fuzzing.md): catches a decoder,
# verifier or request-path regression that the seeds and a few seconds of
# mutation reach. Needs the nightly toolchain; installs cargo-fuzz if it is
# missing. FUZZ_SECONDS per target (default 15).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${FUZZ_SECONDS:-15}"
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz-smoke: no nightly toolchain; skipped (rustup toolchain install nightly)" >&2
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz" >&2
    cargo install --locked cargo-fuzz >/dev/null
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for t in program_decode_verify program_execute pci_bus vnpu_ring; do
    seeds=()
    [ -d "seeds/$t" ] && seeds=("seeds/$t")
    mkdir -p "corpus/$t"
    echo "fuzz-smoke: $t for ${secs}s" >&2
    cargo +nightly fuzz run "$t" "corpus/$t" "${seeds[@]}" -- \
        -max_total_time="$secs" -timeout=5 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="$tmp/" 2>&1 \
        | grep -E "^(stat::number_of_executed_units|Done|==|thread)" || true
    # A crash, timeout or OOM leaves an input in the artifact directory.
    if ls "$tmp"/* >/dev/null 2>&1; then
        mkdir -p "artifacts/$t"
        cp "$tmp"/* "artifacts/$t/"
        echo "fuzz-smoke: $t failed; inputs kept in fuzz/artifacts/$t: $(ls "$tmp")" >&2
        exit 1
    fi
done
