#!/usr/bin/env python3
"""Markdown tables of `sharing-eval --knee` results (docs/evaluation.md,
"Sharing evaluation"), from the summaries the JSON files carry (computed by
`sharing-eval`, `npu_bench::metrics`; this script only formats them).

    python3 scripts/sharing_knee_tables.py docs/plots/sharing/*.json
"""
import argparse
import json
import os

SYSTEMS = ["vNPU", "vNPU-H", "vNPU-WC", "Planaria", "V10", "FIFO"]


def spread(s):
    if not s or s.get("seeds", 0) == 0:
        return "-"
    if abs(s["max"] - s["min"]) < 0.005:
        return f"{s['median']:.2f}x"
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def rps(s):
    if not s or s.get("seeds", 0) == 0:
        return "-"
    return f"{s['median']:,.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="sharing-eval --knee --json files")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="systems to show, in order")
    args = ap.parse_args()
    systems = args.systems.split(",")
    print("| mix | SLA | system | req/s at the SLA | / better PREMA-like | p99 lower by | EU util at the knees |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for path in args.files:
        d = json.load(open(path))
        name = os.path.basename(path).removesuffix(".json")
        tenants = " + ".join(t["name"] for t in d["tenants"])
        sla = f"{d['qos_factor']:g}x" if d.get("qos_factor") else "ms"
        by = {s["system"]: s for s in d["summary"]}
        base = max(
            (by[b] for b in ("PREMA-ckpt", "PREMA-drain") if b in by),
            key=lambda s: s["throughput_at_sla_rps"].get("median", 0),
        )
        print(f"| {name} ({tenants}) | {sla} | better PREMA-like ({base['system']}) | {rps(base['throughput_at_sla_rps'])} | | | |")
        for sys in systems:
            s = by.get(sys)
            if s is None:
                continue
            notes = []
            if s.get("p99_unbounded_seeds"):
                notes.append(f"p99 unbounded on {s['p99_unbounded_seeds']} seeds")
            if s.get("lower_bound_seeds"):
                notes.append(f"never failed on {s['lower_bound_seeds']} seeds")
            note = f" ({'; '.join(notes)})" if notes else ""
            print(
                f"| | | {sys}{note} | {rps(s['throughput_at_sla_rps'])} | {spread(s['throughput_ratio'])} "
                f"| {spread(s['p99_ratio'])} | {spread(s.get('knee_utilization_ratio'))} |"
            )


if __name__ == "__main__":
    main()
