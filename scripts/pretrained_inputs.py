#!/usr/bin/env python3
"""Test inputs for the pretrained text-direction classifier (PaddleOCR's
ch_ppocr_mobile_v2.0_cls, a MobileNetV3): N text-line images rendered
with Pillow's built-in font from a fixed seed, every other one turned by
180 degrees, preprocessed as RapidOCR does for this model (height 48,
width scaled with the aspect ratio up to 192 and zero-padded, pixels
(x/255 - 0.5)/0.5, CHW).

  pretrained_inputs.py OUT_X.npy OUT_LABELS.npy [--n N] [--png DIR]

Labels: 0 upright, 1 turned by 180 degrees (the model's two classes).
--png also writes the rendered images, to look at.
"""
import argparse
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WORDS = (
    "virtual neural processing unit systolic array vector memory bandwidth tenant "
    "scheduler interrupt doorbell command ring guest driver hypervisor compile tensor "
    "batch inference latency throughput kernel channel window stride padding"
).split()


def render(rng, size):
    text = " ".join(rng.choice(WORDS, size=rng.integers(1, 4)))
    font = ImageFont.load_default(size=size)
    left, top, right, bottom = font.getbbox(text)
    pad = int(rng.integers(2, 8))
    img = Image.new("RGB", (right - left + 2 * pad, bottom - top + 2 * pad), (255, 255, 255))
    ink = tuple(int(v) for v in rng.integers(0, 80, 3))
    ImageDraw.Draw(img).text((pad - left, pad - top), text, font=font, fill=ink)
    return img, text


def preprocess(img, h=48, w=192):
    ratio = img.width / img.height
    rw = min(w, int(np.ceil(h * ratio)))
    img = img.resize((rw, h), Image.BILINEAR)
    x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
    x = (x - 0.5) / 0.5
    out = np.zeros((3, h, w), dtype=np.float32)
    out[:, :, :rw] = x
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_x")
    p.add_argument("out_labels")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--seed", type=int, default=20261123)
    p.add_argument("--png")
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    xs, ys = [], []
    for i in range(a.n):
        img, text = render(rng, int(rng.integers(20, 36)))
        turned = i % 2 == 1
        if turned:
            img = img.rotate(180)
        if a.png:
            os.makedirs(a.png, exist_ok=True)
            img.save(os.path.join(a.png, f"{i:03d}-{int(turned)}.png"))
        xs.append(preprocess(img))
        ys.append(int(turned))
    np.save(a.out_x, np.stack(xs))
    np.save(a.out_labels, np.array(ys, dtype=np.int64))


if __name__ == "__main__":
    main()
