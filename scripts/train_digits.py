#!/usr/bin/env python3
"""Trains the two digit classifiers the `digits` guest runs on the vNPU and
exports their weights and the held-out test split as committed fixtures.

Data: the 8x8 handwritten digits that ship inside scikit-learn
(`sklearn.datasets.load_digits`, 1797 images), pixels scaled to [0, 1],
split 75/25 stratified with random_state 0 (450 test images).

- MLP: scikit-learn's MLPClassifier, 64 -> 32 (ReLU) -> 10.
- CNN: conv 3x3, 1 -> 8 channels, padding 1 (ReLU) -> 2x2 max pool ->
  dense 128 -> 10, trained here with NumPy (Adam, cross-entropy). The
  dense layer reads the pooled map in NHWC order (h, w, c), as the guest
  lays it out.

Output (little-endian f32 unless noted), in guest-images/digits/fixtures/:
  test_x.bin  450 x 64       test images
  test_y.bin  450 x u8       labels
  mlp.bin     W1[64x32] b1[32] W2[32x10] b2[10]
  cnn.bin     K[3x3x1x8] (HWIO) bk[8] W[128x10] b[10]
  summary.json  accuracies on the test split as computed here (f64)

Command (docs/inference-guests.md):
  python3 -m venv .venv-train && .venv-train/bin/pip install scikit-learn numpy
  .venv-train/bin/python scripts/train_digits.py
"""
import json
import os

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

OUT = os.path.join(os.path.dirname(__file__), "..", "guest-images", "digits", "fixtures")


def conv_forward(x, k, bk):
    """x: N x 8 x 8 (one channel), k: 3x3x1x8 -> N x 8 x 8 x 8 (pre-activation)."""
    n = x.shape[0]
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1)))
    cols = np.stack([xp[:, i:i + 8, j:j + 8] for i in range(3) for j in range(3)], axis=-1)  # N 8 8 9
    return cols @ k.reshape(9, 8) + bk, cols


def pool_forward(a):
    n = a.shape[0]
    r = a.reshape(n, 4, 2, 4, 2, 8)
    out = r.max(axis=(2, 4))
    mask = (r == out[:, :, None, :, None, :])
    return out, mask


def train_cnn(xtr, ytr, epochs=60, lr=0.01, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.normal(0, np.sqrt(2 / 9), (3, 3, 1, 8))
    bk = np.zeros(8)
    w = rng.normal(0, np.sqrt(2 / 128), (128, 10))
    b = np.zeros(10)
    params = [k, bk, w, b]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    t = 0
    for _ in range(epochs):
        order = rng.permutation(len(xtr))
        for s in range(0, len(xtr), 32):
            idx = order[s:s + 32]
            x, y = xtr[idx], ytr[idx]
            z, cols = conv_forward(x, k, bk)
            a = np.maximum(z, 0)
            p, mask = pool_forward(a)
            f = p.reshape(len(x), 128)
            logits = f @ w + b
            e = np.exp(logits - logits.max(1, keepdims=True))
            prob = e / e.sum(1, keepdims=True)
            g = prob
            g[np.arange(len(x)), y] -= 1
            g /= len(x)
            gw = f.T @ g
            gb = g.sum(0)
            gf = (g @ w.T).reshape(len(x), 4, 4, 8)
            ga = (mask * gf[:, :, None, :, None, :]).reshape(len(x), 8, 8, 8)
            gz = ga * (z > 0)
            gk = (cols.reshape(-1, 9).T @ gz.reshape(-1, 8)).reshape(3, 3, 1, 8)
            gbk = gz.sum((0, 1, 2))
            t += 1
            for i, gr in enumerate([gk, gbk, gw, gb]):
                m[i] = 0.9 * m[i] + 0.1 * gr
                v[i] = 0.999 * v[i] + 0.001 * gr * gr
                params[i] -= lr * (m[i] / (1 - 0.9 ** t)) / (np.sqrt(v[i] / (1 - 0.999 ** t)) + 1e-8)
    return params


def cnn_predict(x, params):
    k, bk, w, b = params
    z, _ = conv_forward(x, k, bk)
    p, _ = pool_forward(np.maximum(z, 0))
    return (p.reshape(len(x), 128) @ w + b).argmax(1)


def main():
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.25, stratify=d.target, random_state=0)
    mlp = MLPClassifier(hidden_layer_sizes=(32,), activation="relu", max_iter=600, random_state=0)
    mlp.fit(xtr, ytr)
    params = train_cnn(xtr.reshape(-1, 8, 8).astype(np.float64), ytr)
    params32 = [p.astype(np.float32) for p in params]
    os.makedirs(OUT, exist_ok=True)
    f32 = lambda *a: b"".join(np.ascontiguousarray(p, dtype="<f4").tobytes() for p in a)
    open(os.path.join(OUT, "test_x.bin"), "wb").write(f32(xte))
    open(os.path.join(OUT, "test_y.bin"), "wb").write(yte.astype(np.uint8).tobytes())
    open(os.path.join(OUT, "mlp.bin"), "wb").write(
        f32(mlp.coefs_[0], mlp.intercepts_[0], mlp.coefs_[1], mlp.intercepts_[1]))
    open(os.path.join(OUT, "cnn.bin"), "wb").write(f32(*params32))
    summary = {
        "test_images": int(len(yte)),
        "mlp_accuracy": float(mlp.score(xte, yte)),
        "cnn_accuracy": float((cnn_predict(xte.reshape(-1, 8, 8).astype(np.float64), params) == yte).mean()),
    }
    open(os.path.join(OUT, "summary.json"), "w").write(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
