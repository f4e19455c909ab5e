#!/usr/bin/env python3
"""Runs an ONNX model in float64 with onnx's own reference evaluator
(onnx.reference, pure NumPy): every float32 weight, constant, cast, input
and output is made float64 (Resize's scales stay float32, as the operator
requires). This is the "exact" result the vNPU's and ONNX Runtime's f32
errors are both measured against (docs/compiled-model-format.md). Slow: minutes for
a detector on a few images.

  f64_ref.py MODEL.onnx OUT.npy NAME=INPUT.npy [--output NAME]

Needs `onnx` in the venv (pip install onnx==1.23.2).

BatchNormalization is evaluated in inference mode whatever the opset: onnx
1.23.2's reference implementation of BatchNormalization-9 (opsets 9 to 13)
switches to batch statistics whenever `momentum` is set, and the schema's
default sets it, so a plain inference model at opset 9-13 (PaddleOCR's, at
opset 11 and 12) was normalized with the statistics of the batch it was
given. Inference-mode BatchNormalization of every opset is
`scale * (x - mean) / sqrt(var + epsilon) + bias`, which the override computes.
"""
import argparse

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun


class BatchNormalization(OpRun):
    """Inference-mode BatchNormalization for every opset (see above)."""

    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, **_):
        shape = (-1,) + (1,) * (x.ndim - 2)
        eps = 1e-5 if epsilon is None else epsilon
        y = scale.reshape(shape) * (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)
        return ((y + bias.reshape(shape)).astype(x.dtype),)


def to_f64(m):
    keep = set()
    for n in m.graph.node:
        if n.op_type in ("Resize", "Upsample"):
            keep.update(n.input[1:])
    for t in m.graph.initializer:
        if t.data_type == TensorProto.FLOAT and t.name not in keep:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for n in m.graph.node:
        if n.op_type == "Constant" and not set(n.output) & keep:
            for a in n.attribute:
                if a.name == "value" and a.t.data_type == TensorProto.FLOAT:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
        if n.op_type == "Cast":
            for a in n.attribute:
                if a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = TensorProto.DOUBLE
    for v in list(m.graph.input) + list(m.graph.output):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    del m.graph.value_info[:]
    return m


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("input", help="NAME=FILE.npy")
    p.add_argument("--output")
    a = p.parse_args()
    m = to_f64(onnx.load(a.model))
    name, _, path = a.input.partition("=")
    x = np.load(path).astype(np.float64)
    outs = [a.output] if a.output else None
    y = ReferenceEvaluator(m, new_ops=[BatchNormalization]).run(outs, {name: x})[0]
    if y.dtype != np.float64:
        raise SystemExit(f"f64_ref.py: the output is {y.dtype}, not float64: a float32 path is left in the model")
    np.save(a.out, y)


if __name__ == "__main__":
    main()
