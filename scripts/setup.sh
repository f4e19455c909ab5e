#!/usr/bin/env bash
# Installs what building and testing the project needs on a fresh machine
# of this kind (Debian, Rust stable via rustup, root). Idempotent.
set -euo pipefail
echo "setup: rust toolchain components" >&2
rustup component add clippy rustfmt >/dev/null 2>&1 || true
echo "setup: x86_64-unknown-none target (bare-metal guests)" >&2
rustup target add x86_64-unknown-none >/dev/null
echo "setup: every package of Cargo.lock (all platforms: tests/tests/layering.rs runs cargo metadata --offline, which reads them all)" >&2
cargo fetch --locked --quiet
echo "setup: QEMU, cpio (the nested Linux-guest test path, docs/linux-guests.md)" >&2
if ! command -v qemu-system-x86_64 >/dev/null || ! command -v cpio >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get install -y -q qemu-system-x86 cpio >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q qemu-system-x86 cpio >/dev/null; })
    else
        echo "setup: install qemu-system-x86 and cpio (Debian packages) for scripts/nested-test.sh" >&2
    fi
fi
echo "setup: QEMU 10.2.2's build dependencies (scripts/build-qemu.sh, which CI runs in the background)" >&2
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    bash scripts/build-qemu.sh --deps
fi
echo "setup: .venv-onnx with ONNX Runtime (the reference for compiled ONNX models), onnx (its node tests) and scikit-learn with skl2onnx, LightGBM with onnxmltools (the scikit-learn and LightGBM models; docs/compiled-model-format.md)" >&2
if [ ! -x .venv-onnx/bin/python ] || ! .venv-onnx/bin/python -c "import onnxruntime, numpy, onnx, sklearn, skl2onnx, lightgbm, onnxmltools" 2>/dev/null; then
    [ -x .venv-onnx/bin/python ] || python3 -m venv .venv-onnx
    .venv-onnx/bin/pip install -q 'onnxruntime==1.32.0' 'numpy==2.4.6' 'onnx==1.23.2' 'scikit-learn==1.9.1' 'skl2onnx==1.20.0' \
        'lightgbm==4.7.0' 'onnxmltools==1.16.0'
fi
