#!/usr/bin/env python3
"""Exports the vision-model fixtures of tests/fixtures/onnx/vision/:
torchvision's `squeezenet1_0` and `vit_b_16` as the library builds them
(and, by name, any other torchvision classifier: `resnet18` and
`mobilenet_v2` are committed for the functional model's profile,
docs/benchmarks.md),
and a YOLO-family detector built in code here (a YOLOv5-style backbone of
Conv + BatchNorm + SiLU blocks, C3 blocks that Split their input, SPPF max
pooling, a neck that upsamples with Resize and concatenates, and the
detection head with its box decoding: sigmoid, grid offsets, strides and
anchors, all three scales concatenated), each by `torch.onnx.export` as
it exports by default (weights in an external data file).

Only the graph (`NAME.onnx`) is committed: its weights are random anyway,
so scripts/fill_external.py writes them (and an input) from a seed at
test time, in CI's own venv, without torch and without downloading
anything (device/npu-onnx/tests/vision.rs). Run once, by hand, in the
exporter's venv (scripts/hf_models.py says how to make it, plus
`torchvision==0.29.2`):

  .venv-export/bin/python scripts/vision_models.py [NAME...]
"""
import os
import sys

import torch
import torchvision

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "onnx", "vision")


def conv(cin, cout, k=1, s=1):
    return torch.nn.Sequential(
        torch.nn.Conv2d(cin, cout, k, s, k // 2, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.SiLU()
    )


class C3(torch.nn.Module):
    """YOLOv5's C3 block, its input split in two halves as YOLOv8's C2f does."""

    def __init__(self, c):
        super().__init__()
        self.cv1 = conv(c, c)
        self.m = torch.nn.Sequential(conv(c // 2, c // 2, 3), conv(c // 2, c // 2, 3))
        self.cv2 = conv(c + c // 2, c)

    def forward(self, x):
        a, b = self.cv1(x).split(x.shape[1] // 2, dim=1)
        return self.cv2(torch.cat([a, b, self.m(b)], 1))


class SPPF(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.cv1 = conv(c, c // 2)
        self.cv2 = conv(c * 2, c)
        self.m = torch.nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat([x, y1, y2, self.m(y2)], 1))


class Detect(torch.nn.Module):
    """Per scale: 3 anchors x (4 box + 1 objectness + classes), decoded to
    boxes in pixels as YOLOv5 exports it."""

    def __init__(self, chans, classes, strides, anchors):
        super().__init__()
        self.no = 5 + classes
        self.strides = strides
        self.anchors = anchors
        self.m = torch.nn.ModuleList(torch.nn.Conv2d(c, 3 * self.no, 1) for c in chans)

    def forward(self, xs):
        out = []
        for i, x in enumerate(xs):
            n, _, h, w = x.shape
            y = self.m[i](x).view(n, 3, self.no, h, w).permute(0, 1, 3, 4, 2).sigmoid()
            gy, gx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            grid = torch.stack((gx, gy), 2).view(1, 1, h, w, 2).float()
            anchor = torch.tensor(self.anchors[i]).view(1, 3, 1, 1, 2).float()
            xy, wh, conf = y.split((2, 2, self.no - 4), 4)
            xy = (xy * 2 - 0.5 + grid) * self.strides[i]
            wh = (wh * 2) ** 2 * anchor
            out.append(torch.cat((xy, wh, conf), 4).view(n, -1, self.no))
        return torch.cat(out, 1)


class TinyYolo(torch.nn.Module):
    def __init__(self, classes=8):
        super().__init__()
        self.b1 = torch.nn.Sequential(conv(3, 16, 3, 2), conv(16, 32, 3, 2), C3(32))  # /4
        self.b2 = torch.nn.Sequential(conv(32, 64, 3, 2), C3(64))  # /8
        self.b3 = torch.nn.Sequential(conv(64, 128, 3, 2), C3(128), SPPF(128))  # /16
        self.up = torch.nn.Upsample(scale_factor=2, mode="nearest")
        self.n1 = torch.nn.Sequential(conv(128 + 64, 64), C3(64))
        self.n2 = torch.nn.Sequential(conv(64 + 32, 32), C3(32))
        anchors = [[(10, 13), (16, 30), (33, 23)], [(30, 61), (62, 45), (59, 119)], [(116, 90), (156, 198), (373, 326)]]
        self.detect = Detect([32, 64, 128], classes, [4, 8, 16], anchors)

    def forward(self, x):
        p2 = self.b1(x)
        p3 = self.b2(p2)
        p4 = self.b3(p3)
        n3 = self.n1(torch.cat([self.up(p4), p3], 1))
        n2 = self.n2(torch.cat([self.up(n3), p2], 1))
        return self.detect([n2, n3, p4])


def build(name):
    torch.manual_seed(20261126)
    if name == "tiny-yolo":
        m, size = TinyYolo(), 96
    else:
        m, size = getattr(torchvision.models, name)(weights=None), 224
    m.eval()
    x = torch.randn(1, 3, size, size)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, f"{name}.onnx")
    torch.onnx.export(m, (x,), path, input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    data = path + ".data"
    if os.path.exists(data):
        os.remove(data)  # scripts/fill_external.py writes it from a seed
    print(f"{name}: {sum(p.numel() for p in m.parameters())} parameters, input [1, 3, {size}, {size}]")


if __name__ == "__main__":
    for n in sys.argv[1:] or ["squeezenet1_0", "vit_b_16", "tiny-yolo"]:
        build(n)
