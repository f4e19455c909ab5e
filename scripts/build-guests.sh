#!/usr/bin/env bash
# Builds the guest images:
# - bare-metal guests (x86_64-unknown-none) into
#   guest-images/target/x86_64-unknown-none/release/;
# - the Linux guests' user-space binaries (static, x86_64-unknown-linux-gnu)
#   into guest-images/target/x86_64-unknown-linux-gnu/release/
#   (docs/linux-guests.md; guest-images/linux/build-image.sh packs them).
set -euo pipefail
cd "$(dirname "$0")/../guest-images"
rustup target add x86_64-unknown-none >/dev/null 2>&1 || true
RUSTFLAGS="-C relocation-model=static" \
    cargo build --release --target x86_64-unknown-none --workspace --exclude linux-guest
echo "guests built in guest-images/target/x86_64-unknown-none/release" >&2
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --target x86_64-unknown-linux-gnu -p linux-guest
echo "Linux guest binaries built in guest-images/target/x86_64-unknown-linux-gnu/release" >&2
