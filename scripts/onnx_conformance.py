#!/usr/bin/env python3
"""Writes ONNX's own backend node tests (the conformance suite every
runtime runs), regenerated from the installed `onnx` package's generators,
for `device/npu-onnx/tests/conformance.rs` (docs/compiled-model-format.md,
"Conformance").

    .venv-onnx/bin/python scripts/onnx_conformance.py [OUT]   # OUT: target/onnx-node-tests

Each test whose inputs are float32 tensors and whose outputs are float32
tensors, or integer ones within 2^24 (ArgMax's indices; saved as float32,
exact), becomes
OUT/NAME/model.onnx with input_I.npy and output_I.npy (its first data
set); OUT/index.tsv lists every node test, one per line: name, the
operator it tests (the first node's op type), opset, the suite's rtol and
atol, the input names (comma-separated), for a test not written (an
output, or an input other than an integer one, that is not float32) the
reason, and `consts` for a test whose integer inputs (axes, shapes,
indices, pads) were made constants of the model, as exporters write them
(counted apart from the float32 ones).
"""
import os
import shutil
import sys
import warnings

import numpy as np
import onnx
import onnx.backend.test.case.node as node_cases
from onnx import TensorProto, numpy_helper


def float_tensor(vi) -> bool:
    t = vi.type
    return t.HasField("tensor_type") and t.tensor_type.elem_type == TensorProto.FLOAT


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "target/onnx-node-tests"
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases.collect_testcases()
    index = []
    for case in cases:
        if case.kind != "node" or case.model is None or not case.data_sets:
            continue
        g = case.model.graph
        op = g.node[0].op_type if g.node else "?"
        entry = {"name": case.name, "op": op, "rtol": case.rtol, "atol": case.atol}
        inputs, outputs = case.data_sets[0]
        if any(not isinstance(a, np.ndarray) for a in list(inputs) + list(outputs)):
            entry["skipped"] = "an input or output is not a plain array"
            index.append(entry)
            continue
        def int_out(v, a):
            # An integer output (ArgMax's indices) whose values an f32
            # holds exactly: saved as float32, compared exactly.
            return (v.type.HasField("tensor_type")
                    and v.type.tensor_type.elem_type in (TensorProto.INT64, TensorProto.INT32)
                    and np.all(np.abs(a) <= 1 << 24))
        if not all(float_tensor(v) or int_out(v, a) for v, a in zip(g.output, outputs)):
            entry["skipped"] = "an output is neither float32 nor an integer tensor"
            index.append(entry)
            continue
        model = case.model
        if not all(float_tensor(v) for v in g.input):
            # Integer inputs (axes, shapes, indices, pads) made constants of
            # the model, as exporters write them: counted apart.
            ints = [i for i, v in enumerate(g.input) if not float_tensor(v)]
            if not all(
                g.input[i].type.HasField("tensor_type")
                and g.input[i].type.tensor_type.elem_type in (TensorProto.INT64, TensorProto.INT32)
                for i in ints
            ):
                entry["skipped"] = "an input is neither float32 nor an integer tensor"
                index.append(entry)
                continue
            model = onnx.ModelProto()
            model.CopyFrom(case.model)
            for i in ints:
                model.graph.initializer.append(numpy_helper.from_array(inputs[i], g.input[i].name))
            keep = [v for i, v in enumerate(g.input) if i not in ints]
            del model.graph.input[:]
            model.graph.input.extend(keep)
            inputs = [a for i, a in enumerate(inputs) if i not in ints]
            entry["consts"] = True
            g = model.graph
        d = os.path.join(out, case.name)
        os.makedirs(d)
        with open(os.path.join(d, "model.onnx"), "wb") as f:
            f.write(model.SerializeToString())
        for i, a in enumerate(inputs):
            np.save(os.path.join(d, f"input_{i}.npy"), np.asarray(a, dtype=np.float32, order="C"))
        for i, a in enumerate(outputs):
            np.save(os.path.join(d, f"output_{i}.npy"), np.asarray(a, dtype=np.float32, order="C"))
        entry["inputs"] = [v.name for v in g.input]
        entry["outputs"] = [v.name for v in g.output]
        entry["opset"] = max((o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx")), default=0)
        index.append(entry)
    with open(os.path.join(out, "index.tsv"), "w") as f:
        f.write(f"# onnx {onnx.__version__}\n")
        for e in index:
            f.write("\t".join([e["name"], e["op"], str(e.get("opset", 0)), repr(float(e["rtol"])),
                                repr(float(e["atol"])), ",".join(e.get("inputs", [])), e.get("skipped", ""),
                                "consts" if e.get("consts") else ""]) + "\n")
    usable = sum(1 for e in index if "skipped" not in e and not e.get("consts"))
    consts = sum(1 for e in index if e.get("consts"))
    print(f"onnx {onnx.__version__}: {len(index)} node tests, {usable} with float32 inputs and outputs, "
          f"{consts} more with integer inputs made constants -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
