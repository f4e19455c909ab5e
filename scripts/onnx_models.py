#!/usr/bin/env python3
"""Trains the small models the ONNX tests compile and run on a vNPU, exports
them to ONNX and writes their test inputs (docs/compiled-model-format.md, "Test models").

Every model is trained here, by scikit-learn, on data that ships inside
scikit-learn (no download), with fixed seeds; nobody picks weights by hand.

Data: the 8x8 handwritten digits (`sklearn.datasets.load_digits`, 1797
images), pixels scaled to [0, 1], split 75/25 stratified with
random_state 0: 450 test images.

Models (tests/fixtures/onnx/<name>.onnx, exported by skl2onnx with
`zipmap=False`, so the probabilities are a plain float tensor):
  digits-mlp     MLPClassifier 64 -> 32 ReLU -> 10 (softmax)
  digits-mlp2    MLPClassifier 64 -> 48 tanh -> 24 logistic -> 10 (softmax)

Files per model: <name>.onnx, and shared by all: digits-x.npy (450 x 64
f32 test images), digits-y.npy (450 labels, int64).

Command (docs/compiled-model-format.md):
  bash scripts/setup-onnx.sh && .venv-onnx/bin/pip install scikit-learn skl2onnx
  .venv-onnx/bin/python scripts/onnx_models.py
"""
import json
import os

import numpy as np
import onnx
from skl2onnx import to_onnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "onnx")


def main():
    os.makedirs(OUT, exist_ok=True)
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, stratify=y, random_state=0)
    np.save(os.path.join(OUT, "digits-x.npy"), xte)
    np.save(os.path.join(OUT, "digits-y.npy"), yte)
    models = {
        "digits-mlp": MLPClassifier(hidden_layer_sizes=(32,), activation="relu", max_iter=400, random_state=0),
        "digits-mlp2": MLPClassifier(hidden_layer_sizes=(48, 24), activation="tanh", max_iter=400, random_state=0),
    }
    summary = {}
    for name, clf in models.items():
        clf.fit(xtr, ytr)
        acc = float(clf.score(xte, yte))
        onx = to_onnx(clf, xtr[:1], options={id(clf): {"zipmap": False}}, target_opset=17)
        onnx.checker.check_model(onx)
        with open(os.path.join(OUT, f"{name}.onnx"), "wb") as f:
            f.write(onx.SerializeToString())
        summary[name] = {"test_accuracy": acc, "ops": sorted({n.op_type for n in onx.graph.node})}
        print(name, summary[name])
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
