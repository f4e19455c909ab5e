//! MSI-X state shared by the vCPU thread (table and capability writes) and
//! the NPU worker thread (completions), and the sink that delivers
//! messages (the VMM's irqfds).

use std::sync::{Arc, Mutex, MutexGuard};

use vnpu_pci::{MsiMessage, MsixTable};

/// Where raised MSI-X messages go. The VMM delivers them through irqfds;
/// tests record them. Called from any thread.
pub trait MsiSink: Send + Sync {
    /// Delivers `m` now. A message that cannot be delivered is dropped, as
    /// on hardware.
    fn deliver(&self, m: MsiMessage);
}

/// Where a function whose MSI-X table lives in another process (a VMM
/// attached over vfio-user) raises its vectors: by number, one eventfd
/// each; the table, masking and pending bits are the VMM's. Called from
/// any thread.
pub trait VectorSink: Send + Sync {
    /// Signals `vector` (dropped when it has no eventfd).
    fn signal(&self, vector: u16);
}

/// A sink that records messages, for tests and for devices built without a VM.
#[derive(Debug, Default)]
pub struct RecordingSink(Mutex<Vec<MsiMessage>>);

impl RecordingSink {
    /// Messages delivered so far, in order; empties the record.
    pub fn take(&self) -> Vec<MsiMessage> {
        std::mem::take(&mut *lock(&self.0))
    }
}

impl MsiSink for RecordingSink {
    fn deliver(&self, m: MsiMessage) {
        lock(&self.0).push(m);
    }
}

/// Locks `m`, recovering the data if another thread panicked while holding
/// it (every critical section here leaves the state consistent).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The MSI-X table plus the capability's enable and function-mask bits.
#[derive(Debug)]
pub(crate) struct MsixState {
    pub table: MsixTable,
    pub enabled: bool,
    pub function_masked: bool,
}

/// Raises vectors by the MSI-X rules and hands them to the sink.
pub(crate) struct Interrupts {
    pub state: Mutex<MsixState>,
    pub sink: Arc<dyn MsiSink>,
    /// Set for a function served over vfio-user: vectors go here by
    /// number and the local table is not consulted.
    pub vectors: Option<Arc<dyn VectorSink>>,
}

impl std::fmt::Debug for Interrupts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interrupts").field("state", &self.state).finish_non_exhaustive()
    }
}

impl Interrupts {
    /// Raises `vector`: delivered now, left pending while masked, dropped
    /// while MSI-X is disabled or when the vector does not exist.
    pub fn raise(&self, vector: u16) {
        if let Some(v) = &self.vectors {
            v.signal(vector);
            return;
        }
        let mut s = lock(&self.state);
        let (en, fm) = (s.enabled, s.function_masked);
        if let Some(m) = s.table.trigger(vector, en, fm) {
            // Delivered under the lock so messages keep their order.
            self.sink.deliver(m);
        }
    }

    /// Delivers every pending vector that is no longer masked.
    pub fn release_pending(&self) {
        let mut s = lock(&self.state);
        let (en, fm) = (s.enabled, s.function_masked);
        for m in s.table.take_deliverable(en, fm) {
            self.sink.deliver(m);
        }
    }
}
