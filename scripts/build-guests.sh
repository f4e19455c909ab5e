#!/usr/bin/env bash
# Builds the bare-metal guest images (x86_64-unknown-none) into
# guest-images/target/x86_64-unknown-none/release/.
set -euo pipefail
cd "$(dirname "$0")/../guest-images"
rustup target add x86_64-unknown-none >/dev/null 2>&1 || true
RUSTFLAGS="-C relocation-model=static" \
    cargo build --release --target x86_64-unknown-none
echo "guests built in guest-images/target/x86_64-unknown-none/release" >&2
