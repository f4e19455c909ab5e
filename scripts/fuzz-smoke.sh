#!/usr/bin/env bash
# A short run of every fuzz target (docs/fuzzing.md): catches a decoder,
# verifier or request-path regression that the seeds and a few seconds of
# mutation reach. Needs the nightly toolchain (present on this project's
# machines; installed with rustup when missing) and cargo-fuzz (installed
# from crates.io when missing). Fails, never skips: when nightly or
# cargo-fuzz cannot be had, when a target does not build, or when a run
# crashes, times out, runs out of memory or exits non-zero.
# FUZZ_SECONDS per target (default 15).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${FUZZ_SECONDS:-15}"
targets=(program_decode_verify program_execute pci_bus vnpu_ring vfio_user_server vfio_user_session control_request model_decode onnx_compile npy_read dma_table session_resume device_stream precopy_pieces migration_stream)
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz-smoke: no nightly toolchain; installing it with rustup" >&2
    if ! rustup toolchain install nightly --profile minimal >&2; then
        echo "fuzz-smoke: FAILED: the fuzz targets need a nightly toolchain (rustup toolchain install nightly)" >&2
        exit 1
    fi
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz" >&2
    cargo install --locked cargo-fuzz >&2
fi
# Every target must build; a build failure fails the run.
echo "fuzz-smoke: building ${targets[*]}" >&2
cargo +nightly fuzz build >&2
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for t in "${targets[@]}"; do
    seeds=()
    [ -d "seeds/$t" ] && seeds=("seeds/$t")
    # The compiler starts from the committed test models and from
    # scikit-learn models as skl2onnx exports them (ai.onnx.ml operators;
    # scripts/sklearn_models.py in the venv scripts/setup.sh makes).
    if [ "$t" = onnx_compile ]; then
        ../.venv-onnx/bin/python ../scripts/sklearn_models.py "$tmp/sklearn" >&2
        seeds=(../tests/fixtures/onnx/ops ../tests/fixtures/onnx/torch "$tmp/sklearn")
    fi
    mkdir -p "corpus/$t"
    echo "fuzz-smoke: $t for ${secs}s" >&2
    status=0
    cargo +nightly fuzz run "$t" "corpus/$t" "${seeds[@]}" -- \
        -max_total_time="$secs" -timeout=5 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="$tmp/" >"$tmp/log" 2>&1 || status=$?
    grep -E "^(stat::number_of_executed_units|Done|==|thread)" "$tmp/log" >&2 || true
    # A crash, timeout or OOM leaves an input in the artifact directory.
    if [ "$status" -ne 0 ] || ls "$tmp"/crash-* "$tmp"/timeout-* "$tmp"/oom-* "$tmp"/leak-* >/dev/null 2>&1; then
        mkdir -p "artifacts/$t"
        find "$tmp" -maxdepth 1 -type f ! -name log -exec cp {} "artifacts/$t/" \;
        tail -n 40 "$tmp/log" >&2
        echo "fuzz-smoke: FAILED: $t exited $status; inputs kept in fuzz/artifacts/$t" >&2
        exit 1
    fi
    rm -f "$tmp/log"
done
echo "fuzz-smoke: all ${#targets[@]} targets ran ${secs}s each without a failure" >&2
