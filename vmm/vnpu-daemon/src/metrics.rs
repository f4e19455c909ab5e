//! The daemon's Prometheus endpoint (`vnpu daemon --metrics ADDR`,
//! `docs/metrics.md`): `GET /metrics` over HTTP in the Prometheus text
//! format, per served vNPU instance and per physical core, named after
//! NVIDIA's DCGM exporter where a DCGM field has the same meaning
//! (`DCGM_FI_PROF_PIPE_TENSOR_ACTIVE` -> `VNPU_FI_PROF_SA_ACTIVE`, ...).
//! Values are read at scrape time from the vNPUs' telemetry and the
//! board runtime; nothing is kept here.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use npu_model::config::CoreConfig;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use thiserror::Error;
use vnpu_device::{SharingStats, TelemetrySnapshot, LATENCY_BOUNDS_S};
use vnpu_spec::Instance;

/// What the endpoint reads at each scrape. The daemon provides it; the
/// endpoint knows nothing else of the daemon.
pub trait BoardSource: Send + Sync {
    /// The configuration of the board's cores (for peak FLOPs).
    fn core_config(&self) -> CoreConfig;
    /// Every served instance, as it is now.
    fn served(&self) -> Vec<ServedSample>;
    /// Every physical core's sharing statistics, by core index.
    fn cores(&self) -> Vec<(usize, SharingStats)>;
}

/// One served instance at scrape time.
#[derive(Debug)]
pub struct ServedSample {
    pub instance: Instance,
    pub telemetry: TelemetrySnapshot,
    /// Whether a VMM is attached to it.
    pub attached: bool,
}

/// Why the metrics endpoint could not start.
#[derive(Debug, Error)]
pub enum MetricsError {
    #[error("metrics endpoint {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("metrics thread: {0}")]
    Thread(#[source] std::io::Error),
}

type Labels = Vec<(&'static str, String)>;

/// One instance's values at scrape time.
struct InstanceSample {
    labels: Labels,
    t: TelemetrySnapshot,
    attached: bool,
    /// Peak FLOPs per cycle of its configured SAs and VUs (all cores).
    peak_flops_per_cycle: f64,
}

/// Reads the board at each scrape.
struct BoardCollector {
    source: Weak<dyn BoardSource>,
}

impl std::fmt::Debug for BoardCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoardCollector").finish_non_exhaustive()
    }
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// Writes one metric family: `values` are (labels, value) pairs.
fn family(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    values: impl IntoIterator<Item = (Labels, f64)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in values {
        let e = m.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(e)?,
            _ => ConstGauge::new(v).encode(e)?,
        }
    }
    Ok(())
}

impl Collector for BoardCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(source) = self.source.upgrade() else { return Ok(()) };
        let samples = instance_samples(&source.core_config(), source.served());
        encode_instances(&mut enc, &samples)?;
        let cores: Vec<(Labels, SharingStats)> =
            source.cores().into_iter().map(|(i, s)| (vec![("core", i.to_string())], s)).collect();
        encode_cores(&mut enc, &cores)?;
        family(
            &mut enc,
            "vnpu_dma_mappings_lost",
            "Client memory mappings replaced after a SIGBUS (a hole punched in guest RAM), since the daemon started",
            MetricType::Counter,
            [(Labels::new(), crate::fault::lost_mappings() as f64)],
        )
    }
}

/// Labels and peak FLOPs of each served instance.
fn instance_samples(core_cfg: &CoreConfig, served: Vec<ServedSample>) -> Vec<InstanceSample> {
    let sa_peak = 2.0 * f64::from(core_cfg.sa_rows) * f64::from(core_cfg.sa_cols);
    let vu_peak = 2.0 * f64::from(core_cfg.vu_lanes);
    served
        .into_iter()
        .map(|s| {
            let i = &s.instance;
            let labels = vec![
                ("uuid", i.uuid.clone()),
                ("core", i.cores.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
                ("profile", i.type_name.clone().unwrap_or_else(|| "custom".into())),
            ];
            let t = s.telemetry;
            let shape = t.config.unwrap_or(i.shape);
            let cores = f64::from(shape.cores());
            let peak =
                cores * (f64::from(shape.sa_per_core()) * sa_peak + f64::from(shape.vu_per_core()) * vu_peak);
            InstanceSample { labels, t, attached: s.attached, peak_flops_per_cycle: peak }
        })
        .collect()
}

/// The per-instance families.
fn encode_instances(
    enc: &mut DescriptorEncoder<'_>,
    samples: &[InstanceSample],
) -> Result<(), std::fmt::Error> {
    let per = |f: &dyn Fn(&InstanceSample) -> f64| -> Vec<(Labels, f64)> {
        samples.iter().map(|s| (s.labels.clone(), f(s))).collect()
    };
    let engines = |s: &InstanceSample, per_core: fn(&vnpu_spec::VnpuSpec) -> u32| {
        let c = s.t.config.map_or(0.0, |c| f64::from(per_core(&c)) * f64::from(c.cores()));
        c * s.t.cycles
    };
    use MetricType::{Counter, Gauge};
    family(
            enc,
            "VNPU_FI_PROF_SA_ACTIVE",
            "Ratio of simulated cycles the vNPU's systolic arrays were active (as DCGM_FI_PROF_PIPE_TENSOR_ACTIVE), over its requests so far",
            Gauge,
            per(&|s| ratio(s.t.sa_active_cycles, engines(s, |c| c.sa_per_core()))),
        )?;
    family(
            enc,
            "VNPU_FI_PROF_VU_ACTIVE",
            "Ratio of simulated cycles the vNPU's vector units were active (as DCGM_FI_PROF_PIPE_FP32_ACTIVE), over its requests so far",
            Gauge,
            per(&|s| ratio(s.t.vu_active_cycles, engines(s, |c| c.vu_per_core()))),
        )?;
    family(
            enc,
            "VNPU_FI_PROF_DMA_ACTIVE",
            "Ratio of simulated cycles the vNPU's DMA engine (one per vNPU core) was active (as DCGM_FI_PROF_DRAM_ACTIVE), over its requests so far",
            Gauge,
            per(&|s| ratio(s.t.dma_active_cycles, engines(s, |_| 1))),
        )?;
    family(
        enc,
        "VNPU_FI_PROF_FLOPS_UTIL",
        "FLOPs done over the peak of the vNPU's configured SAs and VUs in its simulated cycles",
        Gauge,
        per(&|s| ratio(s.t.flops as f64, s.peak_flops_per_cycle * s.t.cycles)),
    )?;
    family(
        enc,
        "VNPU_FI_DEV_HBM_USED",
        "HBM bytes allocated to the vNPU's configuration (as DCGM_FI_DEV_FB_USED)",
        Gauge,
        per(&|s| s.t.config.map_or(0.0, |c| c.hbm_per_core() as f64 * f64::from(c.cores()))),
    )?;
    family(
        enc,
        "vnpu_attached",
        "1 while a VMM is attached to the instance",
        Gauge,
        per(&|s| f64::from(u8::from(s.attached))),
    )?;
    family(enc, "vnpu_requests", "Requests completed", Counter, per(&|s| s.t.requests as f64))?;
    family(
        enc,
        "vnpu_request_failures",
        "Requests that ended with an error status",
        Counter,
        per(&|s| s.t.failed as f64),
    )?;
    family(
        enc,
        "vnpu_verifier_rejections",
        "Programs the hypervisor's verifier refused",
        Counter,
        per(&|s| s.t.verifier_rejections as f64),
    )?;
    family(
        enc,
        "vnpu_busy_cycles",
        "Simulated cycles of the vNPU's requests",
        Counter,
        per(&|s| s.t.cycles),
    )?;
    family(enc, "vnpu_flops", "Floating-point operations done", Counter, per(&|s| s.t.flops as f64))?;
    {
        let mut m = enc.encode_descriptor(
            "vnpu_request_latency_seconds",
            "Wall time of a request in the device, from taking it off the ring to its completion",
            None,
            MetricType::Histogram,
        )?;
        for s in samples {
            // Per-bucket counts: the encoder accumulates them.
            let buckets: Vec<(f64, u64)> =
                s.t.latency_buckets
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (LATENCY_BOUNDS_S.get(i).copied().unwrap_or(f64::INFINITY), *n))
                    .collect();
            let mut e = m.encode_family(&s.labels)?;
            e.encode_histogram::<Labels>(s.t.latency_sum_s, s.t.requests, &buckets, None)?;
        }
    }
    Ok(())
}

/// The per-core families: the board runtime's sharing statistics.
fn encode_cores(
    enc: &mut DescriptorEncoder<'_>,
    cores: &[(Labels, SharingStats)],
) -> Result<(), std::fmt::Error> {
    use MetricType::Counter;
    let per_core = |f: &dyn Fn(&SharingStats) -> f64| -> Vec<(Labels, f64)> {
        cores.iter().map(|(l, s)| (l.clone(), f(s))).collect()
    };
    family(
        enc,
        "vnpu_core_requests",
        "Requests the physical core served",
        Counter,
        per_core(&|s| s.requests as f64),
    )?;
    family(
            enc,
            "vnpu_core_tenant_busy_cycles",
            "Simulated cycles of requests on the physical core, summed over its vNPUs (two vNPUs running at once count twice)",
            Counter,
            per_core(&|s| s.tenants.iter().fold(0.0, |a, t| a + t.1)),
        )?;
    family(
        enc,
        "vnpu_core_overlap_cycles",
        "Simulated cycles during which two or more vNPUs ran on the physical core at once",
        Counter,
        per_core(&|s| s.overlap_cycles),
    )?;
    family(
        enc,
        "vnpu_core_waits",
        "Requests that waited for engines (oversubscribed core)",
        Counter,
        per_core(&|s| s.waited as f64),
    )?;
    family(
        enc,
        "vnpu_core_preemptions",
        "Requests suspended for a more urgent one",
        Counter,
        per_core(&|s| s.preempted as f64),
    )?;
    family(
        enc,
        "vnpu_core_slo_requests",
        "Requests with a latency target",
        Counter,
        per_core(&|s| s.slo_requests as f64),
    )?;
    family(
        enc,
        "vnpu_core_slo_misses",
        "Requests that missed their latency target",
        Counter,
        per_core(&|s| s.slo_misses as f64),
    )?;
    // Harvesting, per core and tenant (a vNPU: its instance's UUID).
    let per_tenant = |f: &dyn Fn(&vnpu_device::Harvest) -> f64| -> Vec<(Labels, f64)> {
        let each = cores.iter().flat_map(|(l, s)| s.harvest.iter().map(move |(t, h)| (l, t, h)));
        each.map(|(l, t, h)| {
            let mut labels = l.clone();
            labels.push(("tenant", t.clone()));
            (labels, f(h))
        })
        .collect()
    };
    family(
        enc,
        "vnpu_core_borrowed_cycles",
        "Engine-cycles the tenant's spread programs ran on idle engines beyond its own",
        Counter,
        per_tenant(&|h| h.borrowed_cycles),
    )?;
    family(
        enc,
        "vnpu_core_lent_cycles",
        "Engine-cycles the tenant's own engines were lent to others while it had no request on the core",
        Counter,
        per_tenant(&|h| h.lent_cycles),
    )?;
    family(
        enc,
        "vnpu_core_reclaims",
        "The tenant's requests that waited for borrowers to give its engines back",
        Counter,
        per_tenant(&|h| h.reclaims as f64),
    )?;
    family(
        enc,
        "vnpu_core_reclaim_cycles",
        "Simulated cycles the tenant's requests waited for borrowers to give engines back",
        Counter,
        per_tenant(&|h| h.reclaim_cycles),
    )?;
    family(
        enc,
        "vnpu_board_time_cycles",
        "The board's simulated time (all cores share one timeline)",
        Counter,
        cores.first().map(|(_, s)| (Vec::new(), s.busy_cycles)),
    )?;
    Ok(())
}

/// The HTTP endpoint (`http.rs`: bounded connections, heads and time).
pub(crate) struct MetricsServer {
    server: crate::http::HttpServer,
    pub addr: SocketAddr,
}

impl MetricsServer {
    pub fn start(addr: SocketAddr, source: Arc<dyn BoardSource>) -> Result<Self, MetricsError> {
        let listener =
            std::net::TcpListener::bind(addr).map_err(|source| MetricsError::Bind { addr, source })?;
        let bound = listener.local_addr().unwrap_or(addr);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(BoardCollector { source: Arc::downgrade(&source) }));
        let registry = Arc::new(registry);
        let render: crate::http::Render = Arc::new(move || {
            let mut body = String::new();
            prometheus_client::encoding::text::encode(&mut body, &registry)
                .ok()
                .map(|()| (body, "application/openmetrics-text; version=1.0.0; charset=utf-8"))
        });
        let server = crate::http::HttpServer::start(listener, crate::http::HttpLimits::default(), render)
            .map_err(MetricsError::Thread)?;
        Ok(Self { server, addr: bound })
    }

    pub fn stop(&mut self) {
        self.server.stop();
    }
}
