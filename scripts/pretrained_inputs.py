#!/usr/bin/env python3
"""Test inputs for the pretrained PaddleOCR networks RapidOCR ships
(docs/compiled-model-format.md, "The pretrained networks"), rendered with Pillow's
built-in font from a fixed seed and preprocessed as RapidOCR does:

- `--kind cls` (ch_ppocr_mobile_v2.0_cls, text direction): N text lines,
  every other one turned by 180 degrees; height 48, width scaled with the
  aspect ratio up to 192 and zero-padded, pixels (x/255 - 0.5)/0.5, CHW.
  Labels: 0 upright, 1 turned (the model's two classes).
- `--kind rec` (ch_PP-OCRv4_rec, recognition): N upright text lines,
  height 48, width up to --width (320), as for cls. Labels: the texts.
- `--kind det` (ch_PP-OCRv4_det, detection): N pages of --height x
  --width (multiples of 32) with 2 to 4 text lines each, pixels
  (x/255 - mean)/std with ImageNet's mean and std. Labels: the pages'
  text-box masks (1 inside a drawn line's box).

  pretrained_inputs.py OUT_X.npy OUT_LABELS.npy [--kind K] [--n N] [--width W] [--height H] [--png DIR]

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


def page(rng, h, w):
    """A white page with 2-4 text lines, and the mask of their boxes."""
    img = Image.new("RGB", (w, h), (255, 255, 255))
    mask = np.zeros((h, w), dtype=np.uint8)
    draw = ImageDraw.Draw(img)
    y = int(rng.integers(2, 10))
    for _ in range(int(rng.integers(2, 5))):
        size = int(rng.integers(16, 28))
        text = " ".join(rng.choice(WORDS, size=rng.integers(1, 3)))
        font = ImageFont.load_default(size=size)
        left, top, right, bottom = font.getbbox(text)
        x = int(rng.integers(2, max(3, w - (right - left) - 2)))
        if y + (bottom - top) >= h:
            break
        ink = tuple(int(v) for v in rng.integers(0, 80, 3))
        draw.text((x - left, y - top), text, font=font, fill=ink)
        mask[y : y + bottom - top, x : min(w, x + right - left)] = 1
        y += (bottom - top) + int(rng.integers(6, 16))
    return img, mask


def normalize_det(img):
    x = np.asarray(img, dtype=np.float32) / 255.0
    x = (x - np.array([0.485, 0.456, 0.406], dtype=np.float32)) / np.array([0.229, 0.224, 0.225], dtype=np.float32)
    return x.transpose(2, 0, 1).astype(np.float32)


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
    p.add_argument("--kind", choices=["cls", "rec", "det"], default="cls")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int, default=160)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    xs, ys = [], []
    for i in range(a.n):
        if a.kind == "det":
            w = a.width or 320
            if a.height % 32 or w % 32:
                p.error("det pages are multiples of 32 on both axes")
            img, mask = page(rng, a.height, w)
            xs.append(normalize_det(img))
            ys.append(mask)
            turned = False
        else:
            img, text = render(rng, int(rng.integers(20, 36)))
            turned = a.kind == "cls" and i % 2 == 1
            if turned:
                img = img.rotate(180)
            xs.append(preprocess(img, w=a.width or (192 if a.kind == "cls" else 320)))
            ys.append(int(turned) if a.kind == "cls" else text)
        if a.png:
            os.makedirs(a.png, exist_ok=True)
            img.save(os.path.join(a.png, f"{i:03d}-{int(turned)}.png"))
    np.save(a.out_x, np.stack(xs))
    np.save(a.out_labels, np.array(ys) if a.kind == "rec" else np.array(ys, dtype=np.int64 if a.kind == "cls" else np.uint8))


if __name__ == "__main__":
    main()
