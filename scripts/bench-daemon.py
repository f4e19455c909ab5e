#!/usr/bin/env python3
"""The board daemon's guest-visible cost (docs/benchmarks.md).

Boots the ring-bench and digits guests, round by round, two ways, the
order alternated every round so no side always runs first or last:

  in-process   `vnpu run --vnpu type=small` (the device in the VMM, a
               private core)
  daemon       `vnpu run --vnpu uuid=U` attached over vfio-user to a
               `vnpu daemon` started by this script (the board runtime
               every shared core runs on)

Every number is measured by the guest on its TSC (one clock for all
sides) and printed by it; this script only collects them and prints, per
metric and side, min / median / max over the rounds, and the per-round
ratio daemon / in-process (for latencies: the daemon's is that many times
the in-process one; for images/s: the daemon delivers that fraction).

Usage: python3 scripts/bench-daemon.py [--rounds N] [--json FILE]
       (RAYON_NUM_THREADS=1 in the environment: one GEMM thread in every
       process, which removes the model's bimodal MLP timing on 2 cores)
(build first: bash scripts/build-guests.sh && cargo build --release -p vnpu-cli)
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VNPU = os.path.join(ROOT, "target/release/vnpu")
GUESTS = os.path.join(ROOT, "guest-images/target/x86_64-unknown-none/release")

# (metric, guest, regex on its output, unit, higher is better)
METRICS = [
    ("nop polled", "ring-bench", r"vNPU nop, polled\s+([\d.]+) us", "us", False),
    ("nop interrupt", "ring-bench", r"vNPU nop, interrupt\s+([\d.]+) us", "us", False),
    ("mlp batch-1 latency", "digits", r"latency per image \(batch 1\): ([\d.]+) us", "us", False),
    ("mlp images/s", "digits", r"batch of 450: (\d+) images/s", "images/s", True),
    ("cnn batch-1 latency", "digits", r"latency per image \(batch 1\): ([\d.]+) us", "us", False),
    ("cnn images/s", "digits", r"batch of 450: (\d+) images/s", "images/s", True),
]
RAW = [
    ("raw ioeventfd write", r"raw ioeventfd write\s+([\d.]+) us"),
    ("raw ioeventfd->irqfd MSI", r"raw ioeventfd->irqfd MSI\s+([\d.]+) us"),
]
SIDES = ["in-process", "daemon"]


def run(cmd, timeout=300):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"bench-daemon: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def boot(side, guest, state, uuid):
    path = os.path.join(GUESTS, guest)
    if side == "in-process":
        return run([VNPU, "run", "--guest", path, "--memory", "64M", "--vnpu", "type=small"])
    return run([VNPU, "run", "--guest", path, "--memory", "64M", "--vnpu", f"uuid={uuid}",
                "--state-dir", state])


def values(out, regex):
    """Every match of `regex` in `out`, as floats (digits prints MLP then CNN)."""
    return [float(m) for m in re.findall(regex, out)]


def stats(xs):
    return min(xs), statistics.median(xs), max(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write every sample here")
    args = ap.parse_args()
    for f in [VNPU, os.path.join(GUESTS, "ring-bench"), os.path.join(GUESTS, "digits")]:
        if not os.path.exists(f):
            sys.exit(f"bench-daemon: {f} is missing (bash scripts/build-guests.sh && "
                     "cargo build --release -p vnpu-cli)")
    tmp = tempfile.mkdtemp(prefix="vnpu-bench-daemon-")
    state = os.path.join(tmp, "state")
    daemon = subprocess.Popen([VNPU, "daemon", "--state-dir", state],
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "daemon.log"), "w"))
    try:
        control = os.path.join(state, "sockets", "control.sock")
        for _ in range(200):
            if os.path.exists(control):
                break
            time.sleep(0.05)
        uuid = run([VNPU, "create", "--type", "small", "--state-dir", state]).strip()
        samples = {side: {m[0]: [] for m in METRICS} | {r[0]: [] for r in RAW} for side in SIDES}
        for r in range(args.rounds):
            order = SIDES[r % 2:] + SIDES[:r % 2]
            for guest in ["ring-bench", "digits"]:
                for side in order:
                    out = boot(side, guest, state, uuid)
                    for name, g, regex, _, _ in METRICS:
                        if g != guest:
                            continue
                        found = values(out, regex)
                        # digits prints the MLP's line, then the CNN's.
                        idx = 1 if name.startswith("cnn") else 0
                        if len(found) <= idx:
                            sys.exit(f"bench-daemon: no `{name}` in the {side} {guest} output:\n{out}")
                        samples[side][name].append(found[idx])
                    if guest == "ring-bench":
                        for name, regex in RAW:
                            samples[side][name] += values(out, regex)[:1]
            print(f"round {r + 1}/{args.rounds} done (order {', '.join(order)})", file=sys.stderr)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{args.rounds} rounds; min / median / max; ratio = daemon / in-process per round")
    print(f"{'metric':<26} {'in-process':>24} {'daemon':>24} {'ratio':>22}")
    for name, _, _, unit, _ in METRICS:
        cols = ["{:.1f} / {:.1f} / {:.1f}".format(*stats(samples[s][name])) for s in SIDES]
        ratios = [d / i for d, i in zip(samples["daemon"][name], samples["in-process"][name])]
        print(f"{name + ' (' + unit + ')':<26} {cols[0]:>24} {cols[1]:>24} "
              + "{:.3f} / {:.3f} / {:.3f}".format(*stats(ratios)))
    for name, _ in RAW:
        cols = ["{:.2f} / {:.2f} / {:.2f}".format(*stats(samples[s][name])) for s in SIDES]
        print(f"{name + ' (us)':<26} {cols[0]:>24} {cols[1]:>24}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
