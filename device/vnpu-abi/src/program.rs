//! The program container: a header, a stream table and one instruction
//! stream per engine. Nothing executable lives anywhere else.
//!
//! ```text
//! offset size field
//! 0      4    magic "VNPU"
//! 4      2    version (1, or 2 for a program with flags)
//! 6      2    stream_count (1..=MAX_STREAMS)
//! 8      4    flags (version 1: 0; version 2: FLAG_SPREAD, nothing else)
//! 12     4    code_bytes: total length of all streams' code
//! 16     8*S  stream table: kind u8, index u8, reserved u16 (0), code_len u32
//! ..     ..   code of stream 0, stream 1, ... back to back
//! ```

use alloc::vec::Vec;
use core::fmt;

use crate::isa::{DecodeError, Engine, EngineKind, Instr};

/// `"VNPU"`.
pub const MAGIC: [u8; 4] = *b"VNPU";
/// The container version of a program without flags: what every program
/// was before spreading, written byte for byte as it always was.
pub const VERSION: u16 = 1;
/// The container version of a program with flags ([`FLAG_SPREAD`]); a
/// reader of version 1 only refuses it (`BadVersion`).
pub const VERSION_FLAGS: u16 = 2;
/// Header flag (version 2): the program's SA and VU streams are logical,
/// not bound to physical engines. The core runs them on as many physical
/// engines as it grants the tenant at the moment (its guarantee, plus idle
/// engines it lends), each engine taking a ready stream at instruction
/// boundaries; stream indices are bounded by the vNPU's guarantee plus its
/// borrowing cap instead of its guarantee (`docs/isa.md`, "Spread
/// programs").
pub const FLAG_SPREAD: u32 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 16;
/// Stream table entry length in bytes.
pub const STREAM_ENTRY_LEN: usize = 8;
/// Most streams a program may have.
pub const MAX_STREAMS: usize = 64;
/// Largest encoded program accepted, in bytes.
pub const MAX_PROGRAM_BYTES: usize = 64 << 20;
/// Most instructions a program may hold (all streams together). The
/// decoder stops at the first one past it, so the decoded form of any
/// input stays within this many instructions (64 MiB: an `Instr` is 64
/// bytes; a stream's vector may hold up to twice its length while it is
/// decoded), whatever the encoded size.
pub const MAX_INSTRUCTIONS: usize = 1 << 20;
// The memory bounds above and in `docs/isolation.md` count 64 bytes an
// instruction: a change of `Instr`'s size must revisit them.
const _: () = assert!(core::mem::size_of::<Instr>() == 64);

/// One engine's instruction stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Stream {
    pub engine: Engine,
    pub code: Vec<Instr>,
}

/// A decoded program.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Program {
    pub streams: Vec<Stream>,
    /// Its SA and VU streams are logical ([`FLAG_SPREAD`]).
    pub spread: bool,
}

/// Why a byte sequence is not a valid program container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProgramError {
    TooShort { len: usize },
    TooLarge { len: usize },
    BadMagic,
    BadVersion(u16),
    BadFlags(u32),
    BadStreamCount(u16),
    BadEngineKind { stream: usize, kind: u8 },
    ReservedNonZero { stream: usize },
    DuplicateEngine { stream: usize, engine: Engine },
    LengthMismatch { declared: u64, actual: usize },
    Decode { stream: usize, index: usize, error: DecodeError },
    WrongEngine { stream: usize, index: usize, mnemonic: &'static str, engine: Engine },
    AfterHalt { stream: usize, index: usize },
    TooManyInstructions,
}

impl fmt::Display for ProgramError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort { len } => {
                write!(f, "program of {len} bytes is shorter than its header")
            }
            Self::TooLarge { len } => {
                write!(f, "program of {len} bytes exceeds the limit of {MAX_PROGRAM_BYTES} bytes")
            }
            Self::BadMagic => write!(f, "bad magic (expected \"VNPU\")"),
            Self::BadVersion(v) => {
                write!(f, "unsupported container version {v} (expected {VERSION} or {VERSION_FLAGS})")
            }
            Self::BadFlags(v) => {
                write!(f, "header flags 0x{v:x}: version {VERSION} has none, {VERSION_FLAGS} only 0x{FLAG_SPREAD:x}")
            }
            Self::BadStreamCount(n) => {
                write!(f, "stream count {n} outside 1..={MAX_STREAMS}")
            }
            Self::BadEngineKind { stream, kind } => {
                write!(f, "stream {stream}: unknown engine kind {kind}")
            }
            Self::ReservedNonZero { stream } => {
                write!(f, "stream {stream}: reserved field not zero")
            }
            Self::DuplicateEngine { stream, engine } => {
                write!(f, "stream {stream}: engine {engine} already has a stream")
            }
            Self::LengthMismatch { declared, actual } => {
                write!(f, "code length {declared} does not match the {actual} bytes present")
            }
            Self::Decode { stream, index, error } => {
                write!(f, "stream {stream} instruction {index}: {error}")
            }
            Self::WrongEngine { stream, index, mnemonic, engine } => {
                write!(f, "stream {stream} instruction {index}: {mnemonic} cannot run on engine {engine}")
            }
            Self::TooManyInstructions => {
                write!(f, "program has more than {MAX_INSTRUCTIONS} instructions")
            }
            Self::AfterHalt { stream, index } => {
                write!(f, "stream {stream} instruction {index}: instruction after halt")
            }
        }
    }
}

impl core::error::Error for ProgramError {}

pub(crate) fn le_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        a.copy_from_slice(s);
    }
    u16::from_le_bytes(a)
}

pub(crate) fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}

pub(crate) fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from(le_u32(b, at)) | u64::from(le_u32(b, at + 4)) << 32
}

impl Program {
    /// Number of instructions over all streams.
    pub fn instruction_count(&self) -> usize {
        self.streams.iter().map(|s| s.code.len()).sum()
    }

    /// The stream of `engine`, if the program has one.
    pub fn stream(&self, engine: Engine) -> Option<&Stream> {
        self.streams.iter().find(|s| s.engine == engine)
    }

    /// Length of [`Program::encode`]'s container, without encoding it.
    pub fn encoded_len(&self) -> usize {
        let code: usize = self.streams.iter().flat_map(|s| &s.code).map(Instr::encoded_len).sum();
        HEADER_LEN + STREAM_ENTRY_LEN * self.streams.len() + code
    }

    /// Encodes the program as a container.
    pub fn encode(&self) -> Vec<u8> {
        let codes: Vec<Vec<u8>> = self
            .streams
            .iter()
            .map(|s| {
                let mut v = Vec::new();
                for i in &s.code {
                    i.encode_into(&mut v);
                }
                v
            })
            .collect();
        let total: usize = codes.iter().map(Vec::len).sum();
        let mut out = Vec::with_capacity(HEADER_LEN + STREAM_ENTRY_LEN * codes.len() + total);
        let (version, flags) = if self.spread { (VERSION_FLAGS, FLAG_SPREAD) } else { (VERSION, 0) };
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&(self.streams.len() as u16).to_le_bytes());
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&(total as u32).to_le_bytes());
        for (s, c) in self.streams.iter().zip(&codes) {
            out.push(s.engine.kind as u8);
            out.push(s.engine.index);
            out.extend_from_slice(&0u16.to_le_bytes());
            out.extend_from_slice(&(c.len() as u32).to_le_bytes());
        }
        for c in codes {
            out.extend_from_slice(&c);
        }
        out
    }

    /// Decodes and structurally validates a container: header, stream
    /// table, every instruction, and that each instruction runs on the
    /// kind of engine its stream belongs to. Engine indices and address
    /// ranges are checked later against a concrete vNPU (the verifier).
    pub fn decode(bytes: &[u8]) -> Result<Self, ProgramError> {
        if bytes.len() > MAX_PROGRAM_BYTES {
            return Err(ProgramError::TooLarge { len: bytes.len() });
        }
        if bytes.len() < HEADER_LEN {
            return Err(ProgramError::TooShort { len: bytes.len() });
        }
        if bytes[..4] != MAGIC {
            return Err(ProgramError::BadMagic);
        }
        let version = le_u16(bytes, 4);
        if version != VERSION && version != VERSION_FLAGS {
            return Err(ProgramError::BadVersion(version));
        }
        let count = le_u16(bytes, 6);
        if count == 0 || usize::from(count) > MAX_STREAMS {
            return Err(ProgramError::BadStreamCount(count));
        }
        let flags = le_u32(bytes, 8);
        // Version 1 has no flags; version 2 has at least one (a program
        // without flags is written as version 1: one encoding each).
        let known = if version == VERSION { 0 } else { FLAG_SPREAD };
        if flags & !known != 0 || (version == VERSION_FLAGS && flags == 0) {
            return Err(ProgramError::BadFlags(flags));
        }
        let declared = u64::from(le_u32(bytes, 12));
        let table_end = HEADER_LEN + STREAM_ENTRY_LEN * usize::from(count);
        if bytes.len() < table_end {
            return Err(ProgramError::TooShort { len: bytes.len() });
        }
        let code_present = bytes.len() - table_end;
        if declared != code_present as u64 {
            return Err(ProgramError::LengthMismatch { declared, actual: code_present });
        }
        let mut entries: Vec<(Engine, usize)> = Vec::with_capacity(count.into());
        let mut sum: u64 = 0;
        for s in 0..usize::from(count) {
            let at = HEADER_LEN + STREAM_ENTRY_LEN * s;
            let kind = EngineKind::from_byte(bytes[at])
                .ok_or(ProgramError::BadEngineKind { stream: s, kind: bytes[at] })?;
            let engine = Engine { kind, index: bytes[at + 1] };
            if le_u16(bytes, at + 2) != 0 {
                return Err(ProgramError::ReservedNonZero { stream: s });
            }
            if entries.iter().any(|(e, _)| *e == engine) {
                return Err(ProgramError::DuplicateEngine { stream: s, engine });
            }
            let len = le_u32(bytes, at + 4);
            sum += u64::from(len);
            entries.push((engine, len as usize));
        }
        if sum != declared {
            return Err(ProgramError::LengthMismatch { declared, actual: sum as usize });
        }
        let mut streams = Vec::with_capacity(entries.len());
        let mut at = table_end;
        let mut total = 0usize;
        for (s, (engine, len)) in entries.into_iter().enumerate() {
            let code = &bytes[at..at + len];
            at += len;
            let mut instrs = Vec::new();
            let mut off = 0;
            let mut halted = false;
            while off < code.len() {
                let index = instrs.len();
                if halted {
                    return Err(ProgramError::AfterHalt { stream: s, index });
                }
                let (i, used) = Instr::decode(&code[off..]).map_err(|error| ProgramError::Decode {
                    stream: s,
                    index,
                    error,
                })?;
                if let Some(k) = i.engine_kind() {
                    if k != engine.kind {
                        return Err(ProgramError::WrongEngine {
                            stream: s,
                            index,
                            mnemonic: i.mnemonic(),
                            engine,
                        });
                    }
                }
                halted = matches!(i, Instr::Halt);
                // Checked before the push: no input makes the decoded form
                // grow past the limit the verifier enforces anyway.
                total += 1;
                if total > MAX_INSTRUCTIONS {
                    return Err(ProgramError::TooManyInstructions);
                }
                instrs.push(i);
                off += used;
            }
            // Kept at its length: the decoded form is 64 bytes an instruction.
            instrs.shrink_to_fit();
            streams.push(Stream { engine, code: instrs });
        }
        Ok(Self { streams, spread: flags & FLAG_SPREAD != 0 })
    }

    /// Its SA and VU stream counts (logical engines if it is spread).
    pub fn compute_streams(&self) -> (u32, u32) {
        let count = |k: EngineKind| self.streams.iter().filter(|s| s.engine.kind == k).count() as u32;
        (count(EngineKind::Sa), count(EngineKind::Vu))
    }
}

/// Builds a program stream by stream.
///
/// ```
/// use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder};
/// let mut b = ProgramBuilder::new();
/// b.push(Engine::DMA, Instr::DmaCopy {
///     src: Addr::guest(0x1000), dst: Addr::sram(0), rows: 1, row_bytes: 64,
///     src_stride: 0, dst_stride: 0 });
/// b.push(Engine::DMA, Instr::Signal { sem: 0 });
/// b.push(Engine::vu(0), Instr::Wait { sem: 0 });
/// let program = b.finish();
/// let bytes = program.encode();
/// assert_eq!(vnpu_abi::Program::decode(&bytes).unwrap(), program);
/// ```
#[derive(Debug, Default, Clone)]
pub struct ProgramBuilder {
    program: Program,
}

impl ProgramBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `instr` to the stream of `engine`, creating the stream the
    /// first time an engine is named.
    pub fn push(&mut self, engine: Engine, instr: Instr) -> &mut Self {
        match self.program.streams.iter_mut().find(|s| s.engine == engine) {
            Some(s) => s.code.push(instr),
            None => self.program.streams.push(Stream { engine, code: alloc::vec![instr] }),
        }
        self
    }

    /// Makes `engine` signal semaphore `sem` and `waiter` wait for it.
    pub fn sync(&mut self, engine: Engine, waiter: Engine, sem: u8) -> &mut Self {
        self.push(engine, Instr::Signal { sem });
        self.push(waiter, Instr::Wait { sem })
    }

    /// Marks the program spread ([`FLAG_SPREAD`]): its SA and VU streams
    /// are logical engines.
    pub fn spread(&mut self) -> &mut Self {
        self.program.spread = true;
        self
    }

    /// Number of instructions pushed so far.
    pub fn len(&self) -> usize {
        self.program.instruction_count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every stream with `halt` and returns the program, streams
    /// sorted by engine (DMA, SAs, VUs).
    pub fn finish(mut self) -> Program {
        for s in &mut self.program.streams {
            if s.code.last() != Some(&Instr::Halt) {
                s.code.push(Instr::Halt);
            }
        }
        self.program.streams.sort_by_key(|s| s.engine);
        self.program
    }
}
