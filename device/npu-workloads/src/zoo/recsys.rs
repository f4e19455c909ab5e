//! Recommendation models: DLRM, NCF, Wide & Deep, DIN.

use super::*;

/// Wide & Deep (Cheng et al. 2016) with Criteo-like inputs: 13 dense
/// features and 26 categorical ones of 100k values each, embedded in 32
/// dimensions; the deep part is an MLP 845-1024-512-256-1 over the dense
/// features and the 26 embeddings, the wide part a linear model over 40
/// one-hot crosses of the categories (an embedding bag of 1-dimensional
/// weights from one table of 1M crosses); the output is the sigmoid of
/// their sum.
pub(super) fn wide_deep(batch: u32) -> Graph {
    const SPARSE: u32 = 26;
    const DIM: u32 = 32;
    const ROWS: u32 = 100_000;
    const CROSSES: u32 = 1_000_000;
    let mut g = Graph::new("wide-deep", batch);
    let dense = g.tensor("dense", u64::from(batch) * 13, Init::Input);
    g.input = dense;
    let cols = 13 + SPARSE * DIM;
    let deep_in = g.act("deep.in", u64::from(batch) * u64::from(cols));
    g.ops.push(Op::Copy {
        name: "concat".into(),
        x: View::dense(dense, 13),
        y: View { t: deep_in, ld: cols, col: 0 },
        rows: batch,
        cols: 13,
    });
    for t in 0..SPARSE {
        let table =
            g.tensor(format!("emb{t}.table"), u64::from(ROWS) * u64::from(DIM), Init::Weights { fan_in: 1 });
        let idx = g.tensor(format!("emb{t}.idx"), u64::from(batch), Init::Indices { max: ROWS });
        g.ops.push(Op::Embedding {
            name: format!("emb{t}"),
            table,
            idx,
            y: View { t: deep_in, ld: cols, col: 13 + t * DIM },
            batch,
            rows: ROWS,
            dim: DIM,
            pool: 1,
        });
    }
    let d1 = g.linear("deep0", View::dense(deep_in, cols), batch, cols, 1024, Act::Relu, None);
    let d2 = g.linear("deep1", d1, batch, 1024, 512, Act::Relu, None);
    let d3 = g.linear("deep2", d2, batch, 512, 256, Act::Relu, None);
    let deep = g.linear("deep3", d3, batch, 256, 1, Act::None, None);
    let table = g.tensor("wide.table", u64::from(CROSSES), Init::Weights { fan_in: 1 });
    let idx = g.tensor("wide.idx", u64::from(batch) * 40, Init::Indices { max: CROSSES });
    let wide = g.act("wide", u64::from(batch));
    g.ops.push(Op::Embedding {
        name: "wide".into(),
        table,
        idx,
        y: View::dense(wide, 1),
        batch,
        rows: CROSSES,
        dim: 1,
        pool: 40,
    });
    let y = g.act("predict", u64::from(batch));
    g.ops.push(Op::Add {
        name: "predict".into(),
        a: deep,
        b: View::dense(wide, 1),
        y: View::dense(y, 1),
        rows: batch,
        cols: 1,
        act: Act::Sigmoid,
    });
    g.output = y;
    g
}

/// DIN, the Deep Interest Network (Zhou et al. 2018) with the paper's
/// shapes: goods and category embeddings of 18 dimensions each (36 per
/// item), a history of 50 behaviours, an activation unit per behaviour
/// (an MLP 144-80-40-1 over `[h, a, h - a, h * a]`, PReLU/Dice modelled as
/// ReLU, `h - a` as `h + a`: the same one VU pass), attention-weighted sum pooling of the history, and an MLP
/// 108-200-80-2 over `[user profile, pooled history, candidate]` (the
/// profile as one 36-dimensional embedding). The candidate's embedding is
/// gathered once per history position (the VU's binary operations do not
/// broadcast rows), and the weighted sum is a batched product of each
/// sample's 1 x 50 weights with its 50 x 36 history.
pub(super) fn din(batch: u32) -> Graph {
    const HIST: u32 = 50;
    const D: u32 = 36;
    const ITEMS: u32 = 100_000;
    const USERS: u32 = 100_000;
    let mut g = Graph::new("din", batch);
    let rows = batch * HIST;
    // Activation-unit input per behaviour: [h | a | h - a | h * a].
    let unit = g.act("unit.in", u64::from(rows) * u64::from(4 * D));
    let gather = |g: &mut Graph, name: &str, bags: u32, y: View, rows_in: u32| {
        let table =
            g.tensor(format!("{name}.table"), u64::from(rows_in) * u64::from(D), Init::Weights { fan_in: 1 });
        let idx = g.tensor(format!("{name}.idx"), u64::from(bags), Init::Indices { max: rows_in });
        g.ops.push(Op::Embedding {
            name: name.into(),
            table,
            idx,
            y,
            batch: bags,
            rows: rows_in,
            dim: D,
            pool: 1,
        });
        idx
    };
    let u = |col| View { t: unit, ld: 4 * D, col };
    g.input = gather(&mut g, "history", rows, u(0), ITEMS);
    gather(&mut g, "candidate.rep", rows, u(D), ITEMS);
    g.ops.push(Op::Add {
        name: "unit.diff".into(),
        a: u(0),
        b: u(D),
        y: u(2 * D),
        rows,
        cols: D,
        act: Act::None,
    });
    g.ops.push(Op::Mul {
        name: "unit.prod".into(),
        a: u(0),
        b: u(D),
        y: u(3 * D),
        rows,
        cols: D,
        act: Act::None,
    });
    let a1 = g.linear("unit0", View::dense(unit, 4 * D), rows, 4 * D, 80, Act::Relu, None);
    let a2 = g.linear("unit1", a1, rows, 80, 40, Act::Relu, None);
    let wts = g.linear("unit2", a2, rows, 40, 1, Act::None, None);
    // [profile | pooled | candidate]
    let top = g.act("mlp.in", u64::from(batch) * u64::from(3 * D));
    let t = |col| View { t: top, ld: 3 * D, col };
    gather(&mut g, "profile", batch, t(0), USERS);
    g.ops.push(Op::BatchMatMul {
        name: "pool".into(),
        a: wts.t,
        b: unit,
        y: top,
        lda: HIST,
        ldb: 4 * D,
        ldy: 3 * D,
        trans_b: false,
        m: 1,
        k: HIST,
        n: D,
        offs: (0..u64::from(batch))
            .map(|i| [i * u64::from(HIST), i * u64::from(HIST * 4 * D), i * u64::from(3 * D) + u64::from(D)])
            .collect(),
        act: Act::None,
    });
    gather(&mut g, "candidate", batch, t(2 * D), ITEMS);
    let m1 = g.linear("mlp0", View::dense(top, 3 * D), batch, 3 * D, 200, Act::Relu, None);
    let m2 = g.linear("mlp1", m1, batch, 200, 80, Act::Relu, None);
    g.output = g.linear("mlp2", m2, batch, 80, 2, Act::None, None).t;
    g
}

pub(super) fn dlrm(batch: u32) -> Graph {
    const TABLES: u32 = 32;
    const DIM: u32 = 32;
    const POOL: u32 = 120;
    const ROWS: u32 = 100_000;
    let mut g = Graph::new("dlrm", batch);
    let dense = g.tensor("dense", u64::from(batch) * 13, Init::Input);
    g.input = dense;
    let f = TABLES + 1;
    let z = g.act("features", u64::from(batch) * u64::from(f * DIM));
    let b1 = g.linear("bot0", View::dense(dense, 13), batch, 13, 128, Act::Relu, None);
    let b2 = g.linear("bot1", b1, batch, 128, 64, Act::Relu, None);
    let zview = |col| View { t: z, ld: f * DIM, col };
    g.linear("bot2", b2, batch, 64, DIM, Act::Relu, Some(zview(0)));
    for t in 0..TABLES {
        let table =
            g.tensor(format!("emb{t}.table"), u64::from(ROWS) * u64::from(DIM), Init::Weights { fan_in: 1 });
        let idx =
            g.tensor(format!("emb{t}.idx"), u64::from(batch) * u64::from(POOL), Init::Indices { max: ROWS });
        g.ops.push(Op::Embedding {
            name: format!("emb{t}"),
            table,
            idx,
            y: zview((t + 1) * DIM),
            batch,
            rows: ROWS,
            dim: DIM,
            pool: POOL,
        });
    }
    let top_in = f * f + DIM;
    let t_in = g.act("top.in", u64::from(batch) * u64::from(top_in));
    g.ops.push(Op::Copy {
        name: "concat".into(),
        x: zview(0),
        y: View { t: t_in, ld: top_in, col: 0 },
        rows: batch,
        cols: DIM,
    });
    g.ops.push(Op::Interaction {
        name: "interact".into(),
        z,
        y: View { t: t_in, ld: top_in, col: DIM },
        batch,
        f,
        d: DIM,
    });
    let t1 = g.linear("top0", View::dense(t_in, top_in), batch, top_in, 128, Act::Relu, None);
    let t2 = g.linear("top1", t1, batch, 128, 64, Act::Relu, None);
    g.output = g.linear("top2", t2, batch, 64, 1, Act::Sigmoid, None).t;
    g
}

pub(super) fn ncf(batch: u32) -> Graph {
    const USERS: u32 = 6040;
    const ITEMS: u32 = 3706;
    let mut g = Graph::new("ncf", batch);
    // [gmf_user 8 | gmf_item 8 | mlp_user 32 | mlp_item 32]
    let emb = g.act("embeddings", u64::from(batch) * 80);
    let mut first = None;
    for (i, (name, rows, dim, col)) in [
        ("gmf_user", USERS, 8u32, 0u32),
        ("gmf_item", ITEMS, 8, 8),
        ("mlp_user", USERS, 32, 16),
        ("mlp_item", ITEMS, 32, 48),
    ]
    .into_iter()
    .enumerate()
    {
        let table =
            g.tensor(format!("{name}.table"), u64::from(rows) * u64::from(dim), Init::Weights { fan_in: 1 });
        let idx = g.tensor(format!("{name}.idx"), batch.into(), Init::Indices { max: rows });
        if i == 0 {
            first = Some(idx);
        }
        g.ops.push(Op::Embedding {
            name: name.into(),
            table,
            idx,
            y: View { t: emb, ld: 80, col },
            batch,
            rows,
            dim,
            pool: 1,
        });
    }
    g.input = first.unwrap_or(0);
    let head = g.act("head.in", u64::from(batch) * 16);
    g.ops.push(Op::Mul {
        name: "gmf".into(),
        a: View { t: emb, ld: 80, col: 0 },
        b: View { t: emb, ld: 80, col: 8 },
        y: View { t: head, ld: 16, col: 0 },
        rows: batch,
        cols: 8,
        act: Act::None,
    });
    let m1 = g.linear("mlp0", View { t: emb, ld: 80, col: 16 }, batch, 64, 32, Act::Relu, None);
    let m2 = g.linear("mlp1", m1, batch, 32, 16, Act::Relu, None);
    g.linear("mlp2", m2, batch, 16, 8, Act::Relu, Some(View { t: head, ld: 16, col: 8 }));
    g.output = g.linear("predict", View::dense(head, 16), batch, 16, 1, Act::Sigmoid, None).t;
    g
}
