#!/usr/bin/env python3
"""Builds the operator test models in tests/fixtures/onnx/ops/: small ONNX
graphs of the convolutional operators (Conv with groups and depthwise,
BatchNormalization, Clip, HardSigmoid, HardSwish and its Add/Clip/Mul/Div
spelling, MaxPool, AveragePool, GlobalAveragePool, squeeze-and-excitation
products, Flatten, Gemm, Softmax), with random weights from a fixed seed,
and one random input each (`<name>-x.npy`).

They test the compiler's operators one by one against ONNX Runtime
(device/npu-onnx/tests/ort.rs); they are not trained models. Run once, by hand:

  .venv-onnx/bin/pip install onnx==1.23.2   # the builder; CI needs only onnxruntime
  .venv-onnx/bin/python scripts/onnx_ops.py [NAME...]
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "onnx", "ops")
rng = np.random.default_rng(20261123)


class G:
    """A graph under construction."""

    def __init__(self, name, x_shape):
        self.name = name
        self.nodes, self.inits = [], []
        self.x_shape = x_shape
        self.n = 0

    def t(self, prefix):
        self.n += 1
        return f"{prefix}{self.n}"

    def const(self, arr, prefix="c"):
        name = self.t(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name))
        return name

    def const_i64(self, arr):
        name = self.t("i")
        self.inits.append(numpy_helper.from_array(np.asarray(arr, dtype=np.int64), name))
        return name

    def op(self, op, inputs, **attrs):
        out = self.t(op.lower() + "_")
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def conv(self, x, cin, cout, k, stride=(1, 1), pads=None, group=1, bias=True):
        kh, kw = (k, k) if isinstance(k, int) else k
        w = rng.normal(0, 1 / np.sqrt(cin // group * kh * kw), (cout, cin // group, kh, kw))
        ins = [x, self.const(w, "w")]
        if bias:
            ins.append(self.const(rng.normal(0, 0.1, cout), "b"))
        pads = pads if pads is not None else [kh // 2, kw // 2, kh // 2, kw // 2]
        return self.op("Conv", ins, kernel_shape=[kh, kw], strides=list(stride), pads=pads, group=group)

    def conv_t(self, x, cin, cout, k, stride, pads=(0, 0, 0, 0), output_padding=(0, 0), group=1):
        w = rng.normal(0, 1 / np.sqrt(cin // group * k * k), (cin, cout // group, k, k))
        ins = [x, self.const(w, "w"), self.const(rng.normal(0, 0.1, cout), "b")]
        return self.op(
            "ConvTranspose",
            ins,
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=list(pads),
            output_padding=list(output_padding),
            group=group,
        )

    def bn(self, x, c):
        p = [
            rng.uniform(0.5, 1.5, c),
            rng.normal(0, 0.2, c),
            rng.normal(0, 0.3, c),
            rng.uniform(0.2, 2.0, c),
        ]
        return self.op("BatchNormalization", [x] + [self.const(v, "bn") for v in p], epsilon=1e-5)

    def hardswish_spelled(self, x):
        # As paddle2onnx writes it: x * clip(x + 3, 0, 6) / 6.
        a = self.op("Add", [x, self.const(3.0)])
        c = self.op("Clip", [a, self.const(0.0), self.const(6.0)])
        m = self.op("Mul", [x, c])
        return self.op("Div", [m, self.const(6.0)])

    def save(self, y, opset=13, extra=None):
        """Writes the model and its input `x` (and each further input of
        `extra`, a dict of name -> array, as `<name>-<input>.npy`)."""
        extra = extra or {}
        x = rng.normal(0, 1, self.x_shape).astype(np.float32)
        x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"] + list(self.x_shape[1:]))
        infos = [x_info] + [
            helper.make_tensor_value_info(k, TensorProto.FLOAT, ["N"] + list(v.shape[1:])) for k, v in extra.items()
        ]

        def model(y_shape):
            y_info = helper.make_tensor_value_info(y, TensorProto.FLOAT, y_shape)
            g = helper.make_graph(self.nodes, self.name, infos, [y_info], self.inits)
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="onnx_ops.py")
            m.ir_version = 8
            return m

        # The output's shape, from ONNX Runtime itself (batch left free).
        import onnxruntime as ort

        probe = model([None])
        probe.graph.output[0].type.tensor_type.shape.ClearField("dim")
        feeds = {"x": x, **extra}
        shape = ort.InferenceSession(probe.SerializeToString()).run(None, feeds)[0].shape
        m = model(["N"] + list(shape[1:]))
        onnx.checker.check_model(m)
        os.makedirs(OUT, exist_ok=True)
        onnx.save(m, os.path.join(OUT, f"{self.name}.onnx"))
        np.save(os.path.join(OUT, f"{self.name}-x.npy"), x)
        for k, v in extra.items():
            np.save(os.path.join(OUT, f"{self.name}-{k}.npy"), v)
        print(f"{self.name}: {len(self.nodes)} nodes, input {self.x_shape}")


def save_typed(g, inputs, y, y_shape, y_type=TensorProto.FLOAT, opset=17):
    """Writes model `g` with `inputs` (name, element type, declared shape,
    array: saved as `<model>-<name>.npy`) and the output `y`."""
    infos = [helper.make_tensor_value_info(k, t, shape) for k, t, shape, _ in inputs]
    y_info = helper.make_tensor_value_info(y, y_type, y_shape)
    graph = helper.make_graph(g.nodes, g.name, infos, [y_info], g.inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="onnx_ops.py")
    m.ir_version = 8
    onnx.checker.check_model(m)
    os.makedirs(OUT, exist_ok=True)
    onnx.save(m, os.path.join(OUT, f"{g.name}.onnx"))
    for k, _, _, a in inputs:
        np.save(os.path.join(OUT, f"{g.name}-{k}.npy"), a)


def conv_bn_relu6():
    g = G("conv-bn-relu6", [2, 3, 9, 11])
    y = g.conv("x", 3, 8, 3)
    y = g.bn(y, 8)
    y = g.op("Clip", [y, g.const(0.0), g.const(6.0)])
    g.save(y)


def depthwise_hardswish():
    # A depthwise 5x5 convolution with strides (2, 1), as in text-line CNNs.
    g = G("dw-hardswish", [1, 16, 12, 20])
    y = g.conv("x", 16, 16, 5, stride=(2, 1), group=16, bias=False)
    y = g.bn(y, 16)
    g.save(g.hardswish_spelled(y))


def grouped_pool():
    # Grouped convolution with asymmetric padding, hard sigmoid, max and
    # average pooling, and a Flatten of a channels-last tensor.
    g = G("group-pool", [2, 8, 10, 10])
    y = g.conv("x", 8, 12, 3, stride=(2, 2), pads=[0, 1, 1, 0], group=2)
    y = g.op("HardSigmoid", [y], alpha=0.25, beta=0.4)
    y = g.op("MaxPool", [y], kernel_shape=[2, 2], strides=[2, 2])
    y = g.op("AveragePool", [y], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    g.save(g.op("Flatten", [y], axis=1))


def se_head():
    # Pointwise convolution, squeeze-and-excitation, a residual sum, global
    # pooling and a classifier head.
    g = G("se-head", [2, 16, 6, 6])
    a = g.op("Relu", [g.bn(g.conv("x", 16, 24, 1, bias=False), 24)])
    s = g.op("GlobalAveragePool", [a])
    s = g.op("Relu", [g.conv(s, 24, 8, 1)])
    s = g.op("HardSigmoid", [g.conv(s, 8, 24, 1)], alpha=0.2, beta=0.5)
    a = g.op("Mul", [a, s])
    b = g.bn(g.conv("x", 16, 24, 3, stride=(1, 1)), 24)
    y = g.op("Add", [a, b])
    y = g.op("GlobalAveragePool", [y])
    y = g.op("Flatten", [y], axis=1)
    w = g.const(rng.normal(0, 0.3, (5, 24)), "fc")
    y = g.op("Gemm", [y, w, g.const(rng.normal(0, 0.1, 5), "fcb")], transB=1)
    g.save(g.op("Softmax", [y], axis=-1))


def channel_consts():
    # Per-channel constants that cannot be folded into a convolution, the
    # HardSwish operator (opset 14), a scalar Sub, c - x.
    g = G("channel-consts", [1, 4, 5, 7])
    y = g.op("Mul", ["x", g.const(rng.uniform(0.5, 2, (4, 1, 1)))])
    y = g.conv(y, 4, 6, 3)
    y = g.op("HardSwish", [y])
    y = g.op("Sub", [y, g.const(0.25)])
    y = g.op("Mul", [y, g.const(rng.uniform(-1, 1, (1, 6, 1, 1)))])
    y = g.op("Sub", [g.const(rng.normal(0, 1, (6, 5, 7))), y])
    g.save(y, opset=14)


def decoder():
    # An FPN/U-Net style decoder as in text detectors (DBNet, PP-OCR det):
    # a strided convolution, transposed convolutions (k2 s2; k3 s2 with
    # padding, output padding and groups), a channel Concat with the skip
    # connection, Pad with a value, nearest Resize, and a strided Slice.
    g = G("decoder", [2, 8, 6, 10])
    a = g.op("Relu", [g.conv("x", 8, 12, 3, stride=(2, 2))])
    u = g.bn(g.conv_t(a, 12, 8, 2, stride=2), 8)
    c = g.op("Concat", ["x", u], axis=1)
    p = g.op("Pad", [c, g.const_i64([0, 0, 1, 2, 0, 0, 1, 0]), g.const(0.5)], mode="constant")
    v = g.conv(p, 16, 6, 3, pads=[0, 0, 0, 0])
    r = g.op("Resize", [v, "", g.const([1, 1, 2, 2])], mode="nearest")
    s = g.op("Slice", [r, g.const_i64([1, 0]), g.const_i64([11, 20]), g.const_i64([2, 3]), g.const_i64([1, 2])])
    t = g.conv_t(s, 6, 4, 3, stride=2, pads=(1, 1, 1, 1), output_padding=(1, 1), group=2)
    g.save(g.op("Sigmoid", [t]))


def resize_modes():
    # Resize in each mode and coordinate mapping, the branches summed.
    g = G("resize-modes", [1, 3, 5, 7])
    size = g.const_i64([1, 3, 10, 4])
    ys = [
        g.op("Resize", ["x", "", "", size], mode="linear"),
        g.op("Resize", ["x", "", "", size], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
        g.op("Resize", ["x", "", "", size], mode="cubic", coordinate_transformation_mode="align_corners"),
        g.op("Resize", ["x", "", "", size], mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1),
        g.op("Resize", ["x", "", g.const([1, 1, 2, 0.6])], mode="nearest",
             coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        g.op("Resize", ["x", "", "", size], mode="nearest", coordinate_transformation_mode="align_corners",
             nearest_mode="round_prefer_ceil"),
    ]
    y = ys[0]
    for other in ys[1:]:
        y = g.op("Add", [y, other])
    g.save(y)


def layernorm_decomposed():
    # The layer normalization that exporters write out below opset 17:
    # ReduceMean, Sub, Pow, Add, Sqrt, Div of computed tensors with
    # broadcasting; then a strided Slice of the sequence, a sigmoid spelled
    # with Neg/Exp/Reciprocal, a division by a mean over the sequence, and
    # a Concat with a constant.
    g = G("layernorm-decomposed", [3, 6, 16])
    h = g.op("MatMul", ["x", g.const(rng.normal(0, 0.5, (16, 16)))])
    m = g.op("ReduceMean", [h], axes=[-1])
    d = g.op("Sub", [h, m])
    v = g.op("ReduceMean", [g.op("Pow", [d, g.const(2.0)])], axes=[-1])
    s = g.op("Sqrt", [g.op("Add", [v, g.const(1e-5)])])
    y = g.op("Div", [d, s])
    y = g.op("Add", [g.op("Mul", [y, g.const(rng.uniform(0.5, 1.5, 16))]), g.const(rng.normal(0, 0.1, 16))])
    y = g.op("Slice", [y, g.const_i64([1]), g.const_i64([6]), g.const_i64([1]), g.const_i64([2])])
    e = g.op("Exp", [g.op("Neg", [y])])
    r = g.op("Reciprocal", [g.op("Add", [e, g.const(1.0)])])
    w = g.op("Div", [r, g.op("ReduceMean", [r], axes=[1])])
    g.save(g.op("Concat", [w, g.const(rng.normal(0, 1, (3, 3, 4)))], axis=-1))


def transposed_operands():
    # Transposes (views, no data moved) read by element-wise operations:
    # with a constant of the full shape, a scalar, constant - view, and a
    # product of a view with a computed tensor.
    g = G("transposed-operands", [2, 3, 4])
    t = g.op("Transpose", ["x"], perm=[0, 2, 1])
    a = g.op("Add", [t, g.const(rng.normal(0, 1, (4, 3)))])
    b = g.op("Mul", [g.op("Transpose", ["x"], perm=[0, 2, 1]), g.const(1.5)])
    c = g.op("Sub", [g.const(rng.normal(0, 1, (1, 3))), g.op("Transpose", ["x"], perm=[0, 2, 1])])
    d = g.op("Mul", [g.op("Transpose", ["x"], perm=[0, 2, 1]), g.op("Relu", [a])])
    g.save(g.op("Add", [g.op("Add", [b, c]), d]))


def pad_slice_modes():
    # Pad in reflect, edge and wrap mode (of a conv output, stored
    # channels-last, and of the dense input), summed, then a Slice with
    # negative steps on the channels and the width. Its own generator, so
    # building it leaves the other fixtures as they are.
    global rng
    rng = np.random.default_rng(20261124)
    g = G("pad-slice-modes", [2, 4, 6, 7])
    c = g.conv("x", 4, 5, 3)
    p1 = g.op("Pad", [c, g.const_i64([0, 0, 1, 2, 0, 0, 2, 1])], mode="reflect")
    p2 = g.op("Pad", ["x", g.const_i64([0, 1, 2, 0, 0, 0, 1, 3])], mode="edge")
    p3 = g.op("Pad", [c, g.const_i64([0, 0, 2, 1, 0, 0, 1, 2])], mode="wrap")
    y = g.op("Add", [g.op("Add", [p1, p2]), p3])
    s = g.op("Slice", [y, g.const_i64([-1, -1]), g.const_i64([-100, -100]), g.const_i64([1, 3]),
                       g.const_i64([-1, -2])])
    g.save(g.op("Sigmoid", [s]), opset=19)


def masked_attention():
    # Self-attention of 4 heads over 6 tokens with multi-query keys and
    # values (one head each, broadcast over the heads by the batched
    # MatMuls), an additive padding mask computed from a second input
    # (1 = token, 0 = padding: (1 - m) * -1e9, unsqueezed to [N,1,1,S] and
    # broadcast over heads and query rows) and a constant causal mask of
    # -inf above the diagonal. Its own generator, as pad_slice_modes.
    global rng
    rng = np.random.default_rng(20261125)
    n, s, d, h = 3, 6, 16, 4
    dh = d // h
    g = G("masked-attention", [n, s, d])
    q = g.op("MatMul", ["x", g.const(rng.normal(0, 0.4, (d, d)))])
    q = g.op("Transpose", [g.op("Reshape", [q, g.const_i64([0, s, h, dh])])], perm=[0, 2, 1, 3])
    k = g.op("MatMul", ["x", g.const(rng.normal(0, 0.4, (d, dh)))])
    kt = g.op("Transpose", [g.op("Reshape", [k, g.const_i64([0, s, 1, dh])])], perm=[0, 2, 3, 1])
    v = g.op("MatMul", ["x", g.const(rng.normal(0, 0.4, (d, dh)))])
    v = g.op("Transpose", [g.op("Reshape", [v, g.const_i64([0, s, 1, dh])])], perm=[0, 2, 1, 3])
    sc = g.op("Mul", [g.op("MatMul", [q, kt]), g.const(1 / np.sqrt(dh))])
    pad = g.op("Mul", [g.op("Sub", [g.const(1.0), "m"]), g.const(-1e9)])
    pad = g.op("Unsqueeze", [pad, g.const_i64([1, 2])])
    causal = np.triu(np.full((s, s), -np.inf, dtype=np.float32), 1)
    sc = g.op("Add", [g.op("Add", [sc, pad]), g.const(causal)])
    p = g.op("Softmax", [sc], axis=-1)
    o = g.op("Transpose", [g.op("MatMul", [p, v])], perm=[0, 2, 1, 3])
    o = g.op("Reshape", [o, g.const_i64([0, s, d])])
    y = g.op("MatMul", [o, g.const(rng.normal(0, 0.4, (d, d)))])
    # Every sequence keeps its first token; the others are padded from a
    # random length on.
    lens = rng.integers(1, s + 1, n)
    lens[0] = s
    m = (np.arange(s)[None, :] < lens[:, None]).astype(np.float32)
    g.save(y, opset=13, extra={"m": m})


def token_embedding():
    # A text model's front: int64 token ids in (as transformers exports
    # them), word embeddings gathered by them (once directly, once through
    # a Reshape of the ids to one axis and back), position embeddings
    # gathered by constant positions (folded), a layer norm and a
    # projection. Its own generator and its own input, `ids`.
    global rng
    rng = np.random.default_rng(20261126)
    n, s, v, d = 3, 7, 50, 16
    g = G("token-embedding", [n, s])
    x = g.op("Gather", [g.const(rng.normal(0, 1, (v, d))), "ids"], axis=0)
    flat = g.op("Reshape", ["ids", g.const_i64([-1])])
    x2 = g.op("Gather", [g.const(rng.normal(0, 1, (v, d))), flat])
    x2 = g.op("Reshape", [x2, g.const_i64([-1, s, d])])
    pos = g.op("Gather", [g.const(rng.normal(0, 1, (s, d))), g.const_i64(np.arange(s))])
    x = g.op("Add", [g.op("Add", [x, x2]), pos])
    x = g.op("LayerNormalization", [x, g.const(np.ones(d)), g.const(np.zeros(d))], axis=-1, epsilon=1e-5)
    y = g.op("MatMul", [x, g.const(rng.normal(0, 0.3, (d, 5)))])
    ids = rng.integers(0, v, (n, s)).astype(np.int64)
    ids[0, :3] = [0, v - 1, 0]  # the table's first and last rows
    save_typed(g, [("ids", TensorProto.INT64, ["N", s], ids)], y, ["N", s, 5])
    print(f"{g.name}: {len(g.nodes)} nodes, input ids {list(ids.shape)} int64")


def token_mask():
    # A text model's attention with its padding mask as transformers
    # exports it: int64 ids and an int64 attention mask in; the ids cast to
    # int32 and gathered by, the mask cast to float, (1 - m) * -10000
    # unsqueezed over the query rows and added to the scores, softmax,
    # the product with the values. Two inputs, `ids` and `mask`.
    global rng
    rng = np.random.default_rng(20261127)
    n, s, v, d = 3, 6, 40, 8
    g = G("token-mask", [n, s])
    ids32 = g.op("Cast", ["ids"], to=TensorProto.INT32)
    x = g.op("Gather", [g.const(rng.normal(0, 1, (v, d))), ids32])
    m = g.op("Cast", ["mask"], to=TensorProto.FLOAT)
    bias = g.op("Mul", [g.op("Sub", [g.const(1.0), m]), g.const(-10000.0)])
    bias = g.op("Unsqueeze", [bias, g.const_i64([1])])
    sc = g.op("MatMul", [x, g.op("Transpose", [x], perm=[0, 2, 1])])
    sc = g.op("Add", [g.op("Mul", [sc, g.const(1 / np.sqrt(d))]), bias])
    p = g.op("Softmax", [sc], axis=-1)
    y = g.op("MatMul", [p, x])
    ids = rng.integers(0, v, (n, s)).astype(np.int64)
    lens = rng.integers(1, s + 1, n)
    lens[0] = s
    mask = (np.arange(s)[None, :] < lens[:, None]).astype(np.int64)
    save_typed(g, [(k, TensorProto.INT64, ["N", s], a) for k, a in (("ids", ids), ("mask", mask))], y, ["N", s, d])
    print(f"{g.name}: {len(g.nodes)} nodes, inputs ids and mask {list(ids.shape)} int64")


def logic_ops():
    # Comparisons, logic and selection on computed tensors, as exporters
    # build masks: Less / GreaterOrEqual / Equal against constants and
    # between computed tensors, And / Or / Not / Xor, Where with a
    # constant and a computed branch (a -10000 mask before a softmax),
    # IsNaN of a square root of negatives, IsInf of 1 / x at an exact 0,
    # Cast to bool and back to float. The input holds exact 0, 0.5 and
    # -0.5 (the comparisons' boundaries).
    global rng
    rng = np.random.default_rng(20261128)
    n, k = 4, 10
    g = G("logic-ops", [n, k])
    a = g.op("Less", ["x", g.const(0.5)])
    b = g.op("GreaterOrEqual", ["x", g.const(-0.5)])
    inside = g.op("And", [a, b])
    d = g.op("Or", [g.op("Not", [a]), g.op("Equal", ["x", g.const(0.0)])])
    e = g.op("Xor", [inside, d])
    sq = g.op("Mul", ["x", "x"])
    gt = g.op("Greater", [sq, "x"])
    masked = g.op("Where", [inside, "x", g.const(-10000.0)])
    p = g.op("Softmax", [masked], axis=-1)
    picked = g.op("Where", [e, g.op("Exp", ["x"]), g.const(2.0)])
    nan = g.op("IsNaN", [g.op("Sqrt", ["x"])])
    inf = g.op("IsInf", [g.op("Div", [g.const(1.0), "x"])])
    nz = g.op("Cast", ["x"], to=TensorProto.BOOL)
    f = lambda t: g.op("Cast", [t], to=TensorProto.FLOAT)
    y = g.op("Concat", [p, picked, f(nan), f(inf), f(nz), f(e), f(gt)], axis=1)
    x = rng.normal(0, 1, (n, k)).astype(np.float32)
    x[:, 0] = [0.0, 0.5, -0.5, 0.25]  # every row has an element inside [-0.5, 0.5)
    x[1, 3], x[2, 4], x[3, 5] = 0.0, 0.5, -0.5
    save_typed(g, [("x", TensorProto.FLOAT, ["N", k], x)], y, ["N", 7 * k])
    print(f"{g.name}: {len(g.nodes)} nodes, input {list(x.shape)}")


def arg_extremes(name, op, axis, keepdims, last):
    # ArgMax / ArgMin with an integer (int64) output, on an input with
    # ties (the first or last index must win), both axes. No NaN: ONNX
    # Runtime scans with `>` (a NaN first element wins, later ones are
    # skipped) where numpy and ONNX's reference take the first NaN, as the
    # compiler does (docs/compiled-model-format.md).
    global rng
    rng = np.random.default_rng(20261129)
    n, k = 5, 9
    g = G(name, [n, k])
    y = g.op(op, ["x"], axis=axis, keepdims=keepdims, select_last_index=last)
    x = rng.integers(-3, 4, (n, k)).astype(np.float32) * 0.5  # many ties
    x[0, :] = 1.0  # all equal
    shape = list(np.zeros((n, k)).max(axis=axis, keepdims=bool(keepdims)).shape)
    if axis == 1:
        shape[0] = "N"
    save_typed(g, [("x", TensorProto.FLOAT, ["N", k], x)], y, shape, TensorProto.INT64, opset=13)
    print(f"{g.name}: {op} axis {axis} keepdims {keepdims} select_last_index {last}")


def top_k(name, largest, out):
    # TopK, K = 4 along the rows, over rows with ties, a row all equal and
    # infinities; the values (`out` 0) or the int64 indices (`out` 1).
    global rng
    rng = np.random.default_rng(20261130)
    n, k = 5, 10
    g = G(name, [n, k])
    outs = [g.t("values"), g.t("indices")]
    g.nodes.append(helper.make_node("TopK", ["x", g.const_i64([4])], outs, name=name, axis=1, largest=largest))
    x = rng.integers(-3, 4, (n, k)).astype(np.float32) * 0.5
    x[0, :] = 2.0
    x[1, 2], x[1, 7], x[2, 0] = np.inf, -np.inf, -np.inf
    y_type = TensorProto.FLOAT if out == 0 else TensorProto.INT64
    save_typed(g, [("x", TensorProto.FLOAT, ["N", k], x)], outs[out], ["N", 4], y_type, opset=13)
    print(f"{g.name}: TopK largest {largest}, output {out}")


def vector_head():
    # A vector-unit head with no matrix product (its SA:VU time ratio is
    # 0, a CNN's above 10; for the harvesting scenario,
    # tests/scenarios/harvest.toml): softmax over rows, a scale, sigmoid,
    # a residual, tanh, exp, a gate, and a mean over each row.
    # Its own generator, so building it alone gives the committed weights;
    # ONNX Runtime's output is saved too (`vector-head-ort.npy`), the
    # reference the scenario checks the VMs' outputs against.
    global rng
    saved, rng = rng, np.random.default_rng(20261126)
    g = G("vector-head", [4, 64, 512])
    s = g.op("Softmax", ["x"], axis=-1)
    m = g.op("Mul", [s, g.const(rng.normal(0, 64, 512))])
    a = g.op("Add", [g.op("Sigmoid", [m]), "x"])
    e = g.op("Exp", [g.op("Tanh", [a])])
    h = g.op("Mul", [g.op("Sigmoid", [e]), g.op("Tanh", [e])])
    g.save(g.op("ReduceMean", [h], axes=[-1], keepdims=0))
    import onnxruntime as ort

    x = np.load(os.path.join(OUT, "vector-head-x.npy"))
    sess = ort.InferenceSession(os.path.join(OUT, "vector-head.onnx"))
    np.save(os.path.join(OUT, "vector-head-ort.npy"), sess.run(None, {"x": x})[0])
    rng = saved


BUILDERS = {
    "vector-head": vector_head,
    "conv-bn-relu6": conv_bn_relu6,
    "dw-hardswish": depthwise_hardswish,
    "group-pool": grouped_pool,
    "se-head": se_head,
    "channel-consts": channel_consts,
    "decoder": decoder,
    "resize-modes": resize_modes,
    "layernorm-decomposed": layernorm_decomposed,
    "transposed-operands": transposed_operands,
    "pad-slice-modes": pad_slice_modes,
    "masked-attention": masked_attention,
    "token-embedding": token_embedding,
    "token-mask": token_mask,
    "logic-ops": logic_ops,
    "argmax": lambda: arg_extremes("argmax", "ArgMax", 1, 0, 0),
    "argmin-last": lambda: arg_extremes("argmin-last", "ArgMin", 1, 1, 1),
    "topk-indices": lambda: top_k("topk-indices", 1, 1),
    "topk-smallest": lambda: top_k("topk-smallest", 0, 0),
}


if __name__ == "__main__":
    import sys

    # With names, only those (the shared generator then gives the earlier
    # models other weights than the committed ones: build those all at once).
    if len(sys.argv) > 1:
        for name in sys.argv[1:]:
            BUILDERS[name]()
        sys.exit(0)
    conv_bn_relu6()
    depthwise_hardswish()
    grouped_pool()
    se_head()
    channel_consts()
    decoder()
    resize_modes()
    layernorm_decomposed()
    transposed_operands()
    pad_slice_modes()
    masked_attention()
    token_embedding()
    token_mask()
    logic_ops()
    arg_extremes("argmax", "ArgMax", 1, 0, 0)
    arg_extremes("argmin-last", "ArgMin", 1, 1, 1)
    top_k("topk-indices", 1, 1)
    top_k("topk-smallest", 0, 0)
