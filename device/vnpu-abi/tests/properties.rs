//! Property tests: the encoding round-trips and the decoders are total.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use vnpu_abi::isa::NUM_SEMAPHORES;
use vnpu_abi::*;

fn space() -> impl Strategy<Value = Space> {
    prop_oneof![Just(Space::Sram), Just(Space::Hbm), Just(Space::Guest)]
}
fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::Bf16)]
}
fn addr() -> impl Strategy<Value = Addr> {
    (space(), any::<u64>()).prop_map(|(space, offset)| Addr { space, offset })
}
fn flags(allow_t: bool) -> impl Strategy<Value = MatFlags> {
    (any::<bool>(), any::<bool>())
        .prop_map(move |(accumulate, t)| MatFlags { accumulate, transpose_b: t && allow_t })
}
fn finite() -> impl Strategy<Value = f32> {
    any::<f32>().prop_filter("finite", |v| v.is_finite())
}
fn pick<T: Copy + std::fmt::Debug + 'static>(all: &'static [T]) -> impl Strategy<Value = T> {
    proptest::sample::select(all)
}

fn instr() -> impl Strategy<Value = Instr> {
    prop_oneof![
        (addr(), addr(), any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
            |(src, dst, rows, row_bytes, src_stride, dst_stride)| {
                Instr::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride }
            }
        ),
        (addr(), any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(table, indices, dst, count, row_bytes, table_rows)| {
                Instr::DmaGather { table, indices, dst, count, row_bytes, table_rows }
            }
        ),
        (dtype(), flags(true), any::<[u64; 3]>(), any::<[u32; 6]>()).prop_map(|(dtype, flags, p, d)| {
            Instr::MatMul {
                dtype,
                flags,
                a: p[0],
                b: p[1],
                c: p[2],
                m: d[0],
                k: d[1],
                n: d[2],
                lda: d[3],
                ldb: d[4],
                ldc: d[5],
            }
        }),
        (dtype(), flags(false), any::<[u64; 3]>(), any::<[u32; 5]>(), any::<[u16; 8]>()).prop_map(
            |(dtype, flags, p, d, s)| Instr::Conv2d {
                dtype,
                flags,
                input: p[0],
                weights: p[1],
                output: p[2],
                geom: ConvGeom {
                    n: d[0],
                    h: d[1],
                    w: d[2],
                    cin: d[3],
                    cout: d[4],
                    kh: s[0],
                    kw: s[1],
                    stride_h: s[2],
                    stride_w: s[7],
                    pad_top: s[3],
                    pad_bottom: s[4],
                    pad_left: s[5],
                    pad_right: s[6],
                },
            }
        ),
        (pick(BinOp::ALL), pick(Bcast::ALL), any::<[u64; 3]>(), any::<u32>(), any::<u32>()).prop_map(
            |(op, bcast, p, rows, cols)| Instr::VBinary {
                op,
                bcast,
                a: p[0],
                b: p[1],
                dst: p[2],
                rows,
                cols
            }
        ),
        (pick(UnOp::ALL), any::<u64>(), any::<u64>(), any::<u32>())
            .prop_map(|(op, src, dst, len)| Instr::VUnary { op, src, dst, len }),
        (any::<u64>(), any::<u64>(), any::<u32>(), finite(), finite())
            .prop_map(|(src, dst, len, scale, bias)| Instr::VAffine { src, dst, len, scale, bias }),
        (any::<u64>(), any::<u64>(), any::<u32>(), finite(), finite()).prop_map(|(src, dst, len, a, b)| {
            Instr::VClamp { src, dst, len, lo: a.min(b), hi: a.max(b) }
        }),
        (any::<[u64; 3]>(), any::<u32>(), any::<u32>(), finite()).prop_map(|(p, rows, cols, eps)| {
            Instr::VRmsNorm { src: p[0], dst: p[1], gamma: p[2], rows, cols, eps }
        }),
        (pick(RedOp::ALL), any::<u64>(), any::<u64>(), any::<[u32; 3]>()).prop_map(|(op, src, dst, d)| {
            Instr::VReduce { op, src, dst, outer: d[0], reduce: d[1], inner: d[2] }
        }),
        (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>())
            .prop_map(|(src, dst, rows, cols)| Instr::VSoftmax { src, dst, rows, cols }),
        (any::<[u64; 4]>(), any::<u32>(), any::<u32>(), finite()).prop_map(|(p, rows, cols, eps)| {
            Instr::VLayerNorm { src: p[0], dst: p[1], gamma: p[2], beta: p[3], rows, cols, eps }
        }),
        (pick(PoolOp::ALL), any::<u64>(), any::<u64>(), any::<[u32; 4]>(), any::<[u16; 4]>()).prop_map(
            |(op, src, dst, d, s)| Instr::VPool {
                op,
                src,
                dst,
                geom: PoolGeom {
                    n: d[0],
                    h: d[1],
                    w: d[2],
                    c: d[3],
                    kh: s[0],
                    kw: s[1],
                    stride: s[2],
                    pad: s[3]
                },
            }
        ),
        (any::<[u64; 3]>(), any::<[u32; 4]>(), any::<[u16; 8]>()).prop_map(|(p, d, s)| Instr::VDepthwise {
            src: p[0],
            weights: p[1],
            dst: p[2],
            geom: ConvGeom {
                n: d[0],
                h: d[1],
                w: d[2],
                cin: d[3],
                cout: d[3],
                kh: s[0],
                kw: s[1],
                stride_h: s[2],
                stride_w: s[7],
                pad_top: s[3],
                pad_bottom: s[4],
                pad_left: s[5],
                pad_right: s[6],
            },
        }),
        (dtype(), dtype(), any::<u64>(), any::<u64>(), any::<u32>())
            .prop_map(|(from, to, src, dst, len)| Instr::VConvert { from, to, src, dst, len }),
        (0..NUM_SEMAPHORES).prop_map(|sem| Instr::Signal { sem }),
        (0..NUM_SEMAPHORES).prop_map(|sem| Instr::Wait { sem }),
        Just(Instr::Halt),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn instruction_round_trips(i in instr()) {
        let mut bytes = Vec::new();
        i.encode_into(&mut bytes);
        prop_assert_eq!(bytes.len(), i.encoded_len());
        let (d, used) = Instr::decode(&bytes).unwrap();
        prop_assert_eq!(d, i);
        prop_assert_eq!(used, bytes.len());
        // Every strict prefix is a truncation error, never a panic.
        for cut in 0..bytes.len() {
            let is_truncated = matches!(Instr::decode(&bytes[..cut]), Err(DecodeError::Truncated { .. }));
            prop_assert!(is_truncated);
        }
    }

    #[test]
    fn decode_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
        if let Ok((i, used)) = Instr::decode(&bytes) {
            prop_assert!(used <= bytes.len());
            // What decodes re-encodes to the same bytes.
            let mut again = Vec::new();
            i.encode_into(&mut again);
            prop_assert_eq!(&again[..], &bytes[..used]);
            let _ = i.footprint();
        }
    }

    #[test]
    fn program_decode_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Program::decode(&bytes);
        // Also with a valid header in front, to reach deeper paths.
        let mut v = b"VNPU\x01\x00\x01\x00\x00\x00\x00\x00".to_vec();
        v.extend_from_slice(&((bytes.len().saturating_sub(8)) as u32).to_le_bytes());
        v.extend_from_slice(&bytes);
        let _ = Program::decode(&v);
    }

    #[test]
    fn program_round_trips(instrs in proptest::collection::vec(instr(), 0..40), engines in proptest::collection::vec(0u8..6, 40), spread in any::<bool>()) {
        let mut b = ProgramBuilder::new();
        for (i, e) in instrs.iter().zip(engines) {
            let engine = match i.engine_kind() {
                Some(EngineKind::Dma) => Engine::DMA,
                Some(EngineKind::Sa) => Engine::sa(e % 3),
                Some(EngineKind::Vu) => Engine::vu(e % 3),
                None if matches!(i, Instr::Halt) => continue,
                None => Engine::vu(e),
            };
            b.push(engine, *i);
        }
        if b.is_empty() {
            b.push(Engine::DMA, Instr::Halt);
        }
        if spread {
            b.spread();
        }
        let p = b.finish();
        let bytes = p.encode();
        prop_assert_eq!(p.encoded_len(), bytes.len());
        prop_assert_eq!(Program::decode(&bytes).unwrap(), p);
    }

    #[test]
    fn footprints_are_overflow_safe(i in instr()) {
        if let Ok(f) = i.footprint() {
            for a in f.iter() {
                prop_assert!(a.start.checked_add(a.len).is_some());
            }
        }
    }
}

#[test]
fn container_errors_are_specific() {
    let mut b = ProgramBuilder::new();
    b.push(Engine::sa(0), Instr::Wait { sem: 1 });
    let good = b.finish().encode();
    assert!(Program::decode(&good).is_ok());

    let mut bad = good.clone();
    bad[0] = b'X';
    assert_eq!(Program::decode(&bad), Err(ProgramError::BadMagic));
    let mut bad = good.clone();
    bad[4] = 9;
    assert_eq!(Program::decode(&bad), Err(ProgramError::BadVersion(9)));
    // Version 1 has no flags; version 2 has the spread flag and only it.
    let mut bad = good.clone();
    bad[8] = 1;
    assert_eq!(Program::decode(&bad), Err(ProgramError::BadFlags(1)));
    let mut spread = good.clone();
    spread[4] = 2;
    assert_eq!(Program::decode(&spread), Err(ProgramError::BadFlags(0)));
    spread[8] = 1;
    assert!(Program::decode(&spread).unwrap().spread);
    spread[8] = 3;
    assert_eq!(Program::decode(&spread), Err(ProgramError::BadFlags(3)));
    // A program that is not spread encodes as version 1, as before.
    assert_eq!(good[4..6], [1, 0]);
    assert!(matches!(Program::decode(&good[..good.len() - 1]), Err(ProgramError::LengthMismatch { .. })));

    // A VU instruction in an SA stream is refused with its position.
    let mut p = Program::decode(&good).unwrap();
    p.streams[0].code.insert(0, Instr::VSoftmax { src: 0, dst: 0, rows: 1, cols: 1 });
    let err = Program::decode(&p.encode()).unwrap_err();
    assert!(matches!(err, ProgramError::WrongEngine { stream: 0, index: 0, .. }), "{err}");

    // Code after halt is refused.
    let mut p = Program::decode(&good).unwrap();
    p.streams[0].code.push(Instr::Signal { sem: 0 });
    assert!(matches!(Program::decode(&p.encode()), Err(ProgramError::AfterHalt { stream: 0, index: 2 })));

    // Semaphore ids beyond the limit do not decode.
    assert!(matches!(
        Instr::decode(&[vnpu_abi::isa::opcode::WAIT, NUM_SEMAPHORES]),
        Err(DecodeError::BadField { field: "sem", .. })
    ));
}

#[test]
fn footprint_of_strided_dma_is_its_bounding_range() {
    let i = Instr::DmaCopy {
        src: Addr::hbm(100),
        dst: Addr::sram(0),
        rows: 3,
        row_bytes: 16,
        src_stride: 64,
        dst_stride: 16,
    };
    let f: Vec<_> = i.footprint().unwrap().iter().copied().collect();
    assert_eq!(f[0], Access { space: Space::Hbm, start: 100, len: 2 * 64 + 16, kind: AccessKind::Read });
    assert_eq!(f[1], Access { space: Space::Sram, start: 0, len: 48, kind: AccessKind::Write });
    let over = Instr::DmaCopy {
        src: Addr::hbm(u64::MAX - 8),
        dst: Addr::sram(0),
        rows: 1,
        row_bytes: 16,
        src_stride: 0,
        dst_stride: 0,
    };
    assert_eq!(over.footprint().unwrap_err(), FootprintError::Overflow { operand: "src" });
    // Source stride 0: one row read 5 times (a broadcast); any other
    // stride below the row is refused, for the destination 0 too.
    let bcast = Instr::DmaCopy {
        src: Addr::hbm(100),
        dst: Addr::hbm(4096),
        rows: 5,
        row_bytes: 16,
        src_stride: 0,
        dst_stride: 16,
    };
    let f: Vec<_> = bcast.footprint().unwrap().iter().copied().collect();
    assert_eq!(f[0], Access { space: Space::Hbm, start: 100, len: 16, kind: AccessKind::Read });
    assert_eq!(f[1], Access { space: Space::Hbm, start: 4096, len: 80, kind: AccessKind::Write });
    let copy = |src_stride, dst_stride| Instr::DmaCopy {
        src: Addr::hbm(100),
        dst: Addr::hbm(4096),
        rows: 5,
        row_bytes: 16,
        src_stride,
        dst_stride,
    };
    assert_eq!(copy(8, 16).footprint().unwrap_err(), FootprintError::BadStride { operand: "src" });
    assert_eq!(copy(16, 0).footprint().unwrap_err(), FootprintError::BadStride { operand: "dst" });
    let lda_small = Instr::MatMul {
        dtype: DType::F32,
        flags: MatFlags::default(),
        a: 0,
        b: 0,
        c: 0,
        m: 2,
        k: 8,
        n: 2,
        lda: 4,
        ldb: 2,
        ldc: 2,
    };
    assert_eq!(lda_small.footprint().unwrap_err(), FootprintError::BadStride { operand: "a" });
}

/// A program of more than `MAX_INSTRUCTIONS` tiny instructions (within the
/// byte limit) is refused by the decoder itself, before its decoded form
/// (several times the encoded size) is built.
#[test]
fn decoding_stops_at_the_instruction_limit() {
    use vnpu_abi::program::MAX_INSTRUCTIONS;
    let mut b = ProgramBuilder::new();
    for i in 0..=MAX_INSTRUCTIONS {
        b.push(Engine::DMA, Instr::Signal { sem: (i % 64) as u8 });
    }
    let bytes = b.finish().encode();
    assert!(bytes.len() <= vnpu_abi::program::MAX_PROGRAM_BYTES);
    assert_eq!(Program::decode(&bytes), Err(ProgramError::TooManyInstructions));
    // Exactly the limit decodes (the builder ends the stream with a halt).
    let mut b = ProgramBuilder::new();
    for i in 0..MAX_INSTRUCTIONS - 1 {
        b.push(Engine::DMA, Instr::Signal { sem: (i % 64) as u8 });
    }
    assert_eq!(Program::decode(&b.finish().encode()).map(|p| p.instruction_count()), Ok(MAX_INSTRUCTIONS));
}
