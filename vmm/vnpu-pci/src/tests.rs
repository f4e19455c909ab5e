use proptest::prelude::*;

use super::*;

const ID: Identity = Identity {
    vendor_id: 0x5650,
    device_id: 0x0001,
    class: 0x12_00_00,
    revision: 1,
    subsystem_vendor_id: 0x5650,
    subsystem_id: 0x0001,
};

fn device() -> (ConfigSpace, MsixCap) {
    let mut c = ConfigSpace::new(ID);
    c.add_bar(0, Bar { kind: BarKind::Mem64 { prefetchable: false }, size: 0x4000 }).unwrap();
    c.add_bar(2, Bar { kind: BarKind::Mem32, size: 0x1000 }).unwrap();
    c.add_bar(4, Bar { kind: BarKind::Io, size: 0x20 }).unwrap();
    let m = MsixCap::add(&mut c, 4, 2, 0, 2, 0x800).unwrap();
    (c, m)
}

#[test]
fn ids_and_class_are_read_only() {
    let (mut c, _) = device();
    c.write(0, &[0xff; 16]);
    assert_eq!(c.read_u16(reg::VENDOR_ID), 0x5650);
    assert_eq!(c.read_u16(reg::DEVICE_ID), 0x0001);
    assert_eq!(c.read_u32(0x08) >> 8, 0x12_00_00);
    assert_eq!(c.read_u32(0x08) & 0xff, 1);
}

#[test]
fn command_register_takes_only_its_writable_bits() {
    let (mut c, _) = device();
    c.write(reg::COMMAND, &0xffffu16.to_le_bytes());
    assert_eq!(c.read_u16(reg::COMMAND), command::WRITABLE);
    assert!(c.memory_enabled() && c.bus_master());
    c.write(reg::COMMAND, &0u16.to_le_bytes());
    assert!(!c.memory_enabled() && !c.bus_master());
    // Status: the capability bit is set and read-only.
    c.write(reg::STATUS, &0xffffu16.to_le_bytes());
    assert_eq!(c.read_u16(reg::STATUS), STATUS_CAP_LIST);
}

#[test]
fn bar_sizing_follows_the_spec() {
    let (mut c, _) = device();
    // 64-bit memory BAR of 16 KiB: low reads ~(size-1) | type 64, high all ones.
    c.write(reg::BAR0, &u32::MAX.to_le_bytes());
    c.write(reg::BAR0 + 4, &u32::MAX.to_le_bytes());
    assert_eq!(c.read_u32(reg::BAR0), 0xffff_c004);
    assert_eq!(c.read_u32(reg::BAR0 + 4), 0xffff_ffff);
    // Programming an address then reading it back.
    c.write(reg::BAR0, &0xfe00_0000u32.to_le_bytes());
    c.write(reg::BAR0 + 4, &0x1u32.to_le_bytes());
    assert_eq!(c.bar_address(0), Some(0x1_fe00_0000));
    // Low address bits inside the BAR are read-only zero.
    c.write(reg::BAR0, &0xfe00_1234u32.to_le_bytes());
    assert_eq!(c.bar_address(0), Some(0x1_fe00_0000));
    // 32-bit memory BAR of 4 KiB.
    c.write(reg::BAR0 + 8, &u32::MAX.to_le_bytes());
    assert_eq!(c.read_u32(reg::BAR0 + 8), 0xffff_f000);
    // I/O BAR of 32 bytes: bit 0 set.
    c.write(reg::BAR0 + 16, &u32::MAX.to_le_bytes());
    assert_eq!(c.read_u32(reg::BAR0 + 16), 0xffff_ffe1);
    // An unimplemented BAR reads 0 and ignores writes.
    c.write(reg::BAR0 + 20, &u32::MAX.to_le_bytes());
    assert_eq!(c.read_u32(reg::BAR0 + 20), 0);
    assert_eq!(c.bar_address(5), None);
}

#[test]
fn bad_bar_layouts_are_refused() {
    let mut c = ConfigSpace::new(ID);
    assert!(c.add_bar(0, Bar { kind: BarKind::Mem32, size: 0x1800 }).is_err());
    assert!(c.add_bar(0, Bar { kind: BarKind::Mem32, size: 8 }).is_err());
    assert!(c.add_bar(5, Bar { kind: BarKind::Mem64 { prefetchable: true }, size: 0x1000 }).is_err());
    c.add_bar(1, Bar { kind: BarKind::Mem64 { prefetchable: true }, size: 1 << 33 }).unwrap();
    assert!(c.add_bar(2, Bar { kind: BarKind::Mem32, size: 0x1000 }).is_err());
    // 8 GiB 64-bit BAR: the low dword has no address bits, the high one some.
    c.write(reg::BAR0 + 4, &u32::MAX.to_le_bytes());
    c.write(reg::BAR0 + 8, &u32::MAX.to_le_bytes());
    assert_eq!(c.read_u32(reg::BAR0 + 4), 0x0000_000c);
    assert_eq!(c.read_u32(reg::BAR0 + 8), 0xffff_fffe);
}

#[test]
fn capability_walk_finds_msix() {
    let (c, m) = device();
    let mut ptr = [0u8];
    c.read(reg::CAPABILITIES, &mut ptr);
    assert_eq!(usize::from(ptr[0]), m.offset);
    assert_eq!(c.find_capability(CAP_ID_MSIX), Some(m.offset));
    let mut hdr = [0u8; 12];
    c.read(m.offset, &mut hdr);
    assert_eq!(hdr[0], CAP_ID_MSIX);
    assert_eq!(hdr[1], 0, "last capability");
    assert_eq!(u16::from_le_bytes([hdr[2], hdr[3]]) & 0x7ff, 3, "table size N-1");
    assert_eq!(u32::from_le_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]), 2, "table in BAR 2 at 0");
    assert_eq!(u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]), 0x802, "PBA in BAR 2 at 0x800");
    assert_eq!(c.find_capability(0x05), None);
}

#[test]
fn msix_masking_pending_and_delivery() {
    let (mut c, m) = device();
    let mut t = MsixTable::new(m.vectors);
    // Program vector 1.
    t.write(16, &0xfee0_0000u32.to_le_bytes());
    t.write(20, &0u32.to_le_bytes());
    t.write(24, &0x41u32.to_le_bytes());
    let mut b = [0u8; 4];
    t.read(16, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0xfee0_0000);
    // Disabled: dropped, nothing pending.
    assert_eq!(t.trigger(1, m.enabled(&c), m.function_masked(&c)), None);
    t.pba_read(0, &mut b[..1]);
    assert_eq!(b[0], 0);
    // Enable MSI-X; vectors are masked after reset, so it becomes pending.
    c.write(m.offset + 2, &0x8000u16.to_le_bytes());
    assert!(m.enabled(&c));
    assert_eq!(t.trigger(1, m.enabled(&c), m.function_masked(&c)), None);
    t.pba_read(0, &mut b[..1]);
    assert_eq!(b[0], 0b10);
    // Unmask vector 1 (only the mask bit of vector control is writable).
    t.write(28, &0xffff_fffeu32.to_le_bytes());
    t.read(28, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0);
    let msgs = t.take_deliverable(m.enabled(&c), m.function_masked(&c));
    assert_eq!(msgs, vec![MsiMessage { vector: 1, address: 0xfee0_0000, data: 0x41 }]);
    t.pba_read(0, &mut b[..1]);
    assert_eq!(b[0], 0);
    // Unmasked: delivered at once.
    assert_eq!(t.trigger(1, true, false), Some(MsiMessage { vector: 1, address: 0xfee0_0000, data: 0x41 }));
    // Function mask holds everything back until cleared.
    c.write(m.offset + 2, &0xc000u16.to_le_bytes());
    assert!(m.function_masked(&c));
    assert_eq!(t.trigger(1, m.enabled(&c), m.function_masked(&c)), None);
    assert!(t.take_deliverable(m.enabled(&c), m.function_masked(&c)).is_empty());
    c.write(m.offset + 2, &0x8000u16.to_le_bytes());
    assert_eq!(t.take_deliverable(m.enabled(&c), m.function_masked(&c)).len(), 1);
    // Out-of-range vectors and accesses are harmless.
    assert_eq!(t.trigger(99, true, false), None);
    t.write(4096, &[1, 2, 3]);
    t.read(u64::MAX - 1, &mut b);
    assert_eq!(b, [0; 4]);
    // The table-size field is read-only.
    c.write(m.offset + 2, &0xffffu16.to_le_bytes());
    assert_eq!(c.read_u16(m.offset + 2) & 0x7ff, 3);
}

fn bus() -> PciBus {
    let mut bus = PciBus::new();
    let host = Identity {
        vendor_id: 0x5650,
        device_id: 0x0000,
        class: 0x06_00_00,
        revision: 0,
        subsystem_vendor_id: 0,
        subsystem_id: 0,
    };
    bus.add(0, Box::new(PlainFunction(ConfigSpace::new(host)))).unwrap();
    bus.add(3, Box::new(PlainFunction(device().0))).unwrap();
    bus
}

fn conf1(bus: &mut PciBus, dev: u32, reg: u32) -> u32 {
    bus.pio_write(CONF1_ADDRESS, &(0x8000_0000 | dev << 11 | reg).to_le_bytes());
    let mut b = [0u8; 4];
    bus.pio_read(CONF1_DATA, &mut b);
    u32::from_le_bytes(b)
}

#[test]
fn conf1_enumerates_the_bus() {
    let mut bus = bus();
    assert_eq!(conf1(&mut bus, 0, 0), 0x0000_5650);
    assert_eq!(conf1(&mut bus, 3, 0), 0x0001_5650);
    assert_eq!(conf1(&mut bus, 3, 8) >> 8, 0x12_00_00);
    assert_eq!(conf1(&mut bus, 4, 0), 0xffff_ffff, "empty slot");
    // Byte access inside the data window: port 0xCFE reads bytes 2..3.
    bus.pio_write(CONF1_ADDRESS, &(0x8000_0000u32 | 3 << 11).to_le_bytes());
    let mut b = [0u8; 2];
    bus.pio_read(CONF1_DATA + 2, &mut b);
    assert_eq!(u16::from_le_bytes(b), 0x0001);
    // Enable bit clear: all ones.
    bus.pio_write(CONF1_ADDRESS, &(3u32 << 11).to_le_bytes());
    let mut w = [0u8; 4];
    bus.pio_read(CONF1_DATA, &mut w);
    assert_eq!(w, [0xff; 4]);
    // Other buses and functions are empty.
    assert_eq!(conf1(&mut bus, 3 | (1 << 5), 0), 0xffff_ffff);
    // A write through conf1 reaches the device.
    bus.pio_write(CONF1_ADDRESS, &(0x8000_0000u32 | 3 << 11 | 4).to_le_bytes());
    bus.pio_write(CONF1_DATA, &0x6u16.to_le_bytes());
    assert!(bus.function(3).unwrap().config().memory_enabled());
}

#[test]
fn ecam_reaches_extended_config_space() {
    let mut bus = bus();
    let mut b = [0u8; 4];
    bus.ecam_read(3 << 15, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x0001_5650);
    bus.ecam_read((3 << 15) | 0x100, &mut b);
    assert_eq!(b, [0; 4], "implemented but empty extended space");
    bus.ecam_read((1 << 20) | (3 << 15), &mut b);
    assert_eq!(b, [0xff; 4], "bus 1 is empty");
    bus.ecam_read((3 << 15) | 0xffe, &mut b);
    assert_eq!(b, [0xff; 4], "access crossing the 4 KiB function boundary");
    bus.ecam_write((3 << 15) | 4, &0x2u16.to_le_bytes());
    assert!(bus.function(3).unwrap().config().memory_enabled());
}

proptest! {
    /// Whatever a guest writes, at any offset and width, the read-only
    /// identity, BAR size bits and capability structure stay.
    #[test]
    fn hostile_config_writes_keep_read_only_state(writes in proptest::collection::vec((0usize..4200, proptest::collection::vec(any::<u8>(), 1..8)), 0..64)) {
        let (mut c, m) = device();
        for (off, data) in &writes {
            c.write(*off, data);
        }
        prop_assert_eq!(c.read_u16(reg::VENDOR_ID), 0x5650);
        prop_assert_eq!(c.read_u32(0x08) >> 8, 0x12_00_00);
        prop_assert_eq!(c.read_u32(reg::BAR0) & 0x3fff, 0x4);
        prop_assert_eq!(c.find_capability(CAP_ID_MSIX), Some(m.offset));
        prop_assert_eq!(c.read_u16(m.offset + 2) & 0x7ff, 3);
        prop_assert_eq!(c.read_u16(reg::COMMAND) & !command::WRITABLE, 0);
    }

    /// Any port or ECAM access sequence is handled without panicking.
    #[test]
    fn hostile_bus_accesses_never_panic(ops in proptest::collection::vec((any::<bool>(), any::<u16>(), any::<u64>(), proptest::collection::vec(any::<u8>(), 0..9)), 0..64)) {
        let mut bus = bus();
        for (write, port, off, data) in ops {
            let port = 0xcf8 + (port % 8);
            let mut buf = data.clone();
            if write {
                bus.pio_write(port, &data);
                bus.ecam_write(off, &data);
            } else {
                bus.pio_read(port, &mut buf);
                bus.ecam_read(off, &mut buf);
            }
        }
    }
}

#[test]
fn a_saved_function_comes_back_as_the_guest_left_it_and_keeps_its_identity() {
    let (mut c, m) = device();
    c.write(reg::BAR0, &0xc001_0000u32.to_le_bytes());
    c.write(reg::COMMAND, &0x6u16.to_le_bytes());
    c.write(m.offset + 2, &0x8000u16.to_le_bytes());
    let saved = c.saved();
    let (mut fresh, _) = device();
    assert_ne!(fresh.bar_address(0), c.bar_address(0));
    fresh.restore(&saved).unwrap();
    assert_eq!(fresh.saved(), saved, "every byte as it was");
    assert!(fresh.memory_enabled() && m.enabled(&fresh));
    // A saved identity is not taken: it is not the guest's to change.
    let mut other = saved.clone();
    other[0] ^= 0xff;
    fresh.restore(&other).unwrap();
    assert_eq!(fresh.read_u16(reg::VENDOR_ID), 0x5650);
    assert!(matches!(fresh.restore(&saved[..64]), Err(PciError::State(_))));

    let mut t = MsixTable::new(4);
    t.write(16, &0xfee0_0000u32.to_le_bytes());
    t.write(24, &0x41u32.to_le_bytes());
    t.write(28, &0u32.to_le_bytes());
    assert!(t.trigger(0, true, false).is_none(), "vector 0 is masked: pending");
    let w = t.saved();
    let mut back = MsixTable::new(4);
    back.restore(&w).unwrap();
    assert_eq!(back, t);
    assert!(back.restore(&w[1..]).is_err() && back == t, "a table of another size changes nothing");
}

proptest! {
    /// A saved state from anywhere (a snapshot file someone changed) is
    /// taken only as far as a guest could have written it: the identity,
    /// BAR size bits and capability chain stay, and a table of another
    /// size is refused whole.
    #[test]
    fn a_hostile_saved_state_keeps_read_only_state(
        bytes in proptest::collection::vec(any::<u8>(), CONFIG_SIZE..=CONFIG_SIZE),
        words in proptest::collection::vec(any::<u32>(), 0..48),
    ) {
        let (mut c, m) = device();
        c.restore(&bytes).unwrap();
        prop_assert_eq!(c.read_u16(reg::VENDOR_ID), 0x5650);
        prop_assert_eq!(c.read_u32(0x08) >> 8, 0x12_00_00);
        prop_assert_eq!(c.read_u32(reg::BAR0) & 0x3fff, 0x4);
        prop_assert_eq!(c.find_capability(CAP_ID_MSIX), Some(m.offset));
        let mut t = MsixTable::new(4);
        let before = t.clone();
        match t.restore(&words) {
            Ok(()) => prop_assert_eq!(words.len(), 20),
            Err(_) => prop_assert_eq!(&t, &before),
        }
    }
}
