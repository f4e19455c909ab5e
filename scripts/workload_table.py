#!/usr/bin/env python3
"""Prints the workload characterization table (markdown) of docs/workloads.md.

Runs `vnpu workload run NAME --sa SA --vu VU --batch B --json` for every
workload and batch size. Usage:
    cargo build --release -p vnpu-cli
    python3 scripts/workload_table.py [--sa 1 --vu 1] [--bin target/release/vnpu] [--only a,b]
"""
import argparse
import json
import sys
import subprocess

p = argparse.ArgumentParser()
p.add_argument("--sa", type=int, default=1)
p.add_argument("--vu", type=int, default=1)
p.add_argument("--bin", default="target/release/vnpu")
p.add_argument("--batches", default="1,8,32")
p.add_argument("--only", help="comma-separated workload names (default: every one `vnpu workload list` names)")
a = p.parse_args()

names = [l.split()[0] for l in subprocess.check_output([a.bin, "workload", "list"], text=True).splitlines()]
if a.only:
    names = [n for n in a.only.split(",") if n in names] or names
print(f"| workload | batch | simulated cycles | ms | SA active | VU active | SA/VU (a) | SA util | VU util | FLOPS util |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for n in names:
    for b in a.batches.split(","):
        run = subprocess.run(
            [a.bin, "workload", "run", n, "--sa", str(a.sa), "--vu", str(a.vu), "--batch", b, "--json"],
            text=True, capture_output=True)
        if run.returncode != 0:
            # Too large for the vNPU (HBM, or instructions per request): said, not a row.
            print(f"{n} b{b} left out: {run.stderr.strip()}", file=sys.stderr)
            continue
        r = json.loads(run.stdout)
        ratio = r["sa_active_cycles"] / max(1, r["vu_active_cycles"])
        print(f'| {n} | {b} | {r["simulated_cycles"]} | {r["simulated_seconds"]*1e3:.3f} | {r["sa_active_cycles"]} | '
              f'{r["vu_active_cycles"]} | {ratio:.2f} | {100*r["sa_utilization"]:.1f}% | {100*r["vu_utilization"]:.1f}% | '
              f'{100*r["flops_utilization"]:.1f}% |')
