//! Cycle cost of each instruction, from the engine parameters.
//!
//! - SA, weight-stationary (the SCALE-Sim model): the GEMM view is
//!   `M x K` inputs times `K x N` weights. The array holds an `R x C` block
//!   of weights per fold; there are `ceil(K/R) * ceil(N/C)` folds, and each
//!   costs `R` cycles to load weights, `M` cycles to stream inputs, `C - 1`
//!   to drain and `R - 1` of skew: `2R + C + M - 2`. The last fold's final
//!   cycle overlaps the next instruction, so the total is one less.
//!   Output-stationary swaps the roles of `M` and `K`.
//! - VU: `passes * ceil(elements / lanes) + latency`, where `passes` is the
//!   number of element passes the operation needs (1 for add, more for
//!   transcendentals, softmax and layer norm).
//! - DMA: an issue overhead, the memory's first-byte latency (HBM or host
//!   link) unless the engine was already streaming (back-to-back
//!   descriptors pipeline), then bytes at a rate capped by the DMA engine
//!   (or the host link for guest memory); transfers touching HBM also share
//!   the chip's HBM bandwidth with every other such transfer in flight.

use vnpu_abi::{Instr, Space, UnOp};

use crate::config::{BoardConfig, Dataflow, WeightBuffering};

/// How an instruction occupies its engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Occupancy {
    /// Busy for a fixed number of cycles.
    Fixed(f64),
    /// A transfer: `latency` cycles of issue overhead, `first_byte` cycles of
    /// memory latency (hidden when the engine was streaming right up to
    /// this instruction: back-to-back descriptors pipeline), then `bytes`
    /// at up to `cap` bytes per cycle (its rate alone on the core); while
    /// in flight it shares the core's DMA engines with every other
    /// transfer on the core, and the core's HBM bandwidth (`hbm`) and the
    /// host link (`host`: it touches guest memory) with the transfers that
    /// use them.
    Transfer { latency: f64, first_byte: f64, bytes: f64, cap: f64, hbm: bool, host: bool },
    /// Synchronisation: no engine time.
    Sync,
}

/// Cost of one instruction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    pub occupancy: Occupancy,
    /// Floating-point operations (a multiply-add is two).
    pub flops: u64,
    /// Bytes moved by DMA.
    pub bytes: u64,
}

/// Saturating product: costs of absurd (but verifier-accepted, because
/// zero-sized) operands stay finite instead of overflowing.
fn prod(dims: &[u64]) -> u64 {
    dims.iter().fold(1u64, |a, d| a.saturating_mul(*d))
}

/// Cycles of a GEMM view `m x k x n` on one `rows x cols` array.
///
/// Single-buffered weights (SCALE-Sim): every fold pays its weight load
/// (`R`), skew (`R - 1`) and drain (`C - 1`) before the next starts:
/// `folds * (2R + C - 2 + stream) - 1`. Double-buffered weights (the
/// TPU's MXU, weight-stationary only): the next fold's weights shift in
/// while the current fold streams, so after the first load each fold
/// takes `max(stream, R)` and the skew and drain are paid once at the end:
/// `R + folds * max(stream, R) + R + C - 2 - 1`. With one fold and a
/// stream of at least `R` both give the same.
pub fn sa_gemm_cycles(cfg: &BoardConfig, m: u64, k: u64, n: u64) -> f64 {
    if m == 0 || k == 0 || n == 0 {
        return 1.0;
    }
    let (r, c) = (u64::from(cfg.core.sa_rows), u64::from(cfg.core.sa_cols));
    let (folds, stream) = match cfg.core.dataflow {
        Dataflow::WeightStationary => (prod(&[k.div_ceil(r), n.div_ceil(c)]), m),
        Dataflow::OutputStationary => (prod(&[m.div_ceil(r), n.div_ceil(c)]), k),
    };
    let double = cfg.core.dataflow == Dataflow::WeightStationary
        && cfg.core.sa_weight_buffering == WeightBuffering::Double;
    if double {
        (2 * r + c - 2) as f64 + (folds as f64) * (stream.max(r) as f64) - 1.0
    } else {
        (folds as f64) * ((2 * r + c - 2) as f64 + stream as f64) - 1.0
    }
}

fn vu(cfg: &BoardConfig, elements: u64, passes: f64) -> Occupancy {
    let vecs = elements.div_ceil(u64::from(cfg.core.vu_lanes)) as f64;
    Occupancy::Fixed(passes * vecs.max(1.0) + f64::from(cfg.core.vu_latency_cycles))
}

fn transfer(cfg: &BoardConfig, a: Space, b: Space, bytes: u64) -> Occupancy {
    let host = a == Space::Guest || b == Space::Guest;
    let latency = cfg.ns_to_cycles(cfg.dma.latency_ns);
    let mut first_byte = 0.0;
    let mut cap = cfg.gbps_to_bytes_per_cycle(cfg.dma.gbps);
    if host {
        first_byte += cfg.ns_to_cycles(cfg.dma.host_latency_ns);
        cap = cap.min(cfg.gbps_to_bytes_per_cycle(cfg.dma.host_gbps));
    }
    let hbm = a == Space::Hbm || b == Space::Hbm;
    if hbm {
        first_byte += cfg.ns_to_cycles(cfg.hbm.latency_ns);
    }
    Occupancy::Transfer { latency, first_byte, bytes: bytes as f64, cap, hbm, host }
}

/// The cost of `instr` on a core of `cfg`.
pub fn cost(cfg: &BoardConfig, instr: &Instr) -> Cost {
    let trans = f64::from(cfg.core.vu_transcendental_passes);
    let mut flops = 0u64;
    let mut bytes = 0u64;
    let occupancy = match *instr {
        Instr::DmaCopy { src, dst, rows, row_bytes, .. } => {
            bytes = prod(&[rows.into(), row_bytes.into()]);
            transfer(cfg, src.space, dst.space, bytes)
        }
        Instr::DmaGather { table, count, row_bytes, .. } => {
            // Each row is a separate burst, rounded up to 64-byte beats,
            // plus the indices themselves.
            bytes = prod(&[count.into(), row_bytes.into()]);
            let beats = prod(&[count.into(), u64::from(row_bytes).div_ceil(64), 64])
                .saturating_add(4 * u64::from(count));
            transfer(cfg, table.space, Space::Sram, beats)
        }
        Instr::MatMul { m, k, n, .. } => {
            let (m, k, n) = (u64::from(m), u64::from(k), u64::from(n));
            flops = prod(&[2, m, k, n]);
            Occupancy::Fixed(sa_gemm_cycles(cfg, m, k, n))
        }
        Instr::Conv2d { geom: g, .. } => {
            let (ho, wo) = g.out_hw().unwrap_or((0, 0));
            let m = prod(&[g.n.into(), ho.into(), wo.into()]);
            let k = prod(&[g.kh.into(), g.kw.into(), g.cin.into()]);
            let n = u64::from(g.cout);
            flops = prod(&[2, m, k, n]);
            Occupancy::Fixed(sa_gemm_cycles(cfg, m, k, n))
        }
        Instr::VBinary { rows, cols, .. } => {
            let e = prod(&[rows.into(), cols.into()]);
            flops = e;
            vu(cfg, e, 1.0)
        }
        Instr::VUnary { op, len, .. } => {
            let e = u64::from(len);
            let passes = match op {
                UnOp::Copy
                | UnOp::Relu
                | UnOp::Neg
                | UnOp::Abs
                | UnOp::Floor
                | UnOp::Ceil
                | UnOp::I32ToF32
                | UnOp::F32ToI32 => 1.0,
                UnOp::Recip | UnOp::Sqrt => 2.0,
                UnOp::Exp | UnOp::Tanh | UnOp::Sigmoid | UnOp::Log | UnOp::Sin | UnOp::Cos => trans,
                UnOp::Erf => trans + 1.0,
                UnOp::Gelu | UnOp::GeluErf => trans + 3.0,
            };
            flops = prod(&[e, passes as u64]);
            vu(cfg, e, passes)
        }
        Instr::VAffine { len, .. } | Instr::VClamp { len, .. } => {
            flops = 2 * u64::from(len);
            vu(cfg, len.into(), 1.0)
        }
        Instr::VReduce { outer, reduce, inner, .. } => {
            // SIMD runs along the contiguous axis: across `inner` when it is
            // there (one vector per (outer, reduce) pair and lane group),
            // else along each row being reduced.
            let (o, r, i) = (u64::from(outer), u64::from(reduce), u64::from(inner));
            flops = prod(&[o, r, i]);
            let lanes = u64::from(cfg.core.vu_lanes);
            let vectors =
                if i == 1 { prod(&[o, r.div_ceil(lanes)]) } else { prod(&[o, r, i.div_ceil(lanes)]) };
            Occupancy::Fixed(vectors.max(1) as f64 + f64::from(cfg.core.vu_latency_cycles))
        }
        Instr::VSoftmax { rows, cols, .. } => {
            // max, subtract + exp, sum, scale.
            let e = prod(&[rows.into(), cols.into()]);
            flops = prod(&[e, 5]);
            vu(cfg, e, 3.0 + trans)
        }
        Instr::VLayerNorm { rows, cols, .. } => {
            // mean, variance (2), normalize (2), scale + shift (2).
            let e = prod(&[rows.into(), cols.into()]);
            flops = prod(&[e, 7]);
            vu(cfg, e, 7.0)
        }
        Instr::VRmsNorm { rows, cols, .. } => {
            // mean of squares (2), normalize (1), scale (1).
            let e = prod(&[rows.into(), cols.into()]);
            flops = prod(&[e, 4]);
            vu(cfg, e, 4.0)
        }
        Instr::VPool { geom: g, .. } => {
            let (ho, wo) = g.out_hw().unwrap_or((0, 0));
            let out = prod(&[g.n.into(), ho.into(), wo.into(), g.c.into()]);
            let win = prod(&[g.kh.into(), g.kw.into()]);
            flops = prod(&[out, win]);
            vu(cfg, flops, 1.0)
        }
        Instr::VConvert { len, .. } => vu(cfg, len.into(), 1.0),
        Instr::VDepthwise { geom: g, .. } => {
            // One multiply-add pass over the output per kernel tap.
            let (ho, wo) = g.out_hw().unwrap_or((0, 0));
            let out = prod(&[g.n.into(), ho.into(), wo.into(), g.cout.into()]);
            let taps = prod(&[g.kh.into(), g.kw.into()]);
            flops = prod(&[2, out, taps]);
            vu(cfg, out, taps as f64)
        }
        Instr::Signal { .. } | Instr::Wait { .. } | Instr::Halt => Occupancy::Sync,
    };
    Cost { occupancy, flops, bytes }
}

/// Host work the functional model spends on `instr`, in units calibrated
/// to about one nanosecond of one host core at most (`docs/isolation.md`
/// has the measurement): a VU element costs [`VU_ELEMENT_UNITS`] (a
/// transcendental one [`TRANSCENDENTAL_UNITS`]), a window step or reduced
/// element 2, a DMA four bytes a unit, and [`MACS_PER_UNIT`] SA
/// multiply-adds a unit (the GEMM crate is that much faster per
/// operation). Counted against a request's host-work budget before the
/// instruction runs, so a verified request cannot hold a shared core's
/// thread for longer than its budget. Saturating, like the cycle costs.
pub fn host_work(instr: &Instr) -> u64 {
    let unary = |op: UnOp| match op {
        UnOp::Gelu
        | UnOp::GeluErf
        | UnOp::Erf
        | UnOp::Exp
        | UnOp::Tanh
        | UnOp::Sigmoid
        | UnOp::Log
        | UnOp::Sin
        | UnOp::Cos => TRANSCENDENTAL_UNITS,
        _ => VU_ELEMENT_UNITS,
    };
    let window = |n: u32, ho: u32, wo: u32, c: u32, kh: u32, kw: u32| {
        prod(&[n.into(), ho.into(), wo.into(), c.into(), kh.into(), kw.into(), 2])
    };
    let v = VU_ELEMENT_UNITS;
    match *instr {
        Instr::DmaCopy { rows, row_bytes, .. } => prod(&[rows.into(), row_bytes.into()]) / 4,
        Instr::DmaGather { count, row_bytes, .. } => {
            prod(&[count.into(), row_bytes.into()]) / 4 + u64::from(count)
        }
        Instr::MatMul { m, k, n, .. } => {
            let (m, k, n) = (u64::from(m), u64::from(k), u64::from(n));
            (prod(&[m, k, n]) / MACS_PER_UNIT).saturating_add(prod(&[m, n, v]))
        }
        Instr::Conv2d { geom: g, .. } => {
            let (ho, wo) = g.out_hw().unwrap_or((0, 0));
            let macs = prod(&[
                g.n.into(),
                ho.into(),
                wo.into(),
                g.cout.into(),
                g.kh.into(),
                g.kw.into(),
                g.cin.into(),
            ]);
            (macs / MACS_PER_UNIT).saturating_add(prod(&[g.n.into(), ho.into(), wo.into(), g.cout.into(), v]))
        }
        Instr::VUnary { op, len, .. } => prod(&[len.into(), unary(op)]),
        Instr::VAffine { len, .. } | Instr::VClamp { len, .. } | Instr::VConvert { len, .. } => {
            prod(&[len.into(), v])
        }
        Instr::VBinary { rows, cols, .. } => prod(&[rows.into(), cols.into(), v]),
        Instr::VReduce { outer, reduce, inner, .. } => prod(&[outer.into(), reduce.into(), inner.into(), 2]),
        Instr::VSoftmax { rows, cols, .. } => prod(&[rows.into(), cols.into(), TRANSCENDENTAL_UNITS]),
        Instr::VLayerNorm { rows, cols, .. } | Instr::VRmsNorm { rows, cols, .. } => {
            prod(&[rows.into(), cols.into(), v])
        }
        Instr::VPool { geom: g, .. } => {
            let (ho, wo) = g.out_hw().unwrap_or((0, 0));
            window(g.n, ho, wo, g.c, g.kh.into(), g.kw.into())
        }
        Instr::VDepthwise { geom: g, .. } => {
            let (ho, wo) = g.out_hw().unwrap_or((0, 0));
            window(g.n, ho, wo, g.cout, g.kh.into(), g.kw.into())
        }
        Instr::Signal { .. } | Instr::Wait { .. } | Instr::Halt => 0,
    }
}

/// Host-work units of one VU element (read, operate, write back).
pub const VU_ELEMENT_UNITS: u64 = 4;
/// Host-work units of one transcendental element (exp, GELU, tanh,
/// sigmoid, and softmax's exp).
pub const TRANSCENDENTAL_UNITS: u64 = 8;
/// SA multiply-adds per host-work unit.
pub const MACS_PER_UNIT: u64 = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// SCALE-Sim's array: weight-stationary, one weight tile at a time.
    fn cfg(r: u32, c: u32) -> BoardConfig {
        let mut b = BoardConfig::default();
        b.core.dataflow = Dataflow::WeightStationary;
        b.core.sa_weight_buffering = WeightBuffering::Single;
        b.core.sa_rows = r;
        b.core.sa_cols = c;
        b
    }

    #[test]
    fn ws_matches_scale_sim_reference_points() {
        // Reference values produced by SCALE-Sim v3 (scripts/scalesim_run.py).
        assert_eq!(sa_gemm_cycles(&cfg(32, 32), 64, 32, 32), 157.0);
        assert_eq!(sa_gemm_cycles(&cfg(32, 32), 100, 70, 40), 1163.0);
        // 16x16x8 input, 3x3x40 filters, valid: M = 14*14, K = 72, N = 40.
        assert_eq!(sa_gemm_cycles(&cfg(32, 32), 196, 72, 40), 1739.0);
    }

    /// Double-buffered weights, by hand: the first tile's load, one
    /// `max(M, R)` per fold, skew and drain once.
    #[test]
    fn double_buffered_weights_hide_each_later_load_behind_a_stream() {
        let mut b = cfg(32, 32);
        b.core.sa_weight_buffering = WeightBuffering::Double;
        // One fold with M >= R: nothing to hide, as single-buffered.
        assert_eq!(sa_gemm_cycles(&b, 64, 32, 32), 157.0);
        // 3 x 2 = 6 folds of 100 rows: 32 + 6 * 100 + 31 + 31 - 1.
        assert_eq!(sa_gemm_cycles(&b, 100, 70, 40), 693.0);
        // Streams shorter than a weight load: each fold waits for its tile.
        assert_eq!(sa_gemm_cycles(&b, 16, 64, 32), 32.0 + 2.0 * 32.0 + 62.0 - 1.0);
        // Output-stationary arrays have no weight tile to buffer.
        b.core.dataflow = Dataflow::OutputStationary;
        assert_eq!(sa_gemm_cycles(&b, 100, 70, 40), sa_gemm_cycles(&cfg_os(32, 32), 100, 70, 40));
    }

    fn cfg_os(r: u32, c: u32) -> BoardConfig {
        let mut b = cfg(r, c);
        b.core.dataflow = Dataflow::OutputStationary;
        b
    }
}
