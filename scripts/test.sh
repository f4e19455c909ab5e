#!/usr/bin/env bash
# Runs every check CI runs: formatting, lints, and all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step's wall time goes to stderr, for keeping CI inside its budget.
step() {
    local t0=$SECONDS status=0
    "$@" || status=$?
    echo "test.sh: $((SECONDS - t0)) s: $* (exit $status)" >&2
    return "$status"
}
step bash scripts/setup.sh
step bash scripts/build-guests.sh
step cargo fmt --all --check
step cargo clippy --workspace --all-targets --locked -- -D warnings
step cargo clippy -p vnpu-driver --features std --all-targets --locked -- -D warnings
# ONNX's backend node tests, regenerated from the pinned onnx package, for
# device/npu-onnx/tests/conformance.rs (docs/model-format.md, "Conformance").
step .venv-onnx/bin/python scripts/onnx_conformance.py target/onnx-node-tests
step cargo test --workspace --locked
step bash scripts/fuzz-smoke.sh
step bash scripts/nested-test.sh
# QEMU 10.2.2's own vfio-user client against the daemon (docs/vfio-user.md):
# built from Debian's source package once per machine (about 3 minutes),
# then the same Debian guest in it (about 10 seconds), without and with
# QEMU's vIOMMU (which maps the guest's DMA memory page by page).
qemu=$(step bash scripts/build-qemu.sh)
step env QEMU=$qemu bash scripts/qemu-interop.sh
step env QEMU=$qemu VIOMMU=1 bash scripts/qemu-interop.sh
