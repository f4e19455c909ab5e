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
