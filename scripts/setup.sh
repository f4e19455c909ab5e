#!/usr/bin/env bash
# Installs what building and testing the project needs on a fresh machine
# of this kind (Debian, Rust stable via rustup, root). Idempotent.
set -euo pipefail
echo "setup: rust toolchain components" >&2
rustup component add clippy rustfmt >/dev/null 2>&1 || true
echo "setup: x86_64-unknown-none target (bare-metal guests)" >&2
rustup target add x86_64-unknown-none >/dev/null
