#!/usr/bin/env python3
"""Trains a small CNN and a small transformer encoder with PyTorch on the
8x8 digits that ship inside scikit-learn, exports both with torch.onnx and
writes their test inputs (docs/compiled-model-format.md, "Test models").

Data: `sklearn.datasets.load_digits` (1797 images), pixels scaled to
[0, 1], split 75/25 stratified with random_state 0 (the split of
scripts/onnx_models.py: 450 test images, the labels are digits-y.npy).

Models (tests/fixtures/onnx/torch/):
  digits-cnn          [N,1,8,8] -> Conv 3x3 1->16 + BatchNorm + ReLU ->
                      MaxPool 2 -> Conv 3x3 16->32 + BatchNorm + ReLU ->
                      global average pool -> Linear 32->10 (logits)
  digits-transformer  [N,8,8]: the image's 8 rows are 8 tokens of 8 pixels
                      -> Linear 8->32 + learned positions -> 2 encoder
                      layers (4-head self-attention written out as
                      MatMul/Transpose/Softmax, LayerNorm after each
                      residual, feed-forward 32->64 GELU->32) -> mean over
                      tokens -> Linear 32->10 (logits)
Inputs: digits-img-x.npy [450,1,8,8] and digits-seq-x.npy [450,8,8] (the
same test images as ../digits-x.npy). <name>-f64.npy: the logits computed
in float64 by onnx's own reference evaluator (onnx.reference, pure NumPy)
with the f32 weights widened exactly: the exact result both ONNX Runtime
(f32) and the vNPU (f32) are measured against. summary.json: test accuracy
of the PyTorch models and the operators of each export.

Seeds are fixed (torch.manual_seed(0), deterministic algorithms), so a rerun
on the same versions gives the same weights. PyPI's torch wheel pulls its
CUDA libraries (about 5 GB); it runs on the CPU here. Run once, by hand:

  python3 -m venv /tmp/torchenv
  /tmp/torchenv/bin/pip install torch==2.15.0 onnx==1.23.2 onnxscript==0.7.2 scikit-learn numpy
  /tmp/torchenv/bin/python scripts/train_torch.py [--refs-only]

--refs-only rewrites only the float64 references of the committed models.
"""
import json
import math
import os
import sys

import numpy as np
import onnx
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "onnx", "torch")


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        n, s, d = x.shape
        split = lambda t: t.reshape(n, s, self.heads, self.dh).transpose(1, 2)  # n h s dh
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.dh), dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(n, s, d))


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.att, self.n1 = Attention(d, heads), nn.LayerNorm(d)
        self.ff, self.n2 = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d)), nn.LayerNorm(d)

    def forward(self, x):
        x = self.n1(x + self.att(x))
        return self.n2(x + self.ff(x))


class Transformer(nn.Module):
    def __init__(self, d=32, heads=4, ff=64, layers=2):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.randn(1, 8, d) * 0.1)
        self.layers = nn.Sequential(*(EncoderLayer(d, heads, ff) for _ in range(layers)))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.layers(self.embed(x) + self.pos).mean(dim=1))


def train(model, xtr, ytr, epochs, lr):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(xtr), generator=g).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
    model.eval()
    return model


def export(model, x, name):
    path = os.path.join(OUT, f"{name}.onnx")
    batch = torch.export.Dim("batch")
    torch.onnx.export(model, (x[:2],), path, input_names=["x"], output_names=["logits"],
                      dynamic_shapes=({0: batch},), dynamo=True, external_data=False)
    m = onnx.load(path)
    onnx.checker.check_model(m)
    return sorted({n.op_type for n in m.graph.node})


def f64_reference(name, xfile):
    """The model's logits in float64 by onnx.reference."""
    from onnx.reference import ReferenceEvaluator
    m = onnx.load(os.path.join(OUT, f"{name}.onnx"))
    for t in m.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in list(m.graph.input) + list(m.graph.output):
        v.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    x = np.load(os.path.join(OUT, xfile)).astype(np.float64)
    y = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert y.dtype == np.float64, y.dtype
    np.save(os.path.join(OUT, f"{name}-f64.npy"), y)


REFS = [("digits-cnn", "digits-img-x.npy"), ("digits-transformer", "digits-seq-x.npy")]


def main():
    if "--refs-only" in sys.argv:
        for name, xfile in REFS:
            f64_reference(name, xfile)
        return
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)
    np.save(os.path.join(OUT, "digits-img-x.npy"), xte.reshape(-1, 1, 8, 8))
    np.save(os.path.join(OUT, "digits-seq-x.npy"), xte.reshape(-1, 8, 8))
    ytr_t, yte_t = torch.from_numpy(ytr), torch.from_numpy(yte)
    summary = {}
    for name, model, shape, epochs, lr in [
        ("digits-cnn", Cnn(), (-1, 1, 8, 8), 30, 3e-3),
        ("digits-transformer", Transformer(), (-1, 8, 8), 60, 2e-3),
    ]:
        xt = torch.from_numpy(xtr.reshape(shape))
        xe = torch.from_numpy(xte.reshape(shape))
        train(model, xt, ytr_t, epochs, lr)
        with torch.no_grad():
            acc = float((model(xe).argmax(1) == yte_t).float().mean())
        summary[name] = {"test_accuracy": acc, "ops": export(model, xe, name),
                         "parameters": sum(p.numel() for p in model.parameters())}
        print(name, summary[name])
    for name, xfile in REFS:
        f64_reference(name, xfile)
    summary["versions"] = {"torch": torch.__version__, "onnx": onnx.__version__}
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
