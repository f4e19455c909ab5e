//! `docs/compiled-model-format.md`'s operator table lists exactly the compiler's
//! operators with their notes (the conformance test, which has the node
//! tests, also checks the figures).
#![allow(clippy::unwrap_used)]

#[test]
fn the_operator_table_is_the_compilers_list() {
    let doc = std::fs::read_to_string(format!(
        "{}/../../docs/compiled-model-format.md",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let b = doc.find("<!-- operators:begin -->").expect("the table's start marker");
    let e = doc.find("<!-- operators:end -->").expect("the table's end marker");
    let rows: Vec<(String, String)> = doc[b..e]
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            (cells[0].trim_matches('`').to_string(), cells[1].to_string())
        })
        .collect();
    let want: Vec<(String, String)> =
        npu_onnx::operators::OPERATORS.iter().map(|o| (o.op.to_string(), o.notes.to_string())).collect();
    assert_eq!(
        rows, want,
        "regenerate: VNPU_WRITE_DOCS=1 cargo test --release -p npu-onnx --test conformance"
    );
}

/// The `ai.onnx.ml` table of `docs/compiled-model-format.md` is
/// `npu_onnx::ml::table()` (`VNPU_WRITE_DOCS=1` rewrites it).
#[test]
fn the_ml_operator_table_is_the_compilers_list() {
    let path = format!("{}/../../docs/compiled-model-format.md", env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(&path).unwrap();
    let (begin, end) = ("<!-- ml-operators:begin -->\n", "<!-- ml-operators:end -->");
    let b = doc.find(begin).expect("the table's start marker") + begin.len();
    let e = doc.find(end).expect("the table's end marker");
    let want = npu_onnx::ml::table();
    if std::env::var_os("VNPU_WRITE_DOCS").is_some() {
        std::fs::write(&path, format!("{}{want}{}", &doc[..b], &doc[e..])).unwrap();
        return;
    }
    assert_eq!(&doc[b..e], want, "regenerate: VNPU_WRITE_DOCS=1 cargo test -p npu-onnx --test operator_doc");
}
