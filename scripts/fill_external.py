#!/usr/bin/env python3
"""Writes the weights of an exported graph whose external data file is not
committed (tests/fixtures/onnx/vision/, scripts/vision_models.py), and an
input, from a seed: the graph as the exporter wrote it, random weights
that depend only on the seed and each tensor's name and shape.

  fill_external.py MODEL.onnx OUT_DIR [--seed N]

Copies MODEL.onnx to OUT_DIR and writes there the external data file(s)
its initializers name (at the offsets and lengths the graph gives) and
`<stem>-x.npy`, a normal input for the graph's first input (a free batch
dimension 1). Values: a batch norm's variance in [0.5, 1.5), a 1-D
`weight` (a norm's scale) in [0.5, 1.5), other 1-D tensors normal with
deviation 0.1, anything larger normal with deviation 1/sqrt(fan-in) (the
product of its dimensions after the first), so activations keep their
scale through the network. Needs numpy and onnx (CI's .venv-onnx).
"""
import argparse
import os
import shutil
import zlib

import numpy as np
import onnx
from onnx import TensorProto


def values(name, dims, seed):
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = int(np.prod(dims)) if dims else 1
    if "running_var" in name or name.endswith(".var"):
        return rng.uniform(0.5, 1.5, n)
    if len(dims) == 1 and name.endswith("weight"):
        return rng.uniform(0.5, 1.5, n)
    if len(dims) <= 1:
        return rng.normal(0, 0.1, n)
    fan_in = int(np.prod(dims[1:]))
    return rng.normal(0, 1 / np.sqrt(max(fan_in, 1)), n)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=20261126)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    m = onnx.load(a.model, load_external_data=False)
    files = {}
    for t in m.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        e = {kv.key: kv.value for kv in t.external_data}
        if t.data_type != TensorProto.FLOAT:
            raise SystemExit(f"fill_external.py: {t.name}: external data of type {t.data_type}, not float")
        v = values(t.name, list(t.dims), a.seed).astype("<f4").tobytes()
        if int(e.get("length", len(v))) != len(v):
            raise SystemExit(f"fill_external.py: {t.name}: length {e.get('length')} for {len(v)} bytes")
        files.setdefault(e["location"], []).append((int(e.get("offset", 0)), v))
    for loc, parts in files.items():
        size = max(off + len(v) for off, v in parts)
        buf = bytearray(size)
        for off, v in parts:
            buf[off:off + len(v)] = v
        with open(os.path.join(a.out_dir, loc), "wb") as f:
            f.write(buf)
    stem = os.path.splitext(os.path.basename(a.model))[0]
    shutil.copyfile(a.model, os.path.join(a.out_dir, os.path.basename(a.model)))
    x = m.graph.input[0]
    shape = [d.dim_value if d.dim_value > 0 else 1 for d in x.type.tensor_type.shape.dim]
    rng = np.random.default_rng([a.seed, 1])
    np.save(os.path.join(a.out_dir, f"{stem}-x.npy"), rng.normal(0, 1, shape).astype(np.float32))
    print(f"{stem}: {sum(len(v) for parts in files.values() for _, v in parts)} bytes of weights, input {shape}")


if __name__ == "__main__":
    main()
