#!/usr/bin/env python3
"""Decoder workloads on one whole TPU v5e core: simulated time of each
phase beside its rooflines (docs/workloads.md, "Decoders").

The HBM roofline is the bytes a phase must move at least (every weight
once in bf16, plus the K/V cache it reads and writes in bf16) over the
chip's 819 GB/s; the SA roofline is its products' FLOPs over the chip's
197 TFLOPS (both from docs/boards/tpu-v5e.toml's sources). Needs
`cargo build --release -p vnpu-cli`. Prints a Markdown table; --json
writes every run's report too.
"""
import argparse, json, subprocess, sys

BOARD = "docs/boards/tpu-v5e.toml"
HBM_BPS, PEAK = 819e9, 197e12
# name: (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied)
MODELS = {
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, 128256, True),
    "qwen2.5-0.5b": (24, 896, 14, 2, 64, 4864, 151936, True),
    "gemma-2b": (18, 2048, 8, 1, 256, 16384, 256000, True),
    "llama-2-7b": (32, 4096, 32, 32, 128, 11008, 32000, False),
}
CASES = [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 2048),
         ("prefill", 1, 128), ("prefill", 1, 512), ("prefill", 1, 2048)]


def bounds(model, phase, batch, n):
    l, d, h, kv, dh, f, v, tied = MODELS[model]
    layer = d * h * dh + 2 * d * kv * dh + h * dh * d + 3 * d * f
    # The head reads the table's bytes (tied or not); the gather B rows.
    weights = 2 * (l * layer + v * d)
    kv_pos = 2 * l * kv * dh * 2
    tokens = batch * (1 if phase == "decode" else n)
    kv_bytes = batch * n * kv_pos if phase == "decode" else batch * n * kv_pos
    flops = 2 * tokens * l * layer + 2 * batch * v * d
    q_len = 1 if phase == "decode" else n
    flops += 4 * batch * l * h * q_len * n * dh
    return (weights + kv_bytes) / HBM_BPS, flops / PEAK


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vnpu", default="target/release/vnpu")
    ap.add_argument("--json", help="write every report here")
    a = ap.parse_args()
    rows, reports = [], []
    print("| workload | batch | simulated | HBM roofline | SA roofline | simulated / max(rooflines) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        for phase, batch, n in CASES:
            name = f"{model}-{phase}-{n}"
            out = subprocess.run([a.vnpu, "workload", "run", name, "--board", BOARD, "--sa", "4", "--vu", "1",
                                  "--batch", str(batch), "--json"], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"| {name} | {batch} | failed: {out.stderr.strip().splitlines()[-1]} | | | |")
                sys.stdout.flush()
                continue
            r = json.loads(out.stdout)
            reports.append(r)
            t = r["simulated_seconds"]
            hb, sb = bounds(model, phase, batch, n)
            print(f"| {name} | {batch} | {t*1e3:.3f} ms | {hb*1e3:.3f} ms | {sb*1e3:.3f} ms | {t/max(hb, sb):.2f} |")
            sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
