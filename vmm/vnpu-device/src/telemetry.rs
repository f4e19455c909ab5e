//! What a vNPU did, for the board daemon's metrics (`docs/metrics.md`):
//! cumulative counters its worker adds to after every request, read by
//! whoever holds the same [`Telemetry`] (it outlives the worker, so a
//! served instance keeps its totals across the VMs that attach to it).

use std::sync::Mutex;

use crate::msi::lock;
use crate::VnpuSpec;

/// Upper bounds (seconds) of the request latency histogram's buckets; the
/// last bucket (above the last bound) is `+Inf`.
pub const LATENCY_BOUNDS_S: [f64; 12] =
    [10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 250e-3, 1.0];

/// The totals at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TelemetrySnapshot {
    /// Requests completed (any status).
    pub requests: u64,
    /// Requests that ended with a status other than OK.
    pub failed: u64,
    /// Programs the verifier refused (`ST_VERIFY_FAILED`).
    pub verifier_rejections: u64,
    /// Simulated cycles of the vNPU's requests (summed over requests).
    pub cycles: f64,
    /// Engine-active cycles, summed over the vNPU's engines of each kind.
    pub sa_active_cycles: f64,
    pub vu_active_cycles: f64,
    pub dma_active_cycles: f64,
    pub flops: u64,
    /// Requests per latency bucket (wall time in the device), not
    /// cumulative: `latency_buckets[i]` counts latencies at most
    /// `LATENCY_BOUNDS_S[i]` and above the bound before; the last counts
    /// the rest.
    pub latency_buckets: [u64; LATENCY_BOUNDS_S.len() + 1],
    pub latency_sum_s: f64,
    /// The configuration now (none before the guest configures).
    pub config: Option<VnpuSpec>,
}

/// Shared between a vNPU's worker (which records) and a reader.
#[derive(Debug, Default)]
pub struct Telemetry(Mutex<TelemetrySnapshot>);

impl Telemetry {
    /// The totals now.
    pub fn snapshot(&self) -> TelemetrySnapshot {
        lock(&self.0).clone()
    }

    pub(crate) fn configured(&self, config: Option<VnpuSpec>) {
        lock(&self.0).config = config;
    }

    /// One finished request: its status, wall time and, when it ran, its
    /// simulated report.
    pub(crate) fn request(&self, status: u32, wall_ns: u64, report: Option<&npu_model::TenantReport>) {
        let mut t = lock(&self.0);
        t.requests += 1;
        if status != vnpu_abi::device::ST_OK {
            t.failed += 1;
        }
        if status == vnpu_abi::device::ST_VERIFY_FAILED {
            t.verifier_rejections += 1;
        }
        let s = wall_ns as f64 * 1e-9;
        let bucket = LATENCY_BOUNDS_S.iter().position(|b| s <= *b).unwrap_or(LATENCY_BOUNDS_S.len());
        if let Some(b) = t.latency_buckets.get_mut(bucket) {
            *b += 1;
        }
        t.latency_sum_s += s;
        if let Some(r) = report {
            let tot = r.totals();
            t.cycles += r.cycles;
            t.sa_active_cycles += tot.sa_active_cycles;
            t.vu_active_cycles += tot.vu_active_cycles;
            t.dma_active_cycles += tot.dma_active_cycles;
            t.flops += tot.flops;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_land_in_their_buckets() {
        let t = Telemetry::default();
        t.request(vnpu_abi::device::ST_OK, 10_000, None); // exactly 10 us: first bucket
        t.request(vnpu_abi::device::ST_OK, 10_001, None); // just above: second
        t.request(vnpu_abi::device::ST_VERIFY_FAILED, 2_000_000_000, None); // 2 s: +Inf
        let s = t.snapshot();
        assert_eq!(s.latency_buckets[0], 1);
        assert_eq!(s.latency_buckets[1], 1);
        assert_eq!(s.latency_buckets[LATENCY_BOUNDS_S.len()], 1);
        assert_eq!((s.requests, s.failed, s.verifier_rejections), (3, 1, 1));
        assert!((s.latency_sum_s - 2.000_020_001).abs() < 1e-9, "{}", s.latency_sum_s);
    }
}
