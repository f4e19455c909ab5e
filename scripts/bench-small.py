#!/usr/bin/env python3
"""Small models at batch 1 and 8 as a user runs them: `vnpu infer` in a VM
(guest wall per batch) against ONNX Runtime single-threaded on the same
input, round by round (docs/benchmarks.md, "Small models in a VM").

Models: transformers' BERT, DistilBERT and GPT-2 of tests/fixtures/onnx/hf
(2 layers, hidden 64, 16 tokens) and scikit-learn models as skl2onnx
exports them (scripts/sklearn_models.py), the inputs `onnx-bench` writes to
target/onnx-bench-small (run it once first: its `small` cases). Each model
is compiled once for a 4 SA + 4 VU vNPU (the issue's shape) and, per round,
  VM    `vnpu infer` on REQUESTS batches (a fresh VM each round; the median
        batch's guest wall on the TSC, the first batch paying first touches)
  ORT   scripts/ort_ref.py --time REQUESTS on one batch (session.run's wall,
        the median of its runs; one intra-op and one inter-op thread)
the two in an order that alternates every round. Prints per model:
min / median / max over the rounds of both walls and of their ratio, the
infer program's instruction count, and microseconds per instruction: the
VM's wall, and the VM's wall beyond ONNX Runtime's.

Usage: .venv-onnx/bin/python scripts/bench-small.py [--rounds N] [--requests N] [--only bert,mlp,...] [--json FILE]
(build first: bash scripts/build-guests.sh && cargo build --release -p vnpu-cli -p npu-bench
&& target/release/onnx-bench --rounds 1 --only transformers,scikit)
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VNPU = os.path.join(ROOT, "target/release/vnpu")
SMALL = os.path.join(ROOT, "target/onnx-bench-small")
HF = os.path.join(ROOT, "tests/fixtures/onnx/hf")
SHAPE = "sa=4,vu=4,sram=8M,hbm=512M"
LATENCY = re.compile(r"^latency\s+per batch: guest wall min/median/max ([\d./]+) us", re.M)
INSTR = re.compile(r"^programs\s+load \d+ instructions, infer (\d+)", re.M)


def models():
    out = []
    for m in ["bert", "distilbert", "gpt2"]:
        for b in [1, 8]:
            ins = [(i, os.path.join(SMALL, f"{m}-b{b}-{i}.npy")) for i in ["input_ids", "attention_mask"]]
            out.append((f"{m} b{b}", os.path.join(HF, f"{m}.onnx"), b, ins))
    for m in ["scaler-logreg", "random-forest", "gradient-boosting-regressor", "svc-rbf", "mlp"]:
        for b in [1, 8]:
            out.append((f"{m} b{b}", os.path.join(SMALL, "sklearn", f"{m}.onnx"), b,
                        [("X", os.path.join(SMALL, f"{m}-b{b}-X.npy"))]))
    return out


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"bench-small: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def stats(xs):
    return min(xs), statistics.median(xs), max(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--only", help="models whose name contains one of these (comma-separated)")
    ap.add_argument("--json", help="write every sample here")
    a = ap.parse_args()
    if a.rounds < 1 or a.requests < 3:
        sys.exit("bench-small: --rounds must be at least 1 and --requests at least 3")
    tmp = tempfile.mkdtemp(prefix="vnpu-bench-small-")
    py = sys.executable
    results = {}
    for name, model, batch, ins in models():
        if a.only and not any(o in name for o in a.only.split(",")):
            continue
        missing = [p for _, p in ins if not os.path.exists(p)] + ([model] if not os.path.exists(model) else [])
        if missing:
            sys.exit(f"bench-small: {missing[0]} is missing (run target/release/onnx-bench --rounds 1 "
                     "--only transformers,scikit first)")
        vnpu = os.path.join(tmp, name.replace(" ", "-") + ".vnpu")
        out = run([VNPU, "compile", model, "--vnpu", SHAPE, "--batch", str(batch), "--out", vnpu])
        instr = int(INSTR.search(out).group(1))
        # REQUESTS batches of the same rows, for the VM.
        feeds = []
        for n, p in ins:
            x = np.load(p)
            tiled = os.path.join(tmp, f"{name.replace(' ', '-')}-{n}.npy")
            np.save(tiled, np.concatenate([x] * a.requests))
            feeds.append((n, p, tiled))
        vm, ort = [], []
        for r in range(a.rounds):
            for side in (["vm", "ort"] if r % 2 == 0 else ["ort", "vm"]):
                if side == "vm":
                    cmd = [VNPU, "infer", vnpu]
                    for n, _, t in feeds:
                        cmd += ["--input", f"{n}={t}"]
                    w = [float(v) for v in LATENCY.search(run(cmd)).group(1).split("/")]
                    vm.append(w[1])
                else:
                    cmd = [py, os.path.join(ROOT, "scripts/ort_ref.py"), model, os.path.join(tmp, "ort")]
                    cmd += [f"{n}={p}" for n, p, _ in feeds]
                    cmd += ["--time", str(a.requests)]
                    ts = [float(l.split()[1]) * 1e6 for l in run(cmd).splitlines() if l.startswith("ort_seconds ")]
                    ort.append(statistics.median(ts))
        ratio = [v / o for v, o in zip(vm, ort)]
        (v0, v1, v2), (o0, o1, o2), (r0, r1, r2) = stats(vm), stats(ort), stats(ratio)
        print(f"{name:34s} VM {v0:8.1f}/{v1:8.1f}/{v2:8.1f} us  ORT {o0:8.1f}/{o1:8.1f}/{o2:8.1f} us  "
              f"ratio {r0:5.2f}/{r1:5.2f}/{r2:5.2f}  {instr:5d} instr  {v1 / instr:5.2f} us each, "
              f"{max(v1 - o1, 0) / instr:5.2f} beyond ORT", flush=True)
        results[name] = {"vm_us": vm, "ort_us": ort, "ratio": ratio, "instructions": instr}
    if results:
        med = statistics.median(statistics.median(r["ratio"]) for r in results.values())
        b1 = [statistics.median(r["ratio"]) for k, r in results.items() if k.endswith(" b1")]
        print(f"median ratio over the cases: {med:.2f}; at batch 1: median {statistics.median(b1) if b1 else float('nan'):.2f}, "
              f"max {max(b1) if b1 else float('nan'):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
