//! Guests whose vNPU is served by the board daemon's vfio-user server
//! (`docs/vfio-user.md`): our VMM attaches as a vfio-user client (guest
//! RAM in a sealed memfd shared by DMA_MAP, BAR 0 forwarded, doorbells as
//! the server's ioeventfds in KVM, MSI-X table here with irqfds handed to
//! the server) and the unchanged guests run as with an in-process vNPU.
//!
//! Needs /dev/kvm and the guests built by `scripts/build-guests.sh`.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::{assert_digits_agree_with_the_cpu, guest, Console, MSIX_TEST_PASSES};
use npu_model::BoardConfig;
use vnpu_daemon::{InstanceServer, VnpuBackend};
use vnpu_device::DeviceOptions;
use vnpu_spec::VnpuSpec;
use vnpu_vm::{Vm, VmConfig};

/// Serves a `small` vNPU at a fresh socket.
fn serve(name: &str) -> (InstanceServer, PathBuf) {
    let dir = std::env::temp_dir().join(format!("vnpu-boot-daemon-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vnpu.sock");
    let spec = VnpuSpec::named("small").unwrap();
    let server = InstanceServer::start(
        &path,
        name,
        None,
        Box::new(move || VnpuBackend::new(&spec, &BoardConfig::default(), "boot", DeviceOptions::default())),
    )
    .unwrap();
    (server, path)
}

fn boot(guest_name: &str, socket: PathBuf) -> (u32, String) {
    let console = Console::default();
    let mem = if guest_name == "msix-test" { 16 << 20 } else { 64 << 20 };
    let mut cfg = VmConfig::new(mem, guest(guest_name));
    cfg.remote_vnpus = vec![socket];
    let mut vm = Vm::new(&cfg, console.clone()).unwrap();
    let code = vm.run().unwrap();
    let out = console.text();
    (code, out)
}

#[test]
fn digits_guest_classifies_through_the_daemon_like_the_cpu() {
    let (mut server, path) = serve("digits");
    let (code, out) = boot("digits", path);
    server.stop();
    assert_eq!(code, 0, "{out}");
    assert_digits_agree_with_the_cpu(&out);
}

#[test]
fn ring_round_trips_through_the_daemon_by_polling_and_by_interrupt() {
    let (mut server, path) = serve("ring");
    let (code, out) = boot("ring-bench", path);
    server.stop();
    assert_eq!(code, 0, "{out}");
    for line in ["vNPU nop, polled", "vNPU nop, interrupt"] {
        assert!(out.contains(line), "{line} missing from:\n{out}");
    }
}

/// MSI-X through the daemon: the table is the VMM's, a masked vector's
/// irqfd is deassigned so its signal waits in the eventfd (the pending
/// bit) and is delivered on unmask, as the in-process function does.
#[test]
fn msix_masking_and_pending_bits_hold_through_the_daemon() {
    let (mut server, path) = serve("msix");
    let (code, out) = boot("msix-test", path);
    server.stop();
    assert_eq!(code, 0, "{out}");
    assert_eq!(out, MSIX_TEST_PASSES);
}
