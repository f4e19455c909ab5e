#!/usr/bin/env python3
"""Prints the rows of the sharing-evaluation tables of docs/evaluation.md
from a `sharing-eval --json` file: every system at each chosen offered
rate, then the ratios of vNPU, vNPU-WC and Planaria to the best PREMA-like
baseline on throughput, busy-EU utilization and p99.

  python3 scripts/sharing_table.py docs/plots/sharing-eval.json [--rates 5411,12980,...]

Rates are matched to the nearest offered rate of the file (default: all).
"""
import argparse
import json


def count(x):
    return f"{round(x):,}"


def latency(s):
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


p = argparse.ArgumentParser()
p.add_argument("json")
p.add_argument("--rates", help="comma-separated offered rates (req/s)")
a = p.parse_args()
j = json.load(open(a.json))
rates = j["rates"]
if a.rates:
    want = [float(x) for x in a.rates.split(",")]
    rates = [min(rates, key=lambda r, w=w: abs(r["offered_rps"] - w)) for w in want]

print("| offered req/s | system | load | req/s | busy-EU util | avg latency | p99 latency | fairness | ANTT | STP | in SLA | switches | kills |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rates:
    off = count(r["offered_rps"])
    for s in r["systems"]:
        print(f"| {off} | {s['system']} | {s['load']:.2f} | {count(s['throughput_rps'])} | "
              f"{100 * s['eu_utilization']:.1f}% | {latency(s['avg_latency_s'])} | {latency(s['p99_latency_s'])} | "
              f"{s['fairness']:.3f} | {s['antt']:.1f} | {s['stp']:.2f} | {100 * s['sla_satisfaction']:.1f}% | "
              f"{s['context_switches']} | {s.get('kills', 0)} |")
    for name in sorted(r["vs_best_baseline"]):
        v = r["vs_best_baseline"][name]
        print(f"| | **{name} / best baseline** | | **{v['throughput_ratio']:.2f}x** | "
              f"**{v['eu_utilization_ratio']:.2f}x** | | **{v['p99_lower_ratio']:.1f}x lower** | | | | | | |")
