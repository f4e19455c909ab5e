#!/usr/bin/env python3
"""`vnpu infer` as a user runs it: the VM path, the daemon path and the
in-process model, and what the command costs beyond its runs
(docs/benchmarks.md, "The VM path").

For each model and batch (torchvision graphs with random weights, written
by `onnx-bench` to target/onnx-bench-vision), compiles it once for its
default 1 SA + 1 VU vNPU and runs `vnpu infer` on 3 batches of seeded
input, round by round, the sides in an order rotated every round:

  in-process   `vnpu infer --in-process` (host wall per batch)
  VM           `vnpu infer` (the runner guest in a VM, its own vNPU;
               guest wall per batch on the TSC)
  daemon       `vnpu infer --attach` to a vNPU of a `vnpu daemon` this
               script starts, with `--max-host-work 2^34` (the default
               2^28 refuses batch-8 requests of these models) (guest wall
               per batch)
  VM (base)    with --baseline VNPU,GUEST: another build's `vnpu infer`
               and runner guest on the same .vnpu file (e.g. before a
               change); the compiled format must be the same. With
               --baseline-compiles the baseline compiles its own .vnpu
               with its own `vnpu compile` (a compiler change's before)

Each command runs 3 batches, so the three walls `vnpu infer` prints
(min / median / max) are all of them. Per side it prints min / median /
max over the rounds of: the per-batch wall (the median batch; the first
batch, which pays first touches of memory on every side, is usually the
max), the slowest batch, and the start-up overhead: the command's wall
(this script's clock) minus the three batches' walls. Then, per round,
VM / in-process and daemon / in-process of the per-batch wall.

Usage: python3 scripts/bench-infer.py [--rounds N]
       [--only resnet18,mobilenet_v2,...] [--baseline VNPU,GUEST [--baseline-compiles]] [--json FILE]
(RAYON_NUM_THREADS=1 in the environment: one GEMM thread in every side;
build first: bash scripts/build-guests.sh && cargo build --release -p vnpu-cli -p npu-bench,
and run target/release/onnx-bench once to write the models)
"""

import argparse
import ast
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
GUEST = os.path.join(ROOT, "guest-images/target/x86_64-unknown-none/release/infer")
VISION = os.path.join(ROOT, "target/onnx-bench-vision")
MODELS = [("resnet18", 1), ("resnet18", 8), ("mobilenet_v2", 1), ("mobilenet_v2", 8),
          ("squeezenet1_0", 1), ("squeezenet1_0", 8)]
# Run only when --only names them (346 MB of weights; about a minute a round).
EXTRA = [("vit_b_16", 1)]
# Models that need a larger vNPU than `vnpu compile`'s default shape.
SHAPE = {"vit_b_16": "sa=1,vu=1,sram=8M,hbm=1G"}
BATCHES = 3
# `vnpu compile`'s default vNPU shape: models are compiled for it (or for
# their SHAPE) and the daemon's instance gets the same.
COMPILED_FOR = "sa=1,vu=1,sram=8M,hbm=512M"
LATENCY = re.compile(r"^latency\s+per batch: (?:guest|host) wall min/median/max ([\d./]+) us", re.M)


def run(cmd, timeout=900):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench-infer: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout, wall


def tile_npy(src, dst, times):
    """`src` (a little-endian f4 .npy) repeated `times` times along axis 0."""
    with open(src, "rb") as f:
        b = f.read()
    if b[:6] != b"\x93NUMPY":
        sys.exit(f"bench-infer: {src} is not a .npy file")
    major = b[6]
    hl = int.from_bytes(b[8:10] if major == 1 else b[8:12], "little")
    start = (10 if major == 1 else 12) + hl
    h = ast.literal_eval(b[start - hl:start].decode("latin1"))
    if h["descr"] != "<f4" or h["fortran_order"]:
        sys.exit(f"bench-infer: {src}: expected a C-order <f4 array")
    shape = (h["shape"][0] * times,) + tuple(h["shape"][1:])
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % (shape,)
    pad = 64 - (10 + len(header) + 1) % 64
    header = (header + " " * pad + "\n").encode("latin1")
    with open(dst, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b[start:] * times)


def walls(out):
    """min, median and max of the per-batch walls `vnpu infer` printed, in
    us (with 3 batches, their sum is every batch's wall)."""
    m = LATENCY.search(out)
    if not m:
        sys.exit(f"bench-infer: no latency line in:\n{out}")
    return [float(v) for v in m.group(1).split("/")]


def stats(xs):
    return min(xs), statistics.median(xs), max(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", help="models whose name contains one of these (comma-separated); "
                    "vit_b_16 runs only when named")
    ap.add_argument("--baseline", help="VNPU,GUEST: another build to time beside (side `VM (base)`)")
    ap.add_argument("--baseline-compiles", action="store_true",
                    help="the baseline runs a .vnpu its own `vnpu compile` made, not this build's")
    ap.add_argument("--no-daemon", action="store_true", help="leave the daemon side out")
    ap.add_argument("--json", help="write every sample here")
    args = ap.parse_args()
    if args.rounds < 1:
        sys.exit("bench-infer: --rounds must be at least 1")
    for f in [VNPU, GUEST]:
        if not os.path.exists(f):
            sys.exit(f"bench-infer: {f} is missing (bash scripts/build-guests.sh && "
                     "cargo build --release -p vnpu-cli)")
    models = [(m, b) for m, b in MODELS
              if not args.only or any(o in m for o in args.only.split(","))]
    models += [(m, b) for m, b in EXTRA if args.only and any(o in m for o in args.only.split(","))]
    if args.baseline_compiles and not args.baseline:
        sys.exit("bench-infer: --baseline-compiles needs --baseline")
    sides = ["in-process", "VM"] + ([] if args.no_daemon else ["daemon"])
    base = None
    if args.baseline:
        base = args.baseline.split(",")
        if len(base) != 2 or not all(os.path.exists(p) for p in base):
            sys.exit("bench-infer: --baseline takes VNPU,GUEST: two existing files")
        sides.append("VM (base)")
    tmp = tempfile.mkdtemp(prefix="vnpu-bench-infer-")
    state = os.path.join(tmp, "state")
    daemon = None
    samples = {}
    try:
        if "daemon" in sides:
            daemon = subprocess.Popen([VNPU, "daemon", "--state-dir", state, "--max-host-work", str(1 << 34)], stdout=subprocess.DEVNULL,
                                      stderr=open(os.path.join(tmp, "daemon.log"), "w"))
            control = os.path.join(state, "sockets", "control.sock")
            for _ in range(200):
                if os.path.exists(control):
                    break
                time.sleep(0.05)
        for m, batch in models:
            onnx = os.path.join(VISION, f"{m}.onnx")
            x1 = os.path.join(VISION, f"{m}-b{batch}-x.npy")
            if not (os.path.exists(onnx) and os.path.exists(x1)):
                sys.exit(f"bench-infer: {onnx} or {x1} is missing (run target/release/onnx-bench once)")
            art = os.path.join(tmp, f"{m}-b{batch}.vnpu")
            shape = SHAPE.get(m, COMPILED_FOR)
            run([VNPU, "compile", onnx, "--batch", str(batch), "--vnpu", shape, "-o", art])
            art_base = art
            if base and args.baseline_compiles:
                art_base = os.path.join(tmp, f"{m}-b{batch}-base.vnpu")
                run([base[0], "compile", onnx, "--batch", str(batch), "--vnpu", shape, "-o", art_base])
            x = os.path.join(tmp, f"{m}-b{batch}-x{BATCHES}.npy")
            tile_npy(x1, x, BATCHES)
            uuid = None
            if daemon:
                uuid = run([VNPU, "create", "--spec", shape, "--state-dir", state])[0].strip()
            cmds = {
                "in-process": [VNPU, "infer", art, "--input", x, "--in-process"],
                "VM": [VNPU, "infer", art, "--input", x],
                "daemon": [VNPU, "infer", art, "--input", x, "--attach",
                           os.path.join(state, "sockets", f"{uuid}.sock")],
                "VM (base)": base and [base[0], "infer", art_base, "--input", x, "--guest", base[1]],
            }
            key = f"{m} b{batch}"
            samples[key] = {s: {"batch": [], "slowest": [], "startup": []} for s in sides}
            for r in range(args.rounds):
                order = sides[r % len(sides):] + sides[:r % len(sides)]
                for s in order:
                    out, wall = run(cmds[s] + ["--show", "0"])
                    lo, med, hi = walls(out)
                    d = samples[key][s]
                    d["batch"].append(med)
                    d["slowest"].append(hi)
                    d["startup"].append(wall * 1e6 - (lo + med + hi))
                print(f"{key}: round {r + 1}/{args.rounds} done (order {', '.join(order)})", file=sys.stderr)
            if daemon:
                run([VNPU, "stop", uuid, "--state-dir", state])
    finally:
        if daemon:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{args.rounds} rounds of {BATCHES} batches; min / median / max over rounds, ms")
    for key, per in samples.items():
        print(f"\n{key}")
        print(f"  {'side':<11} {'per batch':>24} {'slowest batch':>24} {'start-up overhead':>24}")
        for s in sides:
            cols = ["{:.1f} / {:.1f} / {:.1f}".format(*(v / 1e3 for v in stats(per[s][c])))
                    for c in ["batch", "slowest", "startup"]]
            print(f"  {s:<11} {cols[0]:>24} {cols[1]:>24} {cols[2]:>24}")
        ip = per["in-process"]["batch"]
        for s in sides[1:]:
            ratios = [a / b for a, b in zip(per[s]["batch"], ip)]
            print(f"  {s} / in-process per-batch wall: " + "{:.3f} / {:.3f} / {:.3f}".format(*stats(ratios)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "batches": BATCHES, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
