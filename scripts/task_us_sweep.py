#!/usr/bin/env python3
"""The `--task-us` sweep of docs/evaluation.md ("Task length"): runs
target/release/sharing-eval on the balanced and the equal-rate mix at
loads 0.3, 0.6 and 0.9 of each system's saturation for each task length,
and prints one markdown row per length: vNPU-WC's saturation over
PREMA-like's, its throughput at the SLA (equal mix: also over the better
PREMA-like's), its p99 against the better PREMA-like at the lowest rate,
its fairness there (equal mix) and the longest wait of an owner for
engines it lent (over all rates).

  cargo build --release -p npu-bench
  python3 scripts/task_us_sweep.py [--tasks 10,25,50,100,200] [--seconds S] [--out DIR]
"""
import argparse
import json
import os
import subprocess

p = argparse.ArgumentParser()
p.add_argument("--tasks", default="10,25,50,100,200")
p.add_argument("--seconds", default="0.5")
p.add_argument("--bin", default="target/release/sharing-eval")
p.add_argument("--out", default="target/task-us-sweep", help="directory for each run's JSON")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)


def run(mix, t):
    js = os.path.join(a.out, f"{mix}-{t}.json")
    cmd = [a.bin, "--mix", mix, "--load", "0.3,0.6,0.9", "--task-us", t, "--seconds", a.seconds, "--json", js]
    print(f"task_us_sweep: {' '.join(cmd)}", flush=True, file=__import__("sys").stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(js))


def at_sla(j, name):
    return next(x["throughput_rps"] for x in j["throughput_at_sla"] if x["system"] == name)


def wc(r):
    return next(s for s in r["systems"] if s["system"] == "vNPU-WC")


def longest_wait_us(j):
    return 1e6 * max(wc(r)["reclaim_max_s"] for r in j["rates"])


print("| `--task-us` | balanced: saturation vs PREMA | balanced: vNPU-WC at the SLA | balanced: p99 lower at the lowest rate "
      "| equal: saturation vs PREMA | equal: vNPU-WC at the SLA (vs best PREMA-like) | equal: fairness at the lowest rate "
      "| longest wait for lent engines (equal / balanced) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for t in a.tasks.split(","):
    b, e = run("balanced", t), run("equal", t)
    sat = lambda j: j["saturation_rps"]["vNPU-WC"] / j["saturation_rps"]["PREMA-like"]
    bs, es = at_sla(b, "vNPU-WC"), at_sla(e, "vNPU-WC")
    eb = max(at_sla(e, "PREMA-ckpt"), at_sla(e, "PREMA-drain"))
    low_b, low_e = b["rates"][0], e["rates"][0]
    fmt = lambda x: f"{round(x):,} req/s" if x > 0 else "none"
    ratio = f" ({es / eb:.2f}x)" if es > 0 and eb > 0 else ""
    print(f"| {t} | {sat(b):.2f}x | {fmt(bs)} | {low_b['vs_best_baseline']['vNPU-WC']['p99_lower_ratio']:.2f}x "
          f"| {sat(e):.2f}x | {fmt(es)}{ratio} | {wc(low_e)['fairness']:.2f} "
          f"| {longest_wait_us(e):.0f} / {longest_wait_us(b):.0f} us |", flush=True)
