//! What the vNPU did, per core and engine: the counters the mailbox
//! reports to the guest.

use super::*;

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct EngineTotals {
    active: f64,
    stall: f64,
    instructions: u64,
    flops: u64,
    bytes: u64,
}

/// The vNPU's performance counters (`MBOX_READ_COUNTERS`).
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) requests: u64,
    pub(super) failed: u64,
    cycles: f64,
    flops: u64,
    bytes: u64,
    pub(super) wall_ns: u64,
    /// Keyed by (core, kind code, index).
    engines: BTreeMap<(u32, u8, u8), EngineTotals>,
}

pub(super) fn kind_code(k: EngineKind) -> u8 {
    match k {
        EngineKind::Dma => 0,
        EngineKind::Sa => 1,
        EngineKind::Vu => 2,
    }
}

impl Counters {
    pub(super) fn add(&mut self, core: u32, r: &TenantReport) {
        self.cycles += r.cycles;
        for e in &r.engines {
            let t = self.engines.entry((core, kind_code(e.engine.kind), e.engine.index)).or_default();
            t.active += e.active_cycles;
            t.stall += e.stall_cycles;
            t.instructions += e.instructions;
            t.flops += e.flops;
            t.bytes += e.bytes;
            self.flops += e.flops;
            self.bytes += e.bytes;
        }
    }

    /// The counter block for a vNPU of `spec` (layout: `vnpu_abi::device`).
    pub(super) fn block(&self, spec: Option<&VnpuSpec>) -> Vec<u8> {
        let mut engines = Vec::new();
        if let Some(s) = spec {
            for core in 0..s.cores() {
                // At most 64 engines of a kind (VnpuSpec's limit).
                let index = |i: u32| u8::try_from(i).unwrap_or(u8::MAX);
                let sa = (0..s.sa_per_core()).map(|i| (1u8, index(i)));
                let vu = (0..s.vu_per_core()).map(|i| (2u8, index(i)));
                for (kind, index) in sa.chain(vu).chain([(0u8, 0u8)]) {
                    let t = self.engines.get(&(core, kind, index)).copied().unwrap_or_default();
                    engines.push((core, kind, index, t));
                }
            }
        }
        let mut b =
            Vec::with_capacity(abi::COUNTERS_HEADER_BYTES + engines.len() * abi::COUNTERS_ENGINE_BYTES);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&u32::try_from(engines.len()).unwrap_or(u32::MAX).to_le_bytes());
        for w in
            [self.requests, self.failed, crate::count(self.cycles), self.flops, self.bytes, self.wall_ns, 0]
        {
            b.extend_from_slice(&w.to_le_bytes());
        }
        for (core, kind, index, t) in engines {
            b.extend_from_slice(&[kind, 0]);
            b.extend_from_slice(&u16::from(index).to_le_bytes());
            b.extend_from_slice(&core.to_le_bytes());
            for w in [crate::count(t.active), crate::count(t.stall), t.instructions, t.flops, t.bytes] {
                b.extend_from_slice(&w.to_le_bytes());
            }
        }
        b
    }
}
