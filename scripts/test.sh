#!/usr/bin/env bash
# Runs every check CI runs: formatting, lints, and all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build-guests.sh
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p vnpu-driver --features std --all-targets --locked -- -D warnings
cargo test --workspace --locked
bash scripts/fuzz-smoke.sh
bash scripts/nested-test.sh
