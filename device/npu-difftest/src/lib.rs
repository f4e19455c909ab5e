//! Differential execution of one program: the model against the plain
//! reference interpreter.
//!
//! [`check`] verifies the program; a verified program then runs on the
//! model's event-driven core ([`npu_model::CoreSim`], functional and
//! timed, streams interleaved as the timing orders them), which reports
//! the order in which its instructions took effect. The order is checked
//! to be one the ISA allows (each stream in program order, every `wait`
//! after a matching `signal`), and replayed instruction by instruction on
//! the model's kernels and on [`npu_reference::Machine`]: every location
//! the reference says an instruction writes must hold the reference's
//! value within the ISA's tolerance, no other byte may change, and the
//! core's final memories must equal the replay's. A verified program
//! either completes and matches, or fails cleanly (a gather index past
//! its table, a cycle budget, a model limit) where the reference says it
//! should; anything else is a [`Mismatch`].

use npu_model::kernels::{execute, KernelError};
use npu_model::{
    verify, BoardConfig, CoreMemory, CoreSim, ExecError, LazyHbm, Memory, SimTenant, Sram, VecGuestMemory,
    VerifyError, VnpuLimits,
};
use npu_reference::{Machine, RefError};
use thiserror::Error;
use vnpu_abi::{Instr, Program, Space};

const ALL_SPACES: [Space; 3] = [Space::Sram, Space::Hbm, Space::Guest];

/// How a program that did not mismatch ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The verifier refused it (nothing ran).
    Rejected(VerifyError),
    /// Every instruction ran and matched the reference.
    Completed { instructions: usize },
    /// It failed cleanly, where and as the reference says it may; the
    /// instructions before matched.
    Failed(ExecError),
    /// An instruction is larger than the reference executes
    /// ([`npu_reference::MAX_WORK`]); the instructions before it matched.
    Skipped { compared: usize },
}

/// A disagreement between the model and the reference, or a verified
/// program doing what the verifier should have refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Mismatch {
    #[error("stream {stream} instruction {index} ({mnemonic}): {space} {addr:#x} holds {model}, reference says {expect}")]
    Value {
        stream: usize,
        index: usize,
        mnemonic: &'static str,
        space: &'static str,
        addr: u64,
        model: String,
        expect: String,
    },
    #[error(
        "stream {stream} instruction {index} ({mnemonic}): wrote {space} {addr:#x}, which it does not write"
    )]
    StrayWrite { stream: usize, index: usize, mnemonic: &'static str, space: &'static str, addr: u64 },
    #[error("stream {stream} instruction {index} ({mnemonic}) passed the verifier but the reference refuses it: {source}")]
    Unverified { stream: usize, index: usize, mnemonic: &'static str, source: RefError },
    #[error(
        "stream {stream} instruction {index} ({mnemonic}): model says {model:?}, reference says {reference}"
    )]
    Outcome {
        stream: usize,
        index: usize,
        mnemonic: &'static str,
        model: Option<KernelError>,
        reference: String,
    },
    #[error("the model applied stream {stream} instruction {index} out of the order the ISA allows: {why}")]
    Schedule { stream: usize, index: usize, why: &'static str },
    #[error("the core reported {model}, the replay expected {expected}")]
    Result { model: String, expected: String },
    #[error("{space} {addr:#x} changed, but no instruction writes it (an SA or VU instruction wrote outside SRAM)")]
    Unexplained { space: &'static str, addr: u64 },
    #[error("the core's final {space} differs from the replay's at {addr:#x}")]
    EndState { space: &'static str, addr: u64 },
}

/// The model's memories of one vNPU core.
struct ModelMemory {
    sram: Sram,
    hbm: LazyHbm,
    guest: VecGuestMemory,
}

impl ModelMemory {
    fn new(initial: &Machine) -> Self {
        let mut sram = Sram::new(initial.sram.len() as u64);
        sram.bytes_mut().copy_from_slice(&initial.sram);
        let mut hbm = LazyHbm::new(initial.hbm.len() as u64);
        // Only the non-zero 4 KiB pieces, so HBM stays lazily backed.
        for (i, chunk) in initial.hbm.chunks(4096).enumerate() {
            if chunk.iter().any(|b| *b != 0) {
                let _ = hbm.write(i as u64 * 4096, chunk);
            }
        }
        let (base, bytes) = initial.guest.first().map_or((0, &[][..]), |(b, v)| (*b, &v[..]));
        let mut guest = VecGuestMemory::new(base, bytes.len());
        let _ = guest.write(base, bytes);
        Self { sram, hbm, guest }
    }

    fn core(&mut self) -> CoreMemory<'_> {
        CoreMemory { sram: &mut self.sram, hbm: &mut self.hbm, guest: &mut self.guest }
    }

    fn space(&self, s: Space) -> &dyn Memory {
        match s {
            Space::Sram => &self.sram,
            Space::Hbm => &self.hbm,
            Space::Guest => &self.guest,
        }
    }

    /// The first address of `spaces` at which this memory and `m` differ.
    fn first_difference(&self, m: &Machine, spaces: &[Space]) -> Option<(&'static str, u64)> {
        for &space in spaces {
            let found = match space {
                Space::Sram => first_diff(self.sram.bytes(), &m.sram),
                Space::Hbm => {
                    let mut buf = vec![0u8; m.hbm.len()];
                    let _ = self.hbm.read(0, &mut buf);
                    first_diff(&buf, &m.hbm)
                }
                Space::Guest => m.guest.first().and_then(|(base, g)| {
                    let mut buf = vec![0u8; g.len()];
                    let _ = self.guest.read(*base, &mut buf);
                    first_diff(&buf, g).map(|i| base + i)
                }),
            };
            if let Some(addr) = found {
                return Some((space.name(), addr));
            }
        }
        None
    }

    fn to_machine(&self, like: &Machine) -> Machine {
        let mut m = like.clone();
        let _ = self.sram.read(0, &mut m.sram);
        let _ = self.hbm.read(0, &mut m.hbm);
        if let Some((base, g)) = m.guest.first_mut() {
            let _ = self.guest.read(*base, g);
        }
        m
    }
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<u64> {
    if a == b {
        return None;
    }
    a.iter().zip(b).position(|(x, y)| x != y).map(|i| i as u64)
}

/// A tenant of the model's core that records the order in which its
/// instructions take effect.
struct Recorder<'p> {
    program: &'p Program,
    memory: ModelMemory,
    max_cycles: Option<u64>,
    order: Vec<(usize, usize)>,
}

impl SimTenant for Recorder<'_> {
    fn program(&self) -> &Program {
        self.program
    }
    fn memory(&mut self) -> Option<CoreMemory<'_>> {
        Some(self.memory.core())
    }
    fn max_cycles(&self) -> Option<u64> {
        self.max_cycles
    }
    fn took_effect(&mut self, stream: usize, index: usize) {
        self.order.push((stream, index));
    }
}

/// Checks that `order` is an order the ISA allows for `program`; returns
/// each stream's next instruction and the semaphores after it.
fn replay_schedule(program: &Program, order: &[(usize, usize)]) -> Result<(Vec<usize>, Vec<u32>), Mismatch> {
    let mut pcs = vec![0usize; program.streams.len()];
    let mut sems = vec![0u32; usize::from(vnpu_abi::isa::NUM_SEMAPHORES)];
    for &(stream, index) in order {
        let bad = |why| Mismatch::Schedule { stream, index, why };
        let Some(pc) = pcs.get_mut(stream) else { return Err(bad("no such stream")) };
        if *pc != index {
            return Err(bad("not the stream's next instruction"));
        }
        match program.streams[stream].code.get(index) {
            None => return Err(bad("past the stream's end")),
            Some(Instr::Wait { sem }) => {
                let s = &mut sems[usize::from(*sem)];
                if *s == 0 {
                    return Err(bad("a wait passed a semaphore nobody signalled"));
                }
                *s -= 1;
            }
            Some(Instr::Signal { sem }) => {
                let s = &mut sems[usize::from(*sem)];
                *s = s.saturating_add(1);
            }
            Some(_) => {}
        }
        *pc += 1;
    }
    Ok((pcs, sems))
}

/// Runs `program` on the model and on the reference from the memories
/// `initial` (one guest range at most) and compares them; see the crate
/// documentation.
pub fn check(
    board: &BoardConfig,
    program: &Program,
    limits: &VnpuLimits,
    initial: &Machine,
    max_cycles: Option<u64>,
) -> Result<Outcome, Mismatch> {
    check_on(board, program, limits, initial, max_cycles, None)
}

/// As [`check`], a spread program running on `engines` (SAs, VUs; its
/// guarantee is `limits`' `sa` and `vu`) instead of every engine of the
/// core: the order its instructions take effect in depends on how many
/// engines it gets, and every such order must match the reference.
pub fn check_on(
    board: &BoardConfig,
    program: &Program,
    limits: &VnpuLimits,
    initial: &Machine,
    max_cycles: Option<u64>,
    engines: Option<[u32; 2]>,
) -> Result<Outcome, Mismatch> {
    if let Err(e) = verify(program, limits) {
        return Ok(Outcome::Rejected(e));
    }
    // The model's core, as a device runs it.
    let mut sim = CoreSim::new(board, 1);
    let recorder = Recorder { program, memory: ModelMemory::new(initial), max_cycles, order: Vec::new() };
    let id = sim.add(recorder, 0.0);
    if let Some(w) = engines {
        sim.set_engines(id, [limits.sa, limits.vu], w);
    }
    let (core, result) = loop {
        if let Some((_, job, result)) = sim.step().pop() {
            break (job, result);
        }
        if sim.is_idle() {
            return Err(Mismatch::Result { model: "nothing".into(), expected: "a result".into() });
        }
    };
    let (pcs, sems) = replay_schedule(program, &core.order)?;

    // The same order, one instruction at a time, on the model's kernels
    // and on the reference.
    let mut model = ModelMemory::new(initial);
    let mut reference = initial.clone();
    let mut failure = None;
    let mut compared = 0;
    for &(stream, index) in &core.order {
        let instr = program.streams[stream].code[index];
        if matches!(instr, Instr::Signal { .. } | Instr::Wait { .. } | Instr::Halt) {
            continue;
        }
        let mnemonic = instr.mnemonic();
        let expected = match reference.effects(&instr) {
            Ok(w) => Ok(w),
            Err(RefError::TooMuchWork) => return Ok(Outcome::Skipped { compared }),
            Err(e @ RefError::GatherIndex { .. }) => Err(e),
            Err(source) => return Err(Mismatch::Unverified { stream, index, mnemonic, source }),
        };
        let got = execute(&instr, &mut model.core());
        let writes = match (expected, got) {
            (Ok(w), Ok(())) => w,
            (
                Err(RefError::GatherIndex { position: p, .. }),
                Err(KernelError::GatherIndex { position: q, .. }),
            ) if p == q => {
                failure = Some((stream, index));
                break;
            }
            // A model limit on one instruction's size: a clean failure.
            (Ok(_), Err(KernelError::TooLarge(_))) => {
                failure = Some((stream, index));
                break;
            }
            (e, m) => {
                return Err(Mismatch::Outcome {
                    stream,
                    index,
                    mnemonic,
                    model: m.err(),
                    reference: match e {
                        Ok(_) => "success".into(),
                        Err(e) => e.to_string(),
                    },
                })
            }
        };
        for w in &writes {
            let space = w.space.name();
            let mut bytes = vec![0u8; w.bytes() as usize];
            let _ = model.space(w.space).read(w.addr, &mut bytes);
            if !w.matches(&bytes) {
                return Err(Mismatch::Value {
                    stream,
                    index,
                    mnemonic,
                    space,
                    addr: w.addr,
                    model: describe(&bytes),
                    expect: format!("{:?}", w.expect),
                });
            }
            // Take on the model's rounding so errors do not accumulate.
            let _ = reference.copy_from(w.space, w.addr, &bytes);
        }
        // Only DMA writes outside SRAM; the final comparison below covers
        // every space after the last instruction.
        let spaces: &[Space] = match instr {
            Instr::DmaCopy { .. } | Instr::DmaGather { .. } => &ALL_SPACES,
            _ => &[Space::Sram],
        };
        if let Some((space, addr)) = model.first_difference(&reference, spaces) {
            return Err(Mismatch::StrayWrite { stream, index, mnemonic, space, addr });
        }
        compared += 1;
    }

    // The core's report must be the one the replay leads to.
    let outcome = match (&result, failure) {
        (Err(e @ ExecError::Kernel { stream, index, .. }), Some(f)) if (*stream, *index) == f => {
            Outcome::Failed(e.clone())
        }
        (Ok(_), None) => {
            let all = program.streams.iter().zip(&pcs).all(|(s, pc)| *pc == s.code.len());
            if !all {
                return Err(Mismatch::Result {
                    model: "completion".into(),
                    expected: "instructions left".into(),
                });
            }
            Outcome::Completed { instructions: core.order.len() }
        }
        (Err(e @ (ExecError::Budget { .. } | ExecError::HostWork { .. })), None) => {
            Outcome::Failed(e.clone())
        }
        (Err(e @ ExecError::Deadlock { .. }), None) => {
            // Every unfinished stream must wait on a zero semaphore.
            let stuck = program.streams.iter().zip(&pcs).all(|(s, &pc)| match s.code.get(pc) {
                None => true,
                Some(Instr::Wait { sem }) => sems[usize::from(*sem)] == 0,
                Some(_) => false,
            });
            if !stuck {
                return Err(Mismatch::Result { model: e.to_string(), expected: "progress".into() });
            }
            Outcome::Failed(e.clone())
        }
        (r, f) => {
            return Err(Mismatch::Result {
                model: format!("{r:?}"),
                expected: match f {
                    Some((s, i)) => format!("a kernel failure at stream {s} instruction {i}"),
                    None => "no kernel failure".into(),
                },
            })
        }
    };
    // Nothing was written that the reference did not write (SA and VU
    // instructions were checked in SRAM only, above) ...
    if failure.is_none() {
        if let Some((space, addr)) = model.first_difference(&reference, &ALL_SPACES) {
            return Err(Mismatch::Unexplained { space, addr });
        }
    }
    // ... and the core ended where the replay did.
    let end = core.memory.to_machine(initial);
    if let Some((space, addr)) = model.first_difference(&end, &ALL_SPACES) {
        return Err(Mismatch::EndState { space, addr });
    }
    Ok(outcome)
}

fn describe(bytes: &[u8]) -> String {
    match *bytes {
        [a, b, c, d] => {
            format!("{} ({:#010x})", f32::from_le_bytes([a, b, c, d]), u32::from_le_bytes([a, b, c, d]))
        }
        _ => format!("{bytes:?}"),
    }
}
