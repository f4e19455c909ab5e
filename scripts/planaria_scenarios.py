#!/usr/bin/env python3
"""Planaria-like multi-tenant scenarios on one core:
runs target/release/sharing-eval for each scenario and latency-bound level
and prints one markdown table of the headline ratios against the better
PREMA-like system.

Scenarios (ours, built from the DNNs Planaria's simulator ships with; the
paper's exact A/B/C lists are not available here). Each task picks a DNN
uniformly at random, as Planaria's workload generator does, so the tenants
have equal request rates (`--mix equal`). Priorities: all equal by
default; `--priorities drawn` gives each tenant one priority drawn
uniformly from 1..12 (Planaria's generator draws one per task from that
range; here per tenant, seeded by `--seed`, so PREMA's fairness, which
weighs each tenant's progress by its priority, stays defined per tenant).
Bounds are MLPerf's server
latency constraints in ms (GoogLeNet and YOLOv3 as Planaria's shipped
scheduler.ini sets them), scaled by the level:

  detect   ResNet-50 15, GoogLeNet 15, SSD-ResNet34 100, YOLOv3 100
           (the shipped config)
  light    MobileNet 10, SSD-MobileNet 10, ResNet-50 15, GoogLeNet 15
  translate ResNet-50 15, YOLOv3 100, GNMT 250, SSD-MobileNet 10

Levels: x1 (the MLPerf bounds), x0.5 and x0.25 (tighter).

PREMA-ckpt runs with PREMA's KILL option (sharing-eval's default: a
request preempted before it has run for one context switch is dropped and
started again instead of checkpointed), the stronger baseline;
`--no-prema-kill` runs it without (passed on to sharing-eval).

Per run (`--seconds`, default 0.5 s of Poisson arrivals, rates 0.1..1.0 of
each system's saturation): throughput at the SLA (highest offered rate with
every tenant's p99 within its bound) and, at the offered rate that is 0.9 of
PREMA-like's saturation (PREMA not saturated), busy-EU utilization, p99,
SLA satisfaction and PREMA's fairness of each system: vNPU, vNPU-WC, the
Planaria-like and V10-like comparisons, and FIFO (PREMA's NP-FCFS
baseline) for scale.

  cargo build --release -p npu-bench
  python3 scripts/planaria_scenarios.py [--seconds S] [--seed N] [--out DIR] [--only detect,light] [--levels x1,x0.5] [--no-prema-kill] [--priorities equal|drawn]
"""
import argparse
import json
import os
import random
import subprocess
import sys

SCENARIOS = {
    "detect": [("resnet50", 15), ("googlenet", 15), ("ssd-resnet34", 100), ("yolov3", 100)],
    "light": [("mobilenet", 10), ("ssd-mobilenet", 10), ("resnet50", 15), ("googlenet", 15)],
    "translate": [("resnet50", 15), ("yolov3", 100), ("gnmt", 250), ("ssd-mobilenet", 10)],
}
LEVELS = [("x1", 1.0), ("x0.5", 0.5), ("x0.25", 0.25)]
OURS = ["vNPU", "vNPU-WC", "vNPU-H", "Planaria", "V10", "FIFO"]

p = argparse.ArgumentParser()
p.add_argument("--seconds", default="0.5")
p.add_argument("--seed", default="1")
p.add_argument("--bin", default="target/release/sharing-eval")
p.add_argument("--out", default="target/planaria-scenarios", help="directory for each run's JSON and SVG")
p.add_argument("--only", help="comma-separated scenario names")
p.add_argument("--levels", help="comma-separated bound levels (x1, x0.5, x0.25; default all)")
p.add_argument("--no-prema-kill", action="store_true", help="PREMA-ckpt without PREMA's KILL option")
p.add_argument("--priorities", choices=["equal", "drawn"], default="equal",
               help="all tenants at priority 1, or one priority per tenant drawn from 1..12")
p.add_argument("--knee", action="store_true",
               help="each system's throughput at the SLA by its own knee over --seeds seeds "
                    "(sharing-eval --knee; docs/evaluation.md, \"Metrics\"); the table gives "
                    "median (min-max) over seeds")
p.add_argument("--seeds", default="5", help="with --knee: seeds --seed .. --seed + N - 1")
p.add_argument("--min-requests", default="1000", help="with --knee: fewest requests of each tenant per rate")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
names = a.only.split(",") if a.only else list(SCENARIOS)
for n in names:
    if n not in SCENARIOS:
        sys.exit(f"planaria_scenarios: unknown scenario `{n}` (known: {', '.join(SCENARIOS)})")
levels = LEVELS
if a.levels:
    levels = [(t, x) for t, x in LEVELS if t in a.levels.split(",")]
    unknown = set(a.levels.split(",")) - {t for t, _ in LEVELS}
    if unknown:
        sys.exit(f"planaria_scenarios: unknown level(s) {', '.join(sorted(unknown))} (known: x1, x0.5, x0.25)")


def row_at(rates, offered):
    """The rate whose offered load is nearest `offered`."""
    return min(rates, key=lambda r: abs(r["offered_rps"] - offered))


def ratio(x, y):
    return float("nan") if not y else x / y


def spread(x):
    return "-" if not x or x["seeds"] == 0 else f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})"


if a.knee:
    print("| scenario | bounds | system | throughput at the SLA / PREMA | p99 lower than PREMA by (at 0.8 x PREMA's) | EU util / PREMA (there) |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for n in names:
        tenants = SCENARIOS[n]
        for level, scale in levels:
            tag = f"planaria-{n}-{level}"
            js = os.path.join(a.out, f"{tag}.json")
            cmd = [a.bin, "--knee", "--seeds", a.seeds, "--min-requests", a.min_requests,
                   "--tenants", ",".join(w for w, _ in tenants),
                   "--sla-ms", ",".join(f"{ms * scale:g}" for _, ms in tenants),
                   "--mix", "equal", "--seconds", a.seconds, "--seed", a.seed, "--json", js]
            if a.no_prema_kill:
                cmd.append("--no-prema-kill")
            print(f"planaria_scenarios: {tag}: {' '.join(cmd)}", file=sys.stderr)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            j = json.load(open(js))
            for x in j["summary"]:
                if x["system"].startswith("PREMA"):
                    continue
                unb = f" ({x['p99_unbounded_seeds']} seeds unbounded)" if x["p99_unbounded_seeds"] else ""
                print(f"| {n} | {level} | {x['system']} | {spread(x['throughput_ratio'])} "
                      f"| {spread(x['p99_ratio'])}{unb} | {spread(x['utilization_ratio'])} |", flush=True)
    sys.exit(0)

print("| scenario | bounds | system | SLA throughput / PREMA | EU util / PREMA | p99 lower than PREMA by | SLA satisfaction (PREMA) | fairness (PREMA) |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
for n in names:
    tenants = SCENARIOS[n]
    for level, scale in levels:
        tag = f"{n}-{level}"
        js = os.path.join(a.out, f"{tag}.json")
        cmd = [a.bin, "--tenants", ",".join(w for w, _ in tenants),
               "--sla-ms", ",".join(f"{ms * scale:g}" for _, ms in tenants),
               "--mix", "equal", "--seconds", a.seconds, "--seed", a.seed,
               "--json", js, "--svg", os.path.join(a.out, f"{tag}.svg")]
        if a.no_prema_kill:
            cmd.append("--no-prema-kill")
        label = n
        if a.priorities == "drawn":
            rng = random.Random(f"{a.seed}-{n}")
            prios = ",".join(str(rng.randint(1, 12)) for _ in tenants)
            cmd += ["--priority", prios]
            label = f"{n} (priorities {prios})"
        print(f"planaria_scenarios: {tag}: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        j = json.load(open(js))
        at_sla = {x["system"]: x["throughput_rps"] for x in j["throughput_at_sla"]}
        prema_sla = max(at_sla["PREMA-ckpt"], at_sla["PREMA-drain"])
        # The offered rate at 0.9 of PREMA-like's saturation.
        r = row_at(j["rates"], 0.9 * j["saturation_rps"]["PREMA-like"])
        s = {x["system"]: x for x in r["systems"]}
        pk, pd = s["PREMA-ckpt"], s["PREMA-drain"]
        best_util = max(pk["eu_utilization"], pd["eu_utilization"])
        best_p99 = min(pk["p99_latency_s"], pd["p99_latency_s"])
        prema_sat = max(pk["sla_satisfaction"], pd["sla_satisfaction"])
        prema_fair = max(pk["fairness"], pd["fairness"])
        for sys_name in OURS:
            x = s[sys_name]
            print(f"| {label} | {level} | {sys_name} | {ratio(at_sla[sys_name], prema_sla):.2f}x "
                  f"| {ratio(x['eu_utilization'], best_util):.2f}x | {ratio(best_p99, x['p99_latency_s']):.2f}x "
                  f"| {100 * x['sla_satisfaction']:.1f}% ({100 * prema_sat:.1f}%) "
                  f"| {x['fairness']:.3f} ({prema_fair:.3f}) |", flush=True)
