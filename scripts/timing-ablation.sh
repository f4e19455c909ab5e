#!/usr/bin/env bash
# The timing model's ablation (docs/npu-model.md, "Validation"): each
# change to data movement alone and all together, on the anchors'
# boards, simulated time from `vnpu workload run` (deterministic).
#
#   scripts/timing-ablation.sh [path/to/vnpu]
#
# Columns: ResNet-50 batch 256 on a TPU v3 core (images/s; published
# 4,089.5), bf16 GEMM 8192^3 and 4096^3 on a TPU v5e core (ms; published
# 6.047 and 0.827), and simulated ms of library workloads at batch 8 on a
# TPU v4 core. Every row keeps HBM reuse by liveness on (ResNet-50 at
# batch 256 does not fit a v3 core's 16 GiB without it).
set -euo pipefail
cd "$(dirname "$0")/.."
vnpu=${1:-target/release/vnpu}
[ -x "$vnpu" ] || cargo build --release -q -p vnpu-cli
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Board variants: weight buffering, and 4 DMA transfers in flight (-k4;
# the presets keep the default 1: the hardware's depth is not published).
for b in tpu-v3 tpu-v4 tpu-v5e; do
    cp "docs/boards/$b.toml" "$tmp/$b-double.toml"
    sed 's/^sa_weight_buffering = "double"/sa_weight_buffering = "single"/' "docs/boards/$b.toml" > "$tmp/$b-single.toml"
    for v in single double; do
        sed 's/^in_flight = 1 .*/in_flight = 4/' "$tmp/$b-$v.toml" > "$tmp/$b-$v-k4.toml"
        grep -q '^in_flight = 4' "$tmp/$b-$v-k4.toml"
    done
done
# name | weight buffering | flags
# Every row gives every lowering flag, so the presets' [lowering] table
# decides nothing here.
f32="--dtype f32 --activations f32"
rows=(
    "SCALE-Sim single-buffered weights, f32 data|single|$f32 --fuse-residual=false --stream-weights=false --keep-on-chip=false"
    "MXU weight double-buffering (2b)|double|$f32 --fuse-residual=false --stream-weights=false --keep-on-chip=false"
    "bf16 operands, f32 activations|single|--dtype bf16 --activations f32 --fuse-residual=false --stream-weights=false --keep-on-chip=false"
    "bf16 operands and activations (2a)|single|--dtype bf16 --activations bf16 --fuse-residual=false --stream-weights=false --keep-on-chip=false"
    "weights streamed within products (2c)|single|$f32 --fuse-residual=false --stream-weights --keep-on-chip=false"
    "residual adds fused (2d)|single|$f32 --fuse-residual --stream-weights=false --keep-on-chip=false"
    "activations kept on chip (2d)|single|$f32 --fuse-residual=false --stream-weights=false --keep-on-chip"
    "4 DMA transfers in flight (2e)|single-k4|$f32 --fuse-residual=false --stream-weights=false --keep-on-chip=false"
    "all together (the presets)|double|--dtype bf16 --activations bf16 --fuse-residual --stream-weights --keep-on-chip"
    "all together, 4 DMA transfers in flight|double-k4|--dtype bf16 --activations bf16 --fuse-residual --stream-weights --keep-on-chip"
    "all together, weights not streamed|double|--dtype bf16 --activations bf16 --fuse-residual --stream-weights=false --keep-on-chip"
    "all together, activations not kept on chip|double|--dtype bf16 --activations bf16 --fuse-residual --stream-weights --keep-on-chip=false"
)
ms() {
    "$vnpu" workload run "$@" --reuse-hbm --json |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["simulated_seconds"])'
}
printf '| change | ResNet-50 b256 v3 (img/s) | GEMM 8192^3 v5e (ms) | GEMM 4096^3 v5e (ms) | ResNet-50 b8 v4 (ms) | BERT b8 v4 (ms) | MobileNet b8 v4 (ms) |\n'
printf '| --- | --- | --- | --- | --- | --- | --- |\n'
for row in "${rows[@]}"; do
    IFS='|' read -r name buf flags <<< "$row"
    # shellcheck disable=SC2086
    {
        r50=$(ms resnet50 --board "$tmp/tpu-v3-$buf.toml" --sa 2 --vu 1 --batch 256 $flags)
        g8=$(ms gemm-8192x8192x8192 --board "$tmp/tpu-v5e-$buf.toml" --sa 4 --vu 1 $flags)
        g4=$(ms gemm-4096x4096x4096 --board "$tmp/tpu-v5e-$buf.toml" --sa 4 --vu 1 $flags)
        v4=()
        for w in resnet50 bert mobilenet; do
            v4+=("$(ms "$w" --board "$tmp/tpu-v4-$buf.toml" --sa 4 --vu 1 --batch 8 $flags)")
        done
    }
    awk -v n="$name" -v r="$r50" -v a="$g8" -v b="$g4" -v x="${v4[0]}" -v y="${v4[1]}" -v z="${v4[2]}" \
        'BEGIN { printf "| %s | %.0f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", n, 256 / r, a * 1e3, b * 1e3, x * 1e3, y * 1e3, z * 1e3 }'
done
