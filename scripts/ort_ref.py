#!/usr/bin/env python3
"""Runs an ONNX model with ONNX Runtime (CPU) and saves its outputs: the
independent reference the vNPU's results are checked against
(docs/compiled-model-format.md).

  ort_ref.py MODEL.onnx OUT_PREFIX NAME=INPUT.npy [NAME=INPUT.npy ...] [--output NAME ...] [--time RUNS]

Writes OUT_PREFIX.<output>.npy for every requested output (all outputs by
default; characters of the name other than letters, digits, `.`, `_` and
`-` become `_`, as output names such as `save_infer_model/scale_0.tmp_1`
are not file names). A sequence of maps (ZipMap's output, as skl2onnx
exports classifiers) is saved as the matrix of its values, one row per
map, the columns in the maps' key order. With --time RUNS it also prints one line per run,
`ort_seconds <s>`, the wall time of session.run on the whole batch
(single-threaded session, as the functional model is), for the benchmark.
"""
import argparse
import re
import sys
import time

import numpy as np
import onnxruntime as ort


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("out_prefix")
    p.add_argument("inputs", nargs="+", help="NAME=FILE.npy")
    p.add_argument("--output", action="append", default=None)
    p.add_argument("--time", type=int, default=0)
    a = p.parse_args()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    s = ort.InferenceSession(a.model, so, providers=["CPUExecutionProvider"])
    feed = {}
    for item in a.inputs:
        name, _, path = item.partition("=")
        if not path:
            sys.exit(f"ort_ref.py: input `{item}` is not NAME=FILE.npy")
        feed[name] = np.load(path)
    names = a.output or [o.name for o in s.get_outputs()]
    outs = s.run(names, feed)
    for n, v in zip(names, outs):
        if isinstance(v, list) and v and isinstance(v[0], dict):
            v = np.array([list(m.values()) for m in v], dtype=np.float32)
        np.save(f"{a.out_prefix}.{re.sub(r'[^A-Za-z0-9._-]', '_', n)}.npy", np.asarray(v))
    for _ in range(a.time):
        t0 = time.perf_counter()
        s.run(names, feed)
        print(f"ort_seconds {time.perf_counter() - t0:.9f}")


if __name__ == "__main__":
    main()
