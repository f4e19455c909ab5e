//! Any sequence of conf1 port and ECAM accesses to a bus with a host bridge
//! and an MSI-X device never panics, and the read-only identity stays.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vnpu_pci::{Bar, BarKind, ConfigSpace, Identity, MsixCap, PciBus, PlainFunction};

fuzz_target!(|data: &[u8]| {
    let id = Identity { vendor_id: 0x5650, device_id: 1, class: 0x12_00_00, revision: 1, subsystem_vendor_id: 0, subsystem_id: 0 };
    let mut c = ConfigSpace::new(id);
    let _ = c.add_bar(0, Bar { kind: BarKind::Mem64 { prefetchable: false }, size: 0x4000 });
    let _ = MsixCap::add(&mut c, 8, 0, 0x2000, 0, 0x3000);
    let mut bus = PciBus::new();
    let _ = bus.add(3, Box::new(PlainFunction(c)));
    let mut rest = data;
    while rest.len() >= 12 {
        let (op, tail) = rest.split_at(12);
        rest = tail;
        let len = usize::from(op[0] % 5);
        let port = 0xcf8 + u16::from(op[1] % 8);
        let off = u64::from_le_bytes([op[2], op[3], op[4], op[5], op[6], op[7], 0, 0]);
        let val = &op[8..8 + len.min(4)];
        let mut buf = [0u8; 4];
        match op[0] >> 5 {
            0 => bus.pio_write(port, val),
            1 => bus.pio_read(port, &mut buf[..len.min(4)]),
            2 => bus.ecam_write(off, val),
            _ => bus.ecam_read(off, &mut buf[..len.min(4)]),
        }
    }
    let f = bus.function(3).map(|f| f.config().read_u16(0));
    assert_eq!(f, Some(0x5650));
});
