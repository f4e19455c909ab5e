#!/usr/bin/env bash
# Runs every check CI runs: formatting, lints, and all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build-guests.sh
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p vnpu-driver --features std --all-targets --locked -- -D warnings
# ONNX's backend node tests, regenerated from the pinned onnx package, for
# device/npu-onnx/tests/conformance.rs (docs/model-format.md, "Conformance").
.venv-onnx/bin/python scripts/onnx_conformance.py target/onnx-node-tests
cargo test --workspace --locked
bash scripts/fuzz-smoke.sh
bash scripts/nested-test.sh
# QEMU 10.2.2's own vfio-user client against the daemon (docs/vfio-user.md):
# built from Debian's source package once per machine (about 3 minutes),
# then the same Debian guest in it (about 10 seconds), without and with
# QEMU's vIOMMU (which maps the guest's DMA memory page by page).
qemu=$(bash scripts/build-qemu.sh)
QEMU=$qemu bash scripts/qemu-interop.sh
QEMU=$qemu VIOMMU=1 bash scripts/qemu-interop.sh
