//! Boots the bare-metal test guests on /dev/kvm.
//!
//! Needs /dev/kvm and the guests built by `scripts/build-guests.sh` (which
//! `scripts/test.sh` runs first). Without either, these tests fail loudly
//! rather than pass vacuously.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_digits_agree_with_the_cpu, guest, Console, MSIX_TEST_PASSES};
use vnpu_spec::VnpuSpec;
use vnpu_vm::{Vm, VmConfig, VmError};

#[test]
fn hello_guest_prints_and_exits_with_its_code() {
    let console = Console::default();
    let mut vm = Vm::new(&VmConfig::new(16 << 20, guest("hello")), console.clone()).unwrap();
    assert_eq!(vm.run().unwrap(), 42);
    assert_eq!(String::from_utf8_lossy(&console.0.lock().unwrap()), "hello from the guest\n");
}

/// Console input: bytes given to `forward_input` reach the guest's UART
/// receive buffer, in order, none lost (more than the 64-byte FIFO holds).
#[test]
fn console_input_reaches_the_guest_uart() {
    let console = Console::default();
    let vm = Vm::new(&VmConfig::new(16 << 20, guest("echo")), console.clone()).unwrap();
    let line = format!("{}\n", "the quick brown fox jumps over the lazy dog ".repeat(3));
    vm.forward_input(std::io::Cursor::new(line.clone().into_bytes())).unwrap();
    let mut vm = vm;
    assert_eq!(vm.run().unwrap() as usize, line.len() - 1);
    assert_eq!(String::from_utf8_lossy(&console.0.lock().unwrap()), format!("echo: {line}"));
}

#[test]
fn bad_guests_and_sizes_are_clear_errors() {
    let g = guest("hello");
    let e = Vm::new(&VmConfig::new(1 << 20, &g), Console::default()).unwrap_err();
    assert!(matches!(e, VmError::Memory { .. }), "{e}");
    let e = Vm::new(&VmConfig::new(16 << 20, "/nonexistent/guest"), Console::default()).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/guest"), "{e}");
    // Not an ELF: this test file itself.
    let e = Vm::new(&VmConfig::new(16 << 20, file!()), Console::default());
    let e = e.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("cannot") || e.contains("ELF"), "{e}");
}

#[test]
fn guest_enumerates_pci_through_conf1_and_ecam_and_finds_the_vnpu() {
    let console = Console::default();
    let small = VnpuSpec::named("small").unwrap();
    let custom = VnpuSpec::parse("sa=3,vu=2,sram=8M,hbm=512M,cores=2").unwrap();
    let mut vm =
        Vm::new(&VmConfig::new(16 << 20, guest("pci-enum")).vnpus(&[small, custom]), console.clone())
            .unwrap();
    let code = vm.run().unwrap();
    let out = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out,
        "00:00.0 5650:0000 class 060000\n\
         00:01.0 5650:0001 class 120000\n\
         00:02.0 5650:0001 class 120000\n\
         vnpu bar0 size 00004000 64-bit\n\
         vnpu msix vectors 0008\n\
         vnpu 00:01.0 abi 00010002 chips 01 cores 01 sa 01 vu 01 sram 0000000000400000 hbm 0000000040000000 array 0080 lanes 0100\n\
         vnpu 00:02.0 abi 00010002 chips 01 cores 02 sa 03 vu 02 sram 0000000000800000 hbm 0000000020000000 array 0080 lanes 0100\n"
    );
    // The guest left BAR 0 of each vNPU where it placed it.
    assert_eq!(vm.pci().function(1).unwrap().config().bar_address(0), Some(0xc001_0000));
    assert_eq!(vm.pci().function(2).unwrap().config().bar_address(0), Some(0xc002_0000));
}

#[test]
fn guest_receives_msix_with_masking_and_pending_bits() {
    let console = Console::default();
    let small = VnpuSpec::named("small").unwrap();
    let mut vm =
        Vm::new(&VmConfig::new(16 << 20, guest("msix-test")).vnpus(&[small]), console.clone()).unwrap();
    let code = vm.run().unwrap();
    let out = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
    assert_eq!(code, 0, "{out}");
    assert_eq!(out, MSIX_TEST_PASSES);
}

#[test]
fn user_mode_guest_measures_the_ring_round_trip() {
    let console = Console::default();
    let small = VnpuSpec::named("small").unwrap();
    let mut vm =
        Vm::new(&VmConfig::new(64 << 20, guest("ring-bench")).vnpus(&[small]), console.clone()).unwrap();
    let code = vm.run().unwrap();
    let out = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
    assert_eq!(code, 0, "{out}");
    for line in ["raw ioeventfd write", "raw ioeventfd->irqfd MSI", "vNPU nop, polled", "vNPU nop, interrupt"]
    {
        assert!(out.contains(line), "{line} missing from:\n{out}");
    }
}

/// The digits guest classifies the whole held-out split on the vNPU, one
/// image at a time and as a batch, and on its CPU: every prediction agrees
/// and the accuracies are those of the training script.
#[test]
fn digits_guest_classifies_on_the_vnpu_like_the_cpu() {
    let console = Console::default();
    let small = VnpuSpec::named("small").unwrap();
    let mut vm = Vm::new(&VmConfig::new(64 << 20, guest("digits")).vnpus(&[small]), console.clone()).unwrap();
    let code = vm.run().unwrap();
    let out = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("latency per image (batch 1):"), "{out}");
    assert!(out.contains("SA active"), "{out}");
    assert_digits_agree_with_the_cpu(&out);
}

/// A vNPU too small for the guest's SRAM plan: a clear message, exit 1.
#[test]
fn digits_guest_refuses_a_vnpu_without_enough_sram() {
    let console = Console::default();
    let tiny = VnpuSpec::parse("sa=1,vu=1,sram=2M,hbm=256M").unwrap();
    let mut vm = Vm::new(&VmConfig::new(64 << 20, guest("digits")).vnpus(&[tiny]), console.clone()).unwrap();
    assert_eq!(vm.run().unwrap(), 1);
    let out = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
    assert!(out.contains("this guest needs"), "{out}");
}

fn run_user_guest(name: &str) -> (u32, String) {
    let console = Console::default();
    let small = VnpuSpec::named("small").unwrap();
    let mut vm = Vm::new(&VmConfig::new(64 << 20, guest(name)).vnpus(&[small]), console.clone()).unwrap();
    let code = vm.run().unwrap();
    let out = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
    (code, out)
}

/// 60 random GEMM and convolution cases (f32 and bf16) through the ring,
/// each checked in the guest against its CPU.
#[test]
fn selfcheck_guest_matches_its_cpu_on_random_shapes() {
    let (code, out) = run_user_guest("selfcheck");
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("selfcheck: 60/60 cases match the CPU"), "{out}");
}

/// A Transformer encoder layer on the vNPU against the guest's CPU.
#[test]
fn transformer_guest_matches_its_cpu() {
    let (code, out) = run_user_guest("transformer");
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains("max abs error vs CPU") && l.ends_with("(ok)")).count(),
        2,
        "{out}"
    );
}

/// Every attack of the hostile guest, in order (each asserted by name).
const ATTACKS: &[&str] = &[
    "read another tenant's SRAM at the same offsets",
    "read SRAM past the own segment",
    "write SRAM straddling the segment end",
    "read HBM past the own segment",
    "write HBM straddling the segment end",
    "DMA from beyond guest RAM",
    "DMA into the local APIC's MMIO page",
    "DMA into the ECAM window",
    "address arithmetic that wraps around 2^64",
    "matmul whose operands span far past SRAM",
    "an SA the vNPU does not have",
    "a VU the vNPU does not have",
    "bad container magic",
    "unknown instruction opcode",
    "semaphore id 200 (of 64)",
    "truncated program",
    "trailing bytes after the code",
    "a semaphore wait that never completes",
    "a program that runs past its cycle budget",
    "a core the vNPU does not have",
    "run a program handle never registered",
    "change a program after it was verified",
    "configure beyond the host's grant",
    "counters written into MMIO space",
    "unknown mailbox command",
    "writes to read-only registers, nonexistent vector",
    "a flood of 20000 doorbells",
    "MSI-X entry with a bogus address",
    "BAR 0 relocated over guest RAM",
    "ring placed outside guest RAM",
    "ring size not a power of two",
    "unknown request opcode",
    "header descriptor outside guest RAM",
    "program descriptor outside guest RAM",
    "program of 1 GiB",
    "chain without a status block",
    "descriptor loop",
    "indirect chain longer than the ring",
    "status block outside guest RAM",
    "head index beyond the ring",
    "available index far ahead of the device",
    "recovery of the attacked vNPU by reset",
    "a flood of maximal requests (a full ring, each 2M exps)",
    "a flood of requests that each hit the cycle budget",
    "requests that hold the DMA engine (96 MiB each, a full ring)",
    "read the neighbour's SRAM and HBM after it released them",
];

/// The hostile-guest suite on one physical core: the attacked vNPU, the
/// same guest's honest vNPU and a second VM's digits demo share it. Each
/// attack is contained while the honest vNPU's request is in flight on
/// that core, and each of its results matches the CPU reference and the
/// labels; the neighbour VM classifies exactly as its training script
/// says (accuracies from the labels, every image equal to its CPU).
#[test]
fn hostile_guest_attacks_are_contained_and_neighbours_on_its_core_undisturbed() {
    let core = vnpu_device::SharedCore::new(&npu_model::BoardConfig::default(), "core-0").unwrap();
    let small = VnpuSpec::named("small").unwrap();
    let neighbour = {
        let core = core.clone();
        std::thread::spawn(move || {
            let console = Console::default();
            let mut cfg = VmConfig::new(64 << 20, guest("digits")).vnpus(&[small]);
            cfg.shared_cores = vec![vec![core]];
            cfg.name = "neighbour".into();
            let code = Vm::new(&cfg, console.clone()).unwrap().run().unwrap();
            let text = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
            (code, text)
        })
    };
    let console = Console::default();
    let mut cfg = VmConfig::new(64 << 20, guest("hostile")).vnpus(&[small, small]);
    cfg.shared_cores = vec![vec![core.clone()], vec![core.clone()]];
    cfg.name = "hostile".into();
    let code = Vm::new(&cfg, console.clone()).unwrap().run().unwrap();
    let out = String::from_utf8_lossy(&console.0.lock().unwrap()).to_string();
    let (ncode, next_door) = neighbour.join().unwrap();
    let stats = core.stats();
    core.stop();
    assert_eq!(code, 0, "{out}");
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("attack ")).collect();
    assert_eq!(lines.len(), ATTACKS.len(), "{out}");
    for (i, (line, name)) in lines.iter().zip(ATTACKS).enumerate() {
        assert_eq!(*line, format!("attack {:02} {name}: contained", i + 1), "{out}");
    }
    let n = ATTACKS.len();
    eprintln!(
        "{}",
        out.lines()
            .filter(|l| l.starts_with("hostile:") || l.starts_with("honest"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(out.contains(&format!("hostile: {n}/{n} attacks contained; honest tenant correct")), "{out}");
    // The honest tenant ran beside every attack: one run alone, one per
    // attack, three more around each of the three floods, one before it
    // released its memory, one after the last attack.
    assert!(out.contains(&format!("in all {} runs", n + 3 + 9)), "{out}");
    assert_eq!(ncode, 0, "{next_door}");
    for want in [
        "accuracy vnpu=0.9733 cpu=0.9733 model=mlp agree=450/450 batch_agree=450/450",
        "accuracy vnpu=0.9911 cpu=0.9911 model=cnn agree=450/450 batch_agree=450/450",
        "digits: vNPU and CPU agree on every image",
    ] {
        assert!(next_door.contains(want), "{want} missing:\n{next_door}");
    }
    // All three tenants really met on the core, at the same simulated time.
    assert_eq!(stats.tenants.len(), 3, "{stats:?}");
    assert!(stats.overlap_cycles > 0.0, "{stats:?}");
}

/// The DLRM-like guest: VU-heavy (a < 1) and equal to its CPU.
#[test]
fn recsys_guest_is_vu_heavy_and_matches_its_cpu() {
    let (code, out) = run_user_guest("recsys");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("recsys: max abs error vs CPU") && out.ends_with("(ok)\n"), "{out}");
    let a: f64 = out.split("(a = ").nth(1).and_then(|r| r.split(')').next()).unwrap().parse().unwrap();
    assert!(a < 1.0, "{out}");
}
