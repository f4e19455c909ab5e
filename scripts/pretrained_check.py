#!/usr/bin/env python3
"""Checks a pretrained PaddleOCR network's vNPU outputs against ONNX
Runtime's on the same inputs (scripts/pretrained.sh; docs/compiled-model-format.md,
"The pretrained networks"). Prints the errors and the task-level agreement
and exits 1 when a check fails.

  pretrained_check.py cls|rec|det MODEL.onnx VNPU.npy ORT.npy LABELS.npy [--dtype f32|bf16]

Errors: max absolute; max relative with a 1e-6 floor on the denominator;
and max relative "of the scale" (denominator at least 1e-3 of the output's
largest magnitude: the probabilities of a detector's background and of a
recognizer's unlikely characters are 1e-6 and below, where an element's
relative error means nothing).

- cls: passes with relative error <= 1e-4 and every top-1 equal to ONNX
  Runtime's; prints the accuracy on the labels (0 upright, 1 turned).
- rec: passes with relative error of the scale <= 2e-4, every time step's
  top-1 and every CTC-decoded string (greedy: repeats merged, blanks
  dropped; the characters from the model's own metadata) equal to ONNX
  Runtime's; prints how many lines read exactly as rendered.
- det: passes with relative error of the scale <= 2e-4 and the probability
  maps thresholded at 0.3 (RapidOCR's) equal to ONNX Runtime's on every
  pixel; prints the share of the drawn text boxes' pixels found.

With --dtype bf16 (a model compiled with bf16 SA operands) the checks are
the documented bf16 ones (docs/compiled-model-format.md, "bf16"): these deep
networks end in a softmax or sigmoid, where a near tie that bf16 rounding
flips moves a probability by up to 1, so the bound is on the task:
- cls: normwise error (max absolute over the largest |ONNX Runtime|)
  <= 2^-5 and top-1 equal to ONNX Runtime's on >= 95% of the lines;
- rec: time-step top-1 equal on >= 99% of the steps and decoded strings
  equal on >= 90% of the lines;
- det: maps thresholded at 0.3 equal on >= 99.9% of the pixels.
"""
import sys

import numpy as np


def ctc_decode(steps, chars):
    out, prev = [], -1
    for t in steps:
        if t != prev and t != 0:
            out.append(chars[t])
        prev = t
    return "".join(out)


def main():
    args = sys.argv[1:]
    dtype = "f32"
    if len(args) == 7 and args[5] == "--dtype" and args[6] in ("f32", "bf16"):
        dtype = args[6]
        args = args[:5]
    if len(args) != 5 or args[0] not in ("cls", "rec", "det"):
        sys.exit(__doc__)
    sys.argv = [sys.argv[0]] + args
    kind, model = sys.argv[1], sys.argv[2]
    got, want, labels = (np.load(p) for p in sys.argv[3:6])
    if got.shape != want.shape:
        sys.exit(f"pretrained {kind}: output shape {got.shape}, ONNX Runtime's {want.shape}")
    d = np.abs(got.astype(np.float64) - want)
    rel = (d / np.maximum(np.abs(want), 1e-6)).max()
    scaled = (d / np.maximum(np.abs(want), 1e-3 * np.abs(want).max())).max()
    ok = bool(np.isfinite(d).all())
    normwise = d.max() / np.abs(want).max()
    line = (
        f"pretrained {kind} ({dtype}): max abs {d.max():.3e}, max rel {rel:.3e}, of the scale {scaled:.3e},"
        f" normwise {normwise:.3e}"
    )
    if kind == "cls":
        agree = int((got.argmax(1) == want.argmax(1)).sum())
        n = len(labels)
        line += (
            f", top-1 agreement {agree}/{n}, accuracy vNPU {(got.argmax(1) == labels).mean():.4f}"
            f" ONNX Runtime {(want.argmax(1) == labels).mean():.4f}"
        )
        ok = ok and rel <= 1e-4 and agree == n
        bf16_ok = normwise <= 2.0**-5 and agree >= 0.95 * n
    elif kind == "rec":
        import onnx

        meta = {p.key: p.value for p in onnx.load(model).metadata_props}
        chars = ["blank"] + meta["character"].splitlines() + [" "]
        ga, wa = got.argmax(-1), want.argmax(-1)
        texts = [ctc_decode(s, chars) for s in ga]
        same = sum(a == ctc_decode(b, chars) for a, b in zip(texts, wa))
        exact = sum(a == str(b) for a, b in zip(texts, labels))
        n = len(labels)
        line += (
            f", time-step top-1 agreement {int((ga == wa).sum())}/{ga.size}, decoded strings equal to"
            f" ONNX Runtime's {same}/{n}, read exactly as rendered {exact}/{n}"
        )
        for t, v in list(zip(labels, texts))[:4]:
            line += f"\n  {str(t)!r} -> {v!r}"
        ok = ok and scaled <= 2e-4 and same == n and bool((ga == wa).all())
        bf16_ok = (ga == wa).sum() >= 0.99 * ga.size and same >= 0.9 * n
    else:
        bv, bo = got[:, 0] > 0.3, want[:, 0] > 0.3
        text = labels == 1
        line += (
            f", maps thresholded at 0.3 equal on {int((bv == bo).sum())}/{bv.size} pixels, text-box pixels"
            f" found {(bv & text).sum() / text.sum():.3f}, pixels outside boxes {(bv & ~text).sum() / (~text).sum():.4f}"
        )
        ok = ok and scaled <= 2e-4 and bool((bv == bo).all())
        bf16_ok = (bv == bo).sum() >= 0.999 * bv.size
    if dtype == "bf16":
        ok = bool(np.isfinite(d).all()) and bool(bf16_ok)
    print(line)
    print(f"pretrained {kind} ({dtype}): " + ("PASS" if ok else "FAIL"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
