//! The physical board: chips, cores, engines, memories and their speeds,
//! read from a TOML file (`docs/board-config.md`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// SRAM is handed out in slices of this size.
pub const SRAM_SLICE: u64 = 2 << 20;
/// HBM is handed out in slices of this size.
pub const HBM_SLICE: u64 = 256 << 20;

/// A bad board configuration.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read board config {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("board config: {0}")]
    Parse(#[source] toml::de::Error),
    #[error("board config: `{field}` {reason}")]
    Invalid { field: &'static str, reason: String },
}

/// Systolic array dataflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dataflow {
    /// Weights stay in the PEs; inputs stream through (TPU style).
    WeightStationary,
    /// Outputs stay in the PEs; inputs and weights stream through.
    OutputStationary,
}

/// How a weight-stationary array loads its weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WeightBuffering {
    /// One weight tile at a time: each fold loads its weights, then streams
    /// (SCALE-Sim's weight-stationary model).
    #[default]
    Single,
    /// A second weight buffer: the next fold's weights shift in while the
    /// current fold streams, as the TPU's MXU does ("one 64 KiB tile of
    /// weights plus one for double-buffering, to hide the 256 cycles it
    /// takes to shift a tile in", Jouppi et al., ISCA 2017, section 2).
    Double,
}

/// The whole board.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BoardConfig {
    pub name: String,
    pub chips: u32,
    pub cores_per_chip: u32,
    /// Core clock in MHz.
    pub clock_mhz: u32,
    pub core: CoreConfig,
    pub hbm: HbmConfig,
    pub dma: DmaConfig,
    /// How the tools lower a workload for this board unless told otherwise.
    #[serde(default)]
    pub lowering: LoweringConfig,
}

/// A number type of [`LoweringConfig`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NumType {
    #[default]
    F32,
    Bf16,
}

/// How the tools (`vnpu workload run` and `lower`, the evaluations) lower a
/// workload for this board unless their own flags say otherwise: the
/// conventions of the board's compiler. A TPU preset says what XLA does on
/// a TPU (bf16 data, residual adds fused into convolutions, buffers reused
/// by liveness); the built-in board's are all off, so the programs behind
/// every figure published on it stay the same.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoweringConfig {
    /// The SAs' operand type (`--dtype`).
    #[serde(default)]
    pub dtype: NumType,
    /// How intermediate activations are stored (`--activations`);
    /// default: as `dtype`. bf16 needs `dtype = "bf16"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations: Option<NumType>,
    /// Residual adds fused into convolutions (`--fuse-residual`).
    #[serde(default)]
    pub fuse_residual: bool,
    /// Intermediate tensors share HBM by liveness (`--reuse-hbm`).
    #[serde(default)]
    pub reuse_hbm: bool,
    /// A product's weights streamed within the operation: its first tiles
    /// start on the first columns while the rest load (`--stream-weights`).
    #[serde(default)]
    pub stream_weights: bool,
    /// Intermediate activations kept on chip between operations when they
    /// fit (`--keep-on-chip`).
    #[serde(default)]
    pub keep_on_chip: bool,
}

impl LoweringConfig {
    /// Whether intermediate activations are stored as bf16.
    pub fn bf16_activations(&self) -> bool {
        self.activations.unwrap_or(self.dtype) == NumType::Bf16
    }
}

/// One core: its engines and SRAM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoreConfig {
    pub sa_count: u32,
    pub sa_rows: u32,
    pub sa_cols: u32,
    pub dataflow: Dataflow,
    /// Weight buffering of a weight-stationary array (default: single).
    #[serde(default)]
    pub sa_weight_buffering: WeightBuffering,
    pub vu_count: u32,
    /// f32 elements a VU processes per cycle.
    pub vu_lanes: u32,
    /// Pipeline latency a VU instruction pays once, in cycles.
    pub vu_latency_cycles: u32,
    /// Cycles per element pass of a transcendental (exp, tanh, GELU, sigmoid).
    pub vu_transcendental_passes: u32,
    /// SRAM per core in MiB; a multiple of the 2 MiB slice.
    pub sram_mib: u32,
    /// DMA engines of the core, shared by every program on it: the
    /// transfers in flight of all co-located tenants share them by fair
    /// queuing (max-min), one engine's rate at most per transfer.
    #[serde(default = "one")]
    pub dma_engines: u32,
}

fn one() -> u32 {
    1
}

/// HBM of one chip, shared by its cores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HbmConfig {
    /// HBM per chip in GiB.
    pub size_gib: u32,
    pub channels: u32,
    /// Bandwidth of one channel in GB/s (1e9 bytes per second).
    pub channel_gbps: f64,
    pub latency_ns: u32,
    /// How co-located vNPUs share the bandwidth (performance isolation).
    #[serde(default)]
    pub partition: HbmPartition,
}

/// How the vNPUs on one core share HBM bandwidth.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HbmPartition {
    /// Max-min fair sharing of the whole bandwidth among the transfers in
    /// flight: a vNPU gets everything its neighbours leave unused.
    #[default]
    Shared,
    /// Each of the `n` vNPUs on the core owns `1/n` of the bandwidth (as
    /// if the channels were split), used or not: a vNPU's HBM time no
    /// longer depends on what its neighbours do.
    Equal,
}

/// The DMA engines of each core (how many: `core.dma_engines`) and the
/// board's host link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DmaConfig {
    /// Peak rate of one engine in GB/s (caps every transfer).
    pub gbps: f64,
    /// Host link (guest memory) bandwidth in GB/s: one link, shared by
    /// every transfer that touches guest memory.
    pub host_gbps: f64,
    /// Fixed cost of a DMA instruction in ns (descriptor + first beat).
    pub latency_ns: u32,
    /// Host link latency added to transfers touching guest memory, in ns.
    pub host_latency_ns: u32,
    /// Transfers one DMA stream of a program may have in flight at once
    /// (asynchronous copies): 1 (the default) runs them one after the
    /// other; with more, a stream issues the next transfer after the
    /// previous one's issue overhead, so memory latencies overlap. A
    /// transfer that touches bytes an earlier one in flight touches
    /// waits for it, and a `signal` or the stream's end waits for all.
    #[serde(default = "one")]
    pub in_flight: u32,
}

impl Default for BoardConfig {
    /// `tpu-v4-derived` (`docs/boards/tpu-v4-derived.toml`): one Cloud TPU
    /// v4 chip of two cores, each with four 128x128 MXUs (weights
    /// double-buffered) and its vector unit split into four VUs of 256
    /// lanes, 16 MiB VMEM, 32 GiB HBM at 1.2 TB/s per chip, lowered as XLA
    /// lowers for a TPU. Every value but the VU split is the `tpu-v4`
    /// preset's, from the sources named in its file; `presets::tests`
    /// holds this and the file equal.
    fn default() -> Self {
        Self {
            name: "tpu-v4-derived".into(),
            chips: 1,
            cores_per_chip: 2,
            clock_mhz: 1050,
            core: CoreConfig {
                sa_count: 4,
                sa_rows: 128,
                sa_cols: 128,
                dataflow: Dataflow::WeightStationary,
                sa_weight_buffering: WeightBuffering::Double,
                vu_count: 4,
                vu_lanes: 256,
                vu_latency_cycles: 16,
                vu_transcendental_passes: 4,
                sram_mib: 16,
                dma_engines: 1,
            },
            hbm: HbmConfig {
                size_gib: 32,
                channels: 1,
                channel_gbps: 1200.0,
                latency_ns: 300,
                partition: HbmPartition::Shared,
            },
            dma: DmaConfig {
                gbps: 600.0,
                host_gbps: 25.0,
                latency_ns: 100,
                host_latency_ns: 1000,
                in_flight: 1,
            },
            lowering: LoweringConfig {
                dtype: NumType::Bf16,
                activations: Some(NumType::Bf16),
                fuse_residual: true,
                reuse_hbm: true,
                stream_weights: true,
                keep_on_chip: true,
            },
        }
    }
}

impl BoardConfig {
    /// A board for tests of mechanisms that need more than the default
    /// board has: four cores on one chip whose HBM (1.2 TB/s) is less than
    /// their DMA engines ask for together (4 x 400 GB/s), four SAs and
    /// four 1024-lane VUs per core, 32 MiB SRAM, single-buffered weights,
    /// f32 lowering. Its values are round numbers chosen so that sharing
    /// shows, not a chip's: no evaluation and no figure in the docs runs
    /// on it (those run on the default board or the presets).
    pub fn test_board() -> Self {
        Self {
            name: "test-four-cores".into(),
            chips: 1,
            cores_per_chip: 4,
            clock_mhz: 940,
            core: CoreConfig {
                sa_count: 4,
                sa_rows: 128,
                sa_cols: 128,
                dataflow: Dataflow::WeightStationary,
                sa_weight_buffering: WeightBuffering::Single,
                vu_count: 4,
                vu_lanes: 1024,
                vu_latency_cycles: 16,
                vu_transcendental_passes: 4,
                sram_mib: 32,
                dma_engines: 1,
            },
            hbm: HbmConfig {
                size_gib: 32,
                channels: 16,
                channel_gbps: 75.0,
                latency_ns: 300,
                partition: HbmPartition::Shared,
            },
            dma: DmaConfig {
                gbps: 400.0,
                host_gbps: 25.0,
                latency_ns: 100,
                host_latency_ns: 1000,
                in_flight: 1,
            },
            lowering: LoweringConfig::default(),
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, reason: reason.into() }
}

fn range_u32(field: &'static str, v: u32, lo: u32, hi: u32) -> Result<(), ConfigError> {
    if v < lo || v > hi {
        return Err(invalid(field, format!("is {v}, must be in {lo}..={hi}")));
    }
    Ok(())
}

fn positive(field: &'static str, v: f64, hi: f64) -> Result<(), ConfigError> {
    if !(v.is_finite() && v > 0.0 && v <= hi) {
        return Err(invalid(field, format!("is {v}, must be > 0 and <= {hi}")));
    }
    Ok(())
}

impl BoardConfig {
    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let c: Self = toml::from_str(text).map_err(ConfigError::Parse)?;
        c.validate()?;
        Ok(c)
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        Self::from_toml(&text)
    }

    /// The configuration as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// Checks every field's range and the relations between fields.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.name.trim().is_empty() {
            return Err(invalid("name", "is empty"));
        }
        range_u32("chips", self.chips, 1, 1024)?;
        range_u32("cores_per_chip", self.cores_per_chip, 1, 256)?;
        range_u32("clock_mhz", self.clock_mhz, 1, 10_000)?;
        let c = &self.core;
        range_u32("core.sa_count", c.sa_count, 1, 64)?;
        range_u32("core.sa_rows", c.sa_rows, 1, 4096)?;
        range_u32("core.sa_cols", c.sa_cols, 1, 4096)?;
        range_u32("core.vu_count", c.vu_count, 1, 64)?;
        range_u32("core.vu_lanes", c.vu_lanes, 1, 1 << 16)?;
        range_u32("core.vu_latency_cycles", c.vu_latency_cycles, 0, 1 << 16)?;
        range_u32("core.vu_transcendental_passes", c.vu_transcendental_passes, 1, 64)?;
        range_u32("core.sram_mib", c.sram_mib, 2, 4096)?;
        range_u32("core.dma_engines", c.dma_engines, 1, 64)?;
        if u64::from(c.sram_mib) * (1 << 20) % SRAM_SLICE != 0 {
            return Err(invalid("core.sram_mib", format!("is {}, must be a multiple of 2", c.sram_mib)));
        }
        range_u32("hbm.size_gib", self.hbm.size_gib, 1, 1 << 14)?;
        range_u32("hbm.channels", self.hbm.channels, 1, 1024)?;
        range_u32("hbm.latency_ns", self.hbm.latency_ns, 0, 1_000_000)?;
        positive("hbm.channel_gbps", self.hbm.channel_gbps, 1e6)?;
        positive("dma.gbps", self.dma.gbps, 1e6)?;
        positive("dma.host_gbps", self.dma.host_gbps, 1e6)?;
        range_u32("dma.latency_ns", self.dma.latency_ns, 0, 1_000_000)?;
        range_u32("dma.host_latency_ns", self.dma.host_latency_ns, 0, 10_000_000)?;
        range_u32("dma.in_flight", self.dma.in_flight, 1, 64)?;
        if self.lowering.bf16_activations() && self.lowering.dtype != NumType::Bf16 {
            return Err(invalid("lowering.activations", "is bf16, which needs lowering.dtype = \"bf16\""));
        }
        Ok(())
    }

    /// SRAM per core in bytes.
    pub fn sram_bytes(&self) -> u64 {
        u64::from(self.core.sram_mib) << 20
    }

    /// HBM per chip in bytes.
    pub fn hbm_bytes_per_chip(&self) -> u64 {
        u64::from(self.hbm.size_gib) << 30
    }

    /// Bytes per core-clock cycle that the chip's HBM delivers in total.
    pub fn hbm_bytes_per_cycle(&self) -> f64 {
        self.hbm.channel_gbps * f64::from(self.hbm.channels) * 1e3 / f64::from(self.clock_mhz)
    }

    /// Converts nanoseconds to core cycles.
    pub fn ns_to_cycles(&self, ns: u32) -> f64 {
        f64::from(ns) * f64::from(self.clock_mhz) / 1e3
    }

    /// Converts GB/s to bytes per core cycle.
    pub fn gbps_to_bytes_per_cycle(&self, gbps: f64) -> f64 {
        gbps * 1e3 / f64::from(self.clock_mhz)
    }

    /// Peak FLOPs per cycle of one SA (a MAC is two FLOPs).
    pub fn sa_peak_flops_per_cycle(&self) -> f64 {
        2.0 * f64::from(self.core.sa_rows) * f64::from(self.core.sa_cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_round_trips_through_toml() {
        let d = BoardConfig::default();
        d.validate().unwrap();
        assert_eq!(BoardConfig::from_toml(&d.to_toml()).unwrap(), d);
    }

    #[test]
    fn bad_fields_are_named() {
        let text = BoardConfig::default().to_toml().replace("sa_rows = 128", "sa_rows = 0");
        let e = BoardConfig::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("core.sa_rows") && e.contains("must be in"), "{e}");

        let text = BoardConfig::default().to_toml().replace("sram_mib = 16", "sram_mib = 33");
        let e = BoardConfig::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("core.sram_mib") && e.contains("multiple of 2"), "{e}");

        let text = BoardConfig::default().to_toml().replace("channel_gbps = 1200.0", "channel_gbps = -1.0");
        let e = BoardConfig::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("hbm.channel_gbps"), "{e}");

        let text = BoardConfig::default().to_toml().replace("chips = 1", "chips = 1\nchipz = 2");
        let e = BoardConfig::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("chipz"), "{e}");

        let text = BoardConfig::default()
            .to_toml()
            .replace("dataflow = \"weight-stationary\"", "dataflow = \"diagonal\"");
        let e = BoardConfig::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains("diagonal"), "{e}");
    }
}
