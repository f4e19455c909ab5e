#!/usr/bin/env bash
# Compiles the two models of tests/scenarios/harvest.toml as spread
# programs (docs/isa.md, "Spread programs") into target/harvest/: the
# PyTorch digits CNN (SA-heavy) and the vector head (VU only), each for a
# vNPU of 1 SA + 1 VU that may spread over 3 more of each.
#   bash scripts/harvest-models.sh [VNPU_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
vnpu=${1:-target/release/vnpu}
[ -n "${1:-}" ] || cargo build --release -q -p vnpu-cli
mkdir -p target/harvest
# The CNN at batch 10 (45 requests of the 450 test images: at batch 1
# the lowering has one stream of each kind, nothing to spread); the
# vector head at batch 1 (4 requests).
for mb in torch/digits-cnn:10 ops/vector-head:1; do
    m=${mb%:*}
    name=$(basename "$m")
    "$vnpu" compile "tests/fixtures/onnx/$m.onnx" --vnpu sa=1,vu=1,sram=8M,hbm=512M \
        --spread 3,3 --batch "${mb#*:}" -o "target/harvest/$name.vnpu" > /dev/null
done
echo "target/harvest: digits-cnn.vnpu vector-head.vnpu"
