//! Helpers shared by the guest-booting test files.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// A built bare-metal guest; fails loudly when the guests were not built
/// (`scripts/build-guests.sh`) or /dev/kvm is missing, rather than letting
/// a test pass vacuously.
pub fn guest(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../guest-images/target/x86_64-unknown-none/release")
        .join(name);
    assert!(p.exists(), "guest {} missing: run scripts/build-guests.sh first", p.display());
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "/dev/kvm is missing: these tests boot real guests and cannot run here"
    );
    p
}

/// A serial console that keeps what the guest printed.
#[derive(Clone, Default)]
pub struct Console(pub Arc<Mutex<Vec<u8>>>);

impl Console {
    /// Everything printed so far.
    #[allow(dead_code)] // not every test file reads it this way
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)).to_string()
    }
}

impl Write for Console {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the `msix-test` guest prints when every MSI-X check holds.
#[allow(dead_code)] // not every test file boots it
pub const MSIX_TEST_PASSES: &str = "msi delivered ok\n\
     masked vector not delivered ok\n\
     pending bit set ok\n\
     pending vector delivered on unmask ok\n\
     pending bit cleared ok\n\
     interrupts 02\n";

/// The digits guest's verdicts on the held-out split: every prediction
/// of the vNPU (one image at a time and as a batch) agrees with its CPU
/// reference, at the accuracies of the training script.
#[allow(dead_code)] // not every test file boots it
pub fn assert_digits_agree_with_the_cpu(out: &str) {
    assert!(
        out.contains("accuracy vnpu=0.9733 cpu=0.9733 model=mlp agree=450/450 batch_agree=450/450"),
        "{out}"
    );
    assert!(
        out.contains("accuracy vnpu=0.9911 cpu=0.9911 model=cnn agree=450/450 batch_agree=450/450"),
        "{out}"
    );
    assert!(out.ends_with("digits: vNPU and CPU agree on every image\n"), "{out}");
}
