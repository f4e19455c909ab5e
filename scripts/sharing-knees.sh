#!/usr/bin/env bash
# The sharing evaluation's headline runs (docs/evaluation.md, "Sharing
# evaluation"): each system's throughput at the SLA by a search of its own
# knee (`sharing-eval --knee`), 5 seeds, at least 1,000 requests of each
# tenant at every rate, on the built-in board (tpu-v4-derived). Pairs of the
# design's workloads at equal request rates (as V10 and Neu10 pair them) at
# an SLA of 10x each one's isolated latency, two of them also at 2x and 5x,
# and the four-tenant mix weighted by our own partition's times as one row.
# Writes docs/plots/sharing/*.json; prints each run's summary and its
# progress on stderr (redirect it to keep a log).
#
#   bash scripts/sharing-knees.sh [NAME...]     # default: every run below
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p npu-bench --bin sharing-eval
out=docs/plots/sharing
mkdir -p "$out"
run() {
    local name=$1; shift
    echo "== $name: sharing-eval --knee $*" >&2
    local t0=$SECONDS
    target/release/sharing-eval --knee --seeds 5 --min-requests 1000 --json "$out/$name.json" "$@"
    echo "== $name: $((SECONDS - t0)) s" >&2
}
all=(bert-dlrm resnet50-mobilenet transformer-efficientnet bert-resnet50 resnet50-ncf
     bert-dlrm-sla2 bert-dlrm-sla5 resnet50-mobilenet-sla2 resnet50-mobilenet-sla5 balanced4)
want=("${@:-${all[@]}}")
for name in "${want[@]}"; do
    case $name in
        bert-dlrm) run "$name" --tenants bert:1,dlrm:8 --mix equal --qos 10 ;;
        resnet50-mobilenet) run "$name" --tenants resnet50:1,mobilenet:1 --mix equal --qos 10 ;;
        transformer-efficientnet) run "$name" --tenants transformer:1,efficientnet:1 --mix equal --qos 10 ;;
        bert-resnet50) run "$name" --tenants bert:1,resnet50:1 --mix equal --qos 10 ;;
        resnet50-ncf) run "$name" --tenants resnet50:1,ncf:8 --mix equal --qos 10 ;;
        bert-dlrm-sla2) run "$name" --tenants bert:1,dlrm:8 --mix equal --qos 2 ;;
        bert-dlrm-sla5) run "$name" --tenants bert:1,dlrm:8 --mix equal --qos 5 ;;
        resnet50-mobilenet-sla2) run "$name" --tenants resnet50:1,mobilenet:1 --mix equal --qos 2 ;;
        resnet50-mobilenet-sla5) run "$name" --tenants resnet50:1,mobilenet:1 --mix equal --qos 5 ;;
        balanced4) run "$name" --mix balanced --qos 10 ;;
        *) echo "unknown run $name (one of: ${all[*]})" >&2; exit 2 ;;
    esac
done
