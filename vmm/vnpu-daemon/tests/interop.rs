//! The daemon's vfio-user server driven by the `vfio_user` crate's own
//! `Client` (the client code Cloud Hypervisor embeds): version
//! negotiation, region and interrupt info, configuration space, DMA_MAP
//! of a sealed memfd, SET_IRQS, GET_REGION_IO_FDS, and requests through
//! the command ring in the mapped memory, completed by polling and by the
//! MSI-X eventfd. Then hostile messages on a raw socket: the connection
//! that sent them ends or gets an error, the server goes on.

#![allow(clippy::unwrap_used)] // test helpers

use std::cell::RefCell;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use npu_model::BoardConfig;
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_CONFIG_REGION_INDEX,
    VFIO_PCI_MSIX_IRQ_INDEX,
};
use vfio_user::Client;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;
use vnpu_abi::device::regs;
use vnpu_daemon::{InstanceServer, VnpuBackend};
use vnpu_device::DeviceOptions;
use vnpu_driver::{DmaRegion, RunOptions, Vnpu, Wait};
use vnpu_spec::VnpuSpec;

const MEM: u64 = 8 << 20;
const DMA_BASE: u64 = 1 << 20;

fn socket(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vnpu-interop-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("vnpu.sock")
}

fn serve(path: &std::path::Path) -> InstanceServer {
    let spec = VnpuSpec::parse("sa=1,vu=1,sram=4M,hbm=256M").unwrap();
    InstanceServer::start(
        path,
        "interop",
        None,
        Box::new(move || {
            VnpuBackend::new(&spec, &BoardConfig::default(), "interop", DeviceOptions::default())
        }),
    )
    .unwrap()
}

/// Guest RAM in a memfd sealed against shrinking, as a VMM shares it.
fn guest_ram(seal: bool) -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the new descriptor
    // is owned by the File below.
    let fd = unsafe { libc::memfd_create(c"vnpu-guest-ram".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(MEM).unwrap();
    if seal {
        // SAFETY: adds seals to our own memfd.
        assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
    }
    f
}

/// BAR 0 through the client: reads and writes become REGION_READ/WRITE,
/// except the doorbell, which goes to the ioeventfd the server handed out
/// (as KVM would do with it).
struct ClientBar<'a> {
    client: &'a RefCell<Client>,
    doorbell: Option<&'a File>,
}

impl vnpu_driver::Bar for ClientBar<'_> {
    fn read32(&self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.client.borrow_mut().region_read(0, offset, &mut b).unwrap();
        u32::from_le_bytes(b)
    }
    fn write32(&self, offset: u64, value: u32) {
        match (offset, self.doorbell) {
            (regs::DOORBELL, Some(mut fd)) => {
                fd.write_all(&1u64.to_ne_bytes()).unwrap();
            }
            _ => self.client.borrow_mut().region_write(0, offset, &value.to_le_bytes()).unwrap(),
        }
    }
}

#[test]
fn the_crates_client_drives_a_vnpu_through_the_daemon() {
    drive("drive", false);
}

/// Guest RAM mapped as a VMM with a vIOMMU maps it (QEMU with
/// `intel-iommu,caching-mode=on`): one `DMA_MAP` per 4 KiB page, 2,048 of
/// them (the daemon took 64 in all), last page first; the same program
/// runs on it.
#[test]
fn a_client_that_maps_guest_ram_page_by_page_drives_a_vnpu() {
    drive("paged", true);
}

fn drive(name: &str, paged: bool) {
    let path = socket(name);
    let mut server = serve(&path);
    let client = RefCell::new(Client::new(&path).unwrap());
    {
        let c = client.borrow();
        // The patched client reports the reset flag the server sets.
        assert!(c.resettable());
        assert_eq!(c.region(0).unwrap().size, vnpu_device::BAR0_SIZE);
        assert_eq!(c.region(2).unwrap().size, vnpu_device::BAR2_SIZE);
        assert_eq!(c.region(VFIO_PCI_CONFIG_REGION_INDEX).unwrap().size, 256);
    }
    let mut id = [0u8; 4];
    client.borrow_mut().region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut id).unwrap();
    assert_eq!(u16::from_le_bytes([id[0], id[1]]), vnpu_device::VENDOR_ID);
    assert_eq!(u16::from_le_bytes([id[2], id[3]]), vnpu_device::DEVICE_ID);
    let irq = client.borrow_mut().get_irq_info(VFIO_PCI_MSIX_IRQ_INDEX).unwrap();
    assert_eq!(irq.count, u32::from(vnpu_device::MSIX_VECTORS));

    // Guest RAM shared by descriptor, mapped on both sides.
    let ram = guest_ram(true);
    if paged {
        for page in (0..MEM / 4096).rev() {
            client.borrow_mut().dma_map(page * 4096, page * 4096, 4096, ram.as_raw_fd()).unwrap();
        }
    } else {
        client.borrow_mut().dma_map(0, 0, MEM, ram.as_raw_fd()).unwrap();
    }
    let mem: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(0),
        MEM as usize,
        Some(FileOffset::new(ram, 0)),
    )])
    .unwrap();

    // MSI-X: one eventfd per vector; a thread plays the guest's handler.
    let vectors: Vec<EventFd> = (0..irq.count).map(|_| EventFd::new(0).unwrap()).collect();
    let fds: Vec<i32> = vectors.iter().map(|e| e.as_raw_fd()).collect();
    let flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    client.borrow_mut().set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, flags, 0, irq.count, &fds).unwrap();
    let counter: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
    let completion = vectors[0].try_clone().unwrap();
    // The daemon made the triggers non-blocking (docs/isolation.md): the
    // flag belongs to the eventfd, so this side sees it too, as a VMM's
    // own non-blocking eventfds would be anyway.
    std::thread::spawn(move || loop {
        match completion.read() {
            Ok(n) => {
                counter.fetch_add(n as u32, Ordering::AcqRel);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            Err(_) => break,
        }
    });

    // The doorbell as an ioeventfd.
    let io = client.borrow_mut().get_region_io_fds(0).unwrap();
    let doorbell =
        io.iter().find(|(s, _)| s.offset == regs::DOORBELL).map(|(_, f)| f).expect("doorbell ioeventfd");
    assert!(io.iter().any(|(s, _)| s.offset == regs::CAL_NOP));
    assert!(client.borrow_mut().get_region_io_fds(2).unwrap().is_empty());

    let host = mem.get_host_address(GuestAddress(DMA_BASE)).unwrap();
    // SAFETY: guest RAM from DMA_BASE on is this test's, and the device
    // sees it at DMA_BASE.
    let mut dma = unsafe { DmaRegion::new(host, DMA_BASE, (MEM - DMA_BASE) as usize) };
    let bar = ClientBar { client: &client, doorbell: Some(doorbell) };
    let mut npu = Vnpu::new(bar, &mut dma, 64).unwrap();
    let h = npu.hierarchy();
    assert_eq!((h.sa_per_core, h.vu_per_core), (1, 1));
    npu.configure(&h).unwrap();
    let polled = npu.nop(Wait::Poll).unwrap();
    assert_eq!(polled.status, vnpu_abi::device::ST_OK);
    npu.use_interrupts(0, counter);
    let before = counter.load(Ordering::Acquire);
    let by_irq = npu.nop(Wait::Interrupt).unwrap();
    assert_eq!(by_irq.status, vnpu_abi::device::ST_OK);
    // The driver may see the used ring before the handler thread has run.
    let t0 = std::time::Instant::now();
    while counter.load(Ordering::Acquire) == before && t0.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(counter.load(Ordering::Acquire) > before, "the MSI-X eventfd of vector 0 fired");
    // A program that reads guest memory ran on the mapped memfd.
    let prog = npu.load(&mut dma, &relu_program()).unwrap();
    let input = [-1.0f32, 2.0, -3.0, 4.0];
    let bytes: Vec<u8> = input.iter().flat_map(|v| v.to_le_bytes()).collect();
    vm_memory::Bytes::write_slice(&mem, &bytes, GuestAddress(0x1000)).unwrap();
    npu.run(&prog, &RunOptions::default()).unwrap();
    let mut out = [0u8; 16];
    vm_memory::Bytes::read_slice(&mem, &mut out, GuestAddress(0x2000)).unwrap();
    let got: Vec<f32> = out.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(got, vec![0.0, 2.0, 0.0, 4.0]);

    // A refused request is an error of that call, not a hang.
    let e = client.borrow_mut().region_read(0, vnpu_device::BAR0_SIZE, &mut [0u8; 4]).unwrap_err();
    assert!(matches!(e, vfio_user::Error::Reply { errno, .. } if errno == libc::EINVAL as u32), "{e}");
    let e = client.borrow_mut().region_read(5, 0, &mut [0u8; 4]).unwrap_err();
    assert!(matches!(e, vfio_user::Error::Reply { .. }), "{e}");
    // Memory not sealed against shrinking is refused (it could fault the daemon).
    let unsealed = guest_ram(false);
    let e = client.borrow_mut().dma_map(0, 1 << 30, MEM, unsealed.as_raw_fd()).unwrap_err();
    assert!(matches!(e, vfio_user::Error::Reply { .. }), "{e}");
    // ... and the connection still works.
    client.borrow_mut().region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut id).unwrap();
    server.stop();
    assert!(!path.exists(), "the socket is removed when the instance stops");
}

/// Program: 4 floats guest 0x1000 -> SRAM 0, ReLU on VU 0 to SRAM 64, -> guest 0x2000.
fn relu_program() -> Vec<u8> {
    use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder, UnOp};
    let mut p = ProgramBuilder::new();
    let dma = |src, dst| Instr::DmaCopy { src, dst, rows: 1, row_bytes: 16, src_stride: 0, dst_stride: 0 };
    p.push(Engine::DMA, dma(Addr::guest(0x1000), Addr::sram(0)));
    p.sync(Engine::DMA, Engine::vu(0), 0);
    p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Relu, src: 0, dst: 64, len: 4 });
    p.sync(Engine::vu(0), Engine::DMA, 1);
    p.push(Engine::DMA, dma(Addr::sram(64), Addr::guest(0x2000)));
    p.finish().encode()
}

/// Raw header of a vfio-user message.
fn header(id: u16, command: u16, size: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&command.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

fn reply(s: &mut UnixStream) -> Option<(u32, u32)> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).ok()?;
    let size = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let flags = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    let mut rest = vec![0u8; size.saturating_sub(16) as usize];
    s.read_exact(&mut rest).ok()?;
    Some((flags, u32::from_le_bytes([h[12], h[13], h[14], h[15]])))
}

/// Messages the unpatched crate panicked on, hung on or desynchronized
/// on: each is answered with an error or ends that connection, and a
/// well-behaved client is served afterwards.
#[test]
fn hostile_messages_end_only_their_own_connection() {
    let path = socket("hostile");
    let mut server = serve(&path);
    let error = 1 << 5;
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        // VERSION whose size is smaller than the version struct (underflow).
        ("short version", header(1, 1, 16), true),
        // VERSION without the NUL after its JSON (an unwrap).
        ("version without NUL", [header(2, 1, 20 + 2), vec![0, 0, 0, 1, b'{', b'}']].concat(), true),
        // REGION_READ of 4 GiB - 1 (the crate allocated that much first;
        // overcommit hides it here, the reply must be an error).
        (
            "huge region read",
            [
                header(3, 9, 32),
                0u64.to_le_bytes().to_vec(),
                0u32.to_le_bytes().to_vec(),
                u32::MAX.to_le_bytes().to_vec(),
            ]
            .concat(),
            true,
        ),
        // REGION_WRITE whose count disagrees with the data sent.
        (
            "write count mismatch",
            [
                header(4, 10, 36),
                0u64.to_le_bytes().to_vec(),
                0u32.to_le_bytes().to_vec(),
                64u32.to_le_bytes().to_vec(),
                vec![0; 4],
            ]
            .concat(),
            true,
        ),
        // An unknown command with a payload the server must skip.
        ("unknown command", [header(5, 99, 24), vec![0xaa; 8]].concat(), true),
        // SET_IRQS with vectors past the end.
        (
            "irqs out of range",
            [
                header(6, 8, 36),
                20u32.to_le_bytes().to_vec(),
                (4u32 | 32).to_le_bytes().to_vec(),
                2u32.to_le_bytes().to_vec(),
                30u32.to_le_bytes().to_vec(),
                10u32.to_le_bytes().to_vec(),
            ]
            .concat(),
            true,
        ),
        // A message size far beyond any command: the framing is gone.
        ("giant message size", header(7, 9, u32::MAX), false),
    ];
    for (name, bytes, answered) in cases {
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        s.write_all(&bytes).unwrap();
        match reply(&mut s) {
            Some((flags, errno)) => {
                assert!(answered, "{name}: expected the connection to end");
                assert!(flags & error != 0, "{name}: expected an error reply");
                assert!(errno != 0, "{name}: the error carries an errno");
                // The stream is still in step: a well-formed read works.
                let read = [
                    header(8, 9, 32),
                    0u64.to_le_bytes().to_vec(),
                    7u32.to_le_bytes().to_vec(),
                    4u32.to_le_bytes().to_vec(),
                ]
                .concat();
                s.write_all(&read).unwrap();
                let (flags, _) = reply(&mut s).expect(name);
                assert_eq!(flags & error, 0, "{name}: config read after the bad message");
            }
            None => assert!(!answered, "{name}: expected an error reply, the connection ended"),
        }
    }
    // The server goes on serving.
    let mut c = Client::new(&path).unwrap();
    let mut id = [0u8; 2];
    c.region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut id).unwrap();
    assert_eq!(u16::from_le_bytes(id), vnpu_device::VENDOR_ID);
    drop(c);
    server.stop();
}

/// The limits and flag values QEMU relies on: the version reply advertises
/// the daemon's mapping limit (`max_dma_maps`; a client not told assumes
/// 65,535), and "unmap all" is the protocol's and Linux's value
/// (`VFIO_DMA_UNMAP_FLAG_ALL` = 2, from the bindings, not from our crate):
/// every mapping goes, and the same ranges map again.
#[test]
fn the_daemon_advertises_its_mapping_limit_and_unmaps_all_by_the_protocol_value() {
    use vfio_bindings::bindings::vfio::VFIO_DMA_UNMAP_FLAG_ALL;
    use vfio_user::DmaUnmapFlags;
    let path = socket("limits");
    let mut server = serve(&path);
    let mut client = Client::new(&path).unwrap();
    assert_eq!(client.max_dma_maps(), Some(vnpu_daemon::backend::MAX_DMA_MAPS as u32));
    let (a, b) = (guest_ram(true), guest_ram(true));
    client.dma_map(0, 0, MEM, a.as_raw_fd()).unwrap();
    client.dma_map(0, 1 << 30, MEM, b.as_raw_fd()).unwrap();
    assert!(client.dma_map(0, 0, MEM, a.as_raw_fd()).is_err(), "still mapped: overlaps");
    client.dma_unmap_flags(DmaUnmapFlags::from_bits_retain(VFIO_DMA_UNMAP_FLAG_ALL), 0, 0).unwrap();
    client.dma_map(0, 0, MEM, a.as_raw_fd()).expect("unmapped by unmap-all");
    client.dma_map(0, 1 << 30, MEM, b.as_raw_fd()).expect("unmapped by unmap-all");
    drop(client);
    server.stop();
}
