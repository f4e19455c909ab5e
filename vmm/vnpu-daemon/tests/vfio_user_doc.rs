//! `docs/vfio-user.md` against the code that serves a vNPU over
//! vfio-user: the region table and the interrupt index are what
//! `regions()` and `irqs()` report, and every limit and flag value the
//! page states (DMA regions and bytes, the "unmap all" bit, the
//! capability a client reads) is the constant the daemon uses.
#![allow(clippy::unwrap_used)]

use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_ERR_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_REQ_IRQ_INDEX,
};
use vfio_user::DmaUnmapFlags;
use vnpu_abi::device::{BAR0_SIZE, BAR2_SIZE, MSIX_VECTORS};
use vnpu_daemon::backend::{MAX_DMA_BYTES, MAX_DMA_FILES, MAX_DMA_MAPS, MAX_DMA_RUNS};

fn page() -> String {
    std::fs::read_to_string(format!("{}/../../docs/vfio-user.md", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// The page, with line breaks and runs of spaces made single spaces.
fn flat() -> String {
    page().split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn the_region_table_is_what_the_server_reports() {
    let regions = vnpu_daemon::regions();
    let size = |i: u32| regions.iter().find(|r| r.region_info.index == i).map_or(0, |r| r.region_info.size);
    assert_eq!(size(0), BAR0_SIZE, "region 0 is BAR 0, `BAR0_SIZE`");
    assert_eq!(size(2), BAR2_SIZE, "region 2 is BAR 2, `BAR2_SIZE`");
    assert_eq!(size(VFIO_PCI_CONFIG_REGION_INDEX), 256, "region 7 is the 256-byte config space");
    for r in &regions {
        if ![0, 2, VFIO_PCI_CONFIG_REGION_INDEX].contains(&r.region_info.index) {
            assert_eq!(r.region_info.size, 0, "region {} should be absent", r.region_info.index);
        }
    }
    let doc = page();
    for row in [
        "| 0 (BAR 0) | `BAR0_SIZE` |",
        "| 2 (BAR 2) | `BAR2_SIZE` |",
        "| 7 (config) | 256 |",
        "| others | 0 |",
    ] {
        assert!(doc.contains(row), "the region table lacks `{row}`");
    }
    // Interrupts: MSI-X at index 2 with MSIX_VECTORS vectors, one vector
    // each at the error (3) and device-request (4) indexes, none else.
    assert_eq!((VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_ERR_IRQ_INDEX, VFIO_PCI_REQ_IRQ_INDEX), (2, 3, 4));
    let irqs = vnpu_daemon::irqs();
    for i in &irqs {
        let want = match i.index {
            VFIO_PCI_MSIX_IRQ_INDEX => u32::from(MSIX_VECTORS),
            VFIO_PCI_ERR_IRQ_INDEX | VFIO_PCI_REQ_IRQ_INDEX => 1,
            _ => 0,
        };
        assert_eq!(i.count, want, "interrupt index {}", i.index);
    }
    let doc = flat();
    assert!(doc.contains("Index 2 (MSI-X) has `MSIX_VECTORS` vectors"));
    assert!(doc.contains("index 3 (error) and index 4 (device request) have one vector each"));
}

#[test]
fn the_limits_and_flags_the_page_states_are_the_daemons() {
    let doc = flat();
    assert!(doc.contains(&format!("at most {MAX_DMA_MAPS} ranges")), "the DMA mapping limit");
    assert!(doc.contains(&format!("in at most {MAX_DMA_RUNS} runs")), "the limit of runs");
    assert!(doc.contains(&format!("from at most {MAX_DMA_FILES} files")), "the limit of files");
    assert!(doc.contains(&format!("`max_dma_maps: {MAX_DMA_MAPS}`")), "the advertised limit");
    assert_eq!(MAX_DMA_BYTES, 1 << 40);
    assert!(doc.contains("1 TiB (`MAX_DMA_BYTES`)"), "the DMA byte limit");
    let all = DmaUnmapFlags::UNMAP_ALL.bits();
    assert!(doc.contains(&format!("(`VFIO_DMA_UNMAP_FLAG_ALL` = {all}")), "the unmap-all bit ({all})");
}
