#!/usr/bin/env bash
# Builds the VMM and board daemon (`vnpu`) statically linked and prints
# the binary's path on stdout: the nested test's L1 initramfs has no C
# library to link against (scripts/nested-test.sh), and the QEMU interop
# test runs its daemon from the same build (scripts/qemu-interop.sh), so
# CI compiles the release VMM once, not twice.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "build-static-vmm: cargo build --release -p vnpu-cli (static, x86_64-unknown-linux-gnu)" >&2
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release -q -p vnpu-cli --target x86_64-unknown-linux-gnu
echo "$PWD/target/x86_64-unknown-linux-gnu/release/vnpu"
