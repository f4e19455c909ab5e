//! The MultiProcessor Specification 1.4 table a Linux guest reads to find
//! its CPU, its IOAPIC and how the ISA interrupts are wired (no ACPI).
//!
//! Layout (all little-endian, Intel MP spec 1.4, chapter 4): the 16-byte
//! floating pointer structure ("_MP_") at the start of the last KiB of base
//! memory, where Linux scans for it, followed by the configuration table
//! ("PCMP") with one processor, one ISA bus, the in-kernel IOAPIC, one I/O
//! interrupt entry per ISA IRQ and the two local interrupt entries (ExtINT
//! on LINT0, NMI on LINT1).

/// Where the table goes: the last KiB below 640 KiB.
pub const MPTABLE_START: u64 = 0x9fc00;
/// Guest-physical base of the IOAPIC KVM's in-kernel irqchip emulates.
pub const IOAPIC_BASE: u32 = 0xfec0_0000;
/// Guest-physical base of the local APIC.
pub const APIC_BASE: u32 = 0xfee0_0000;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const BUS_ISA: u8 = 0;
/// ISA IRQs 0..16 are described, each on the IOAPIC pin of its number:
/// KVM's in-kernel irqchip routes GSI n to IOAPIC pin n (the PIT raises
/// GSI 0), unlike PC chipsets, which wire IRQ 0 to pin 2.
const ISA_IRQS: u8 = 16;

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// The floating pointer structure followed by the configuration table, for
/// `cpus` processors (APIC IDs 0..cpus; the IOAPIC takes ID `cpus`), to be
/// written at [`MPTABLE_START`].
pub fn build(cpus: u8) -> Vec<u8> {
    let table_at = u32::try_from(MPTABLE_START).expect("a constant below 4 GiB") + 16;
    let ioapic_id = cpus;
    let mut entries = Vec::new();
    let mut count = 0u16;
    for id in 0..cpus {
        // Processor: type 0, APIC ID, version, flags (enabled, bootstrap),
        // signature (family 6), feature flags (FPU, APIC).
        entries.extend_from_slice(&[0, id, APIC_VERSION, 1 | if id == 0 { 2 } else { 0 }]);
        entries.extend_from_slice(&0x600u32.to_le_bytes());
        entries.extend_from_slice(&0x201u32.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    // Bus: type 1, ID, type string.
    entries.extend_from_slice(&[1, BUS_ISA]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    // IOAPIC: type 2, ID, version, flags (enabled), address.
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IOAPIC_BASE.to_le_bytes());
    count += 1;
    for irq in 0..ISA_IRQS {
        let pin = irq;
        // I/O interrupt: type 3, INT, flags (bus default polarity and
        // trigger), source bus and IRQ, destination IOAPIC and pin.
        entries.extend_from_slice(&[3, 0, 0, 0, BUS_ISA, irq, ioapic_id, pin]);
        count += 1;
    }
    // Local interrupts: type 4, ExtINT to LINT0 and NMI to LINT1 of every
    // local APIC (0xff).
    entries.extend_from_slice(&[4, 3, 0, 0, BUS_ISA, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, BUS_ISA, 0, 0xff, 1]);
    count += 2;

    let mut table = Vec::with_capacity(44 + entries.len());
    table.extend_from_slice(b"PCMP");
    // At most 255 processors and a fixed number of other entries.
    let length = u16::try_from(44 + entries.len()).expect("an MP table of a u8 CPU count fits 64 KiB");
    table.extend_from_slice(&length.to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"VNPU    "); // OEM ID
    table.extend_from_slice(b"VNPU-VMM    "); // product ID
    table.extend_from_slice(&0u32.to_le_bytes()); // no OEM table
    table.extend_from_slice(&0u16.to_le_bytes());
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&APIC_BASE.to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // no extended table
    table.push(0);
    table.push(0);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut out = Vec::with_capacity(16 + table.len());
    out.extend_from_slice(b"_MP_");
    out.extend_from_slice(&table_at.to_le_bytes());
    out.push(1); // length in 16-byte units
    out.push(4); // spec revision 1.4
    out.push(0); // checksum, below
    out.extend_from_slice(&[0; 5]); // feature bytes: a table is present, no IMCR
    out[10] = checksum(&out[..16]);
    out.extend_from_slice(&table);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn table_has_valid_checksums_and_entries() {
        let t = build(1);
        assert_eq!(&t[..4], b"_MP_");
        assert_eq!(sum(&t[..16]), 0);
        let at = u32::from_le_bytes(t[4..8].try_into().unwrap()) as usize - MPTABLE_START as usize;
        assert_eq!(at, 16);
        let table = &t[at..];
        assert_eq!(&table[..4], b"PCMP");
        let len = u16::from_le_bytes([table[4], table[5]]) as usize;
        assert_eq!(len, table.len());
        assert_eq!(sum(table), 0);
        let count = u16::from_le_bytes([table[34], table[35]]);
        // 1 CPU, 1 bus, 1 IOAPIC, 16 ISA IRQs, 2 local interrupts.
        assert_eq!(count, 21);
        // Entries: 20 bytes for the processor, 8 for each of the others.
        assert_eq!(len, 44 + 20 + 8 * 20);
        // ISA IRQ 0 (the PIT) is on IOAPIC pin 0, where KVM raises it.
        let first_irq = 44 + 20 + 8 + 8;
        assert_eq!(&table[first_irq..first_irq + 8], &[3, 0, 0, 0, 0, 0, 1, 0]);
        // The whole table stays below 640 KiB.
        assert!(MPTABLE_START as usize + t.len() <= 0xa0000);
    }
}
