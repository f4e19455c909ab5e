//! The operators the compiler takes: the list `Compiler::node` admits
//! (an operator not listed here is refused before any handler sees it),
//! and from which `docs/compiled-model-format.md`'s operator table is generated
//! (the ONNX conformance test writes and checks it, with each operator's
//! node-test figures).

/// One operator of the default domain the compiler takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operator {
    /// ONNX name.
    pub op: &'static str,
    /// How it is compiled, its attributes, and what is refused.
    pub notes: &'static str,
}

const fn op(op: &'static str, notes: &'static str) -> Operator {
    Operator { op, notes }
}

/// Every operator the compiler takes (opsets [`crate::load::MIN_OPSET`] to
/// [`crate::load::MAX_OPSET`]; a constant input folds any of them that
/// the folding list of `docs/compiled-model-format.md` names), alphabetically.
pub const OPERATORS: &[Operator] = &[
    op("Abs", "`vu.unary abs`; folded on constants"),
    op("Add", "`vu.binary add`, numpy broadcasting, constants folded into the operation before"),
    op("And", "booleans (0/1): `keep(a, b)`"),
    op("ArgMax", "`axis`, `keepdims`, `select_last_index`; the first NaN wins, as numpy's; an integer output (`vu.unary f32_to_i32`)"),
    op("ArgMin", "as `ArgMax` of `-x`"),
    op("Attention", "opset 23+: heads, cache, GQA, scale, softcap, `qk_matmul_output`; the mask must be a constant or `is_causal`"),
    op("AveragePool", "2-D and 1-D, strides, pads, `ceil_mode`; `count_include_pad` 1 with padding refused"),
    op("BatchNormalization", "inference; folded into the product before, else per channel; computed statistics as their definition"),
    op("Cast", "to float, to int32/int64 (integer tensors), to bool (`x != 0`); other types refused"),
    op("CastLike", "as `Cast`, to the second input's type"),
    op("Ceil", "`vu.unary ceil`"),
    op("Celu", "`alpha > 0`, as its definition"),
    op("Clip", "`vu.clamp`; constant bounds"),
    op("Concat", "strided copies, none for a product's output along the innermost axis; folded on constants"),
    op("Constant", "`value`, `value_float(s)`, `value_int(s)`"),
    op("ConstantOfShape", "of a constant shape (at most 2^26 elements)"),
    op("Conv", "2-D, constant weights and bias, `group`, strides, pads, `auto_pad`; `dilations` other than 1 refused"),
    op("ConvTranspose", "2-D, constant weights, strides, pads, `output_padding`, `group`"),
    op("Cos", "`vu.unary cos`"),
    op("Cosh", "`(exp(x) + exp(-x)) / 2`"),
    op("DepthToSpace", "`DCR` and `CRD`: one strided copy"),
    op("Div", "`x * (1 / y)` (`vu.unary recip`, then `vu.binary mul`; a constant's reciprocal folded), numpy broadcasting"),
    op("Dropout", "inference (the identity); training mode and the mask output refused"),
    op("Elu", "`alpha > 0`, as its definition"),
    op("Equal", "`vu.binary eq` (IEEE); an integer input compared as f32 (exact to 2^24)"),
    op("Erf", "`vu.unary erf`"),
    op("Exp", "`vu.unary exp`"),
    op("Expand", "to a constant shape"),
    op("Flatten", "a rename"),
    op("Floor", "`vu.unary floor`"),
    op("Gather", "of a constant table by integer inputs (`dma.gather`, indices checked at run time); of a computed tensor by constant indices, any axis"),
    op("GatherElements", "constant indices"),
    op("GatherND", "constant indices; `batch_dims` 0 on a computed tensor"),
    op("Gelu", "`approximate` none (`gelu_erf`) or tanh"),
    op("Gemm", "constant or computed operands, `alpha`, `beta`, `transA`, `transB`"),
    op("GlobalAveragePool", "`vu.reduce`"),
    op("GlobalMaxPool", "`vu.reduce max`"),
    op("Greater", "`vu.binary gt` (IEEE); an integer input compared as f32 (exact to 2^24)"),
    op("GreaterOrEqual", "`vu.binary ge` (IEEE); an integer input compared as f32 (exact to 2^24)"),
    op("GroupNormalization", "as its definition"),
    op("HardSigmoid", "`vu.clamp` of an affine map"),
    op("HardSwish", "as its definition"),
    op("Identity", "a rename"),
    op("InstanceNormalization", "as its definition"),
    op("IsInf", "`detect_negative`, `detect_positive`"),
    op("IsNaN", "`x != x`"),
    op("LRN", "as its definition"),
    op("LayerNormalization", "any `axis`, `epsilon`, `stash_type` 1; `Mean` and `InvStdDev` outputs"),
    op("LeakyRelu", "as its definition"),
    op("Less", "`vu.binary lt` (IEEE); an integer input compared as f32 (exact to 2^24)"),
    op("LessOrEqual", "`vu.binary le` (IEEE); an integer input compared as f32 (exact to 2^24)"),
    op("Log", "`vu.unary log`"),
    op("LogSoftmax", "`x - max - log(sum(exp(x - max)))` over `axis`"),
    op("LpNormalization", "p 1 or 2"),
    op("LpPool", "any p"),
    op("MatMul", "constant weights (`sa.matmul`), computed x computed (batched, broadcast), vectors"),
    op("Max", "`vu.binary max` (NaN propagates), any number of inputs"),
    op("MaxPool", "2-D and 1-D, strides, pads, `ceil_mode`; the `Indices` output refused"),
    op("Mean", "a sum of the inputs, scaled"),
    op("Min", "`vu.binary min` (NaN propagates), any number of inputs"),
    op("Mod", "folded on constants only"),
    op("Mul", "`vu.binary mul`, numpy broadcasting"),
    op("Neg", "an affine map"),
    op("Not", "`x == 0`"),
    op("Or", "booleans (0/1): the larger"),
    op("PRelu", "any slope that broadcasts"),
    op("Pad", "`constant`, `reflect`, `edge`, `wrap`; constant pads"),
    op("Pow", "a constant exponent"),
    op("RMSNormalization", "`x / sqrt(mean(x^2) + epsilon) * scale` over the axes from `axis`"),
    op("Range", "folded (constant inputs)"),
    op("Reciprocal", "`vu.unary recip`"),
    op("ReduceL1", "adjacent axes; `keepdims`, `noop_with_empty_axes`"),
    op("ReduceL2", "adjacent axes"),
    op("ReduceLogSum", "adjacent axes"),
    op("ReduceLogSumExp", "adjacent axes (no max subtracted, as ONNX defines it)"),
    op("ReduceMax", "adjacent axes"),
    op("ReduceMean", "adjacent axes, axes as an attribute or a constant input"),
    op("ReduceMin", "adjacent axes, `-max(-x)`"),
    op("ReduceProd", "one axis of at most 64 elements: the product of its slices in order; folded on constants (any axes)"),
    op("ReduceSum", "adjacent axes"),
    op("ReduceSumSquare", "adjacent axes"),
    op("Relu", "`vu.unary relu` (NaN propagates)"),
    op("Reshape", "a rename of a tensor in ONNX's order; `allowzero`"),
    op("Resize", "nearest (every rounding mode), linear, cubic; constant scales or sizes"),
    op("RotaryEmbedding", "without `position_ids`"),
    op("Selu", "as its definition"),
    op("Shape", "folded (`start`, `end`)"),
    op("Shrink", "soft shrink as its definition"),
    op("Sigmoid", "`vu.unary sigmoid`"),
    op("Sin", "`vu.unary sin`"),
    op("Sinh", "`(exp(x) - exp(-x)) / 2`"),
    op("Size", "folded"),
    op("Slice", "constant starts, ends, axes and steps (negative steps too)"),
    op("Softmax", "any `axis`"),
    op("Softplus", "`log(exp(x) + 1)`"),
    op("Softsign", "`x * (1 / (1 + |x|))`"),
    op("SpaceToDepth", "one strided copy"),
    op("Split", "along one axis; sizes from the input or attribute, else equal parts"),
    op("Sqrt", "`vu.unary sqrt`"),
    op("Squeeze", "a rename"),
    op("Sub", "`x + (-y)`, numpy broadcasting"),
    op("Sum", "`vu.binary add`, any number of inputs"),
    op("SwiGLU", "as its definition"),
    op("Swish", "`x * sigmoid(alpha * x)`"),
    op("Tan", "`sin / cos`"),
    op("Tanh", "`vu.unary tanh`"),
    op("TopK", "a constant K (at most 256), `axis`, `largest`, `sorted`: K rounds of the largest element not taken yet (a NaN the largest, the first of equal ones); the values sorted; the indices an integer output"),
    op("Transpose", "a view (strided reads); folded on constants"),
    op("Unsqueeze", "a rename"),
    op("Upsample", "opsets 7-9: nearest (floor) and linear"),
    op("Where", "`keep(c, x) + keep(c == 0, y)`; integer branches refused"),
    op("Xor", "booleans (0/1): `a != b`"),
];

/// Whether the compiler takes operator `op` of the default domain.
pub fn listed(op: &str) -> bool {
    OPERATORS.binary_search_by(|o| o.op.cmp(op)).is_ok()
}

/// Node tests of an operator: passed, wrong, refused.
pub type Figures = (usize, usize, usize);

/// The markdown table of [`OPERATORS`], with each operator's node-test
/// figures from `figures`, where given.
pub fn table(figures: impl Fn(&str) -> Option<Figures>) -> String {
    let mut s = String::from(
        "| operator | how it is compiled, and limits | node tests passed / wrong / refused |\n| --- | --- | --- |\n",
    );
    for o in OPERATORS {
        let f = figures(o.op).map_or_else(|| "none".to_string(), |(p, w, r)| format!("{p} / {w} / {r}"));
        s.push_str(&format!("| `{}` | {} | {f} |\n", o.op, o.notes));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list is sorted (the lookup is a binary search) and has no
    /// duplicate.
    #[test]
    fn the_list_is_sorted_without_duplicates() {
        assert!(OPERATORS.windows(2).all(|w| w[0].op < w[1].op), "OPERATORS must be sorted by name");
        assert!(listed("MatMul") && listed("Abs") && listed("Xor") && !listed("Scan") && !listed("matmul"));
    }

    /// Every listed operator reaches a handler of its own: a one-node
    /// model of it may be refused for its inputs or attributes, never as
    /// an unknown operator (the refusal an unlisted one gets).
    #[test]
    fn every_listed_operator_has_a_handler() {
        use onnx_protobuf::{GraphProto, Message, ModelProto, NodeProto, OperatorSetIdProto, ValueInfoProto};
        let info = |name: &str| {
            let mut v = ValueInfoProto::new();
            v.name = name.into();
            let mut t = onnx_protobuf::type_proto::Tensor::new();
            t.elem_type = 1;
            let mut shape = onnx_protobuf::TensorShapeProto::new();
            for d in [2, 4] {
                let mut dim = onnx_protobuf::tensor_shape_proto::Dimension::new();
                dim.set_dim_value(d);
                shape.dim.push(dim);
            }
            t.shape = protobuf::MessageField::some(shape);
            let mut ty = onnx_protobuf::TypeProto::new();
            ty.set_tensor_type(t);
            v.type_ = protobuf::MessageField::some(ty);
            v
        };
        let board = npu_model::BoardConfig::default();
        let opts = crate::CompileOptions {
            shape: npu_lower::VnpuShape::on_board(&board, 1, 1, board.sram_bytes(), 1 << 30),
            batch: 2,
            shapes: std::collections::HashMap::new(),
            outputs: None,
            dtype: vnpu_abi::DType::F32,
            bf16_activations: false,
            spread: None,
            reuse_hbm: true,
            fuse_residual: true,
            fuse_blocks: true,
        };
        for o in OPERATORS {
            let mut node = NodeProto::new();
            node.op_type = o.op.into();
            node.name = "n".into();
            node.input = vec!["x".into(), "x".into()];
            node.output = vec!["y".into()];
            let mut g = GraphProto::new();
            g.node.push(node);
            g.input.push(info("x"));
            g.output.push(info("y"));
            let mut m = ModelProto::new();
            m.graph = protobuf::MessageField::some(g);
            let mut set = OperatorSetIdProto::new();
            set.version = 23;
            m.opset_import.push(set);
            let bytes = m.write_to_bytes().unwrap_or_default();
            if let Err(e) = crate::compile(&bytes, &opts) {
                let e = e.to_string();
                assert!(!e.contains("lists what is"), "{}: {e}", o.op);
            }
        }
    }
}
