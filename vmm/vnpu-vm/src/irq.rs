//! MSI delivery through irqfds and KVM GSI routing.
//!
//! Each (PCI slot, MSI-X vector) pair has its own GSI and eventfd,
//! registered with KVM as an irqfd. The GSI routing table keeps KVM's
//! default routes (GSIs 0..16 to the PICs, GSIs 0..24 to the IOAPIC pin
//! of the same number) and adds one MSI route per GSI with the address and
//! data the guest programmed; it is rewritten only when a vector's message
//! changes. Raising an interrupt is then one eventfd write, which any
//! thread can do without the vCPU (how the NPU workers will complete
//! requests).

use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::VmFd;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vnpu_pci::MsiMessage;

/// GSIs below this belong to the IOAPIC's pins.
const FIRST_MSI_GSI: u32 = 24;
/// GSIs reserved per PCI slot (MSI-X vectors beyond this are not routed).
const GSIS_PER_SLOT: u32 = 64;

/// The MSI routes and irqfds of a VM.
#[derive(Debug, Default)]
pub struct MsiRoutes {
    routes: BTreeMap<u32, (u64, u32)>,
    irqfds: BTreeMap<u32, EventFd>,
}

/// Why an MSI could not be delivered.
#[derive(Debug, thiserror::Error)]
pub enum IrqError {
    #[error("MSI-X vector {0} has no GSI")]
    NoGsi(u16),
    #[error("KVM: {0}")]
    Kvm(#[from] kvm_ioctls::Error),
    #[error("eventfd: {0}")]
    EventFd(#[from] std::io::Error),
    #[error("GSI routing table: {0:?}")]
    Table(vmm_sys_util::fam::Error),
}

impl MsiRoutes {
    fn gsi(slot: usize, vector: u16) -> Option<u32> {
        let v = u32::from(vector);
        let slot = u32::try_from(slot).ok()?;
        if v >= GSIS_PER_SLOT {
            return None;
        }
        slot.checked_mul(GSIS_PER_SLOT)?.checked_add(FIRST_MSI_GSI)?.checked_add(v)
    }

    fn program(&self, vm: &VmFd) -> Result<(), IrqError> {
        let mut table = KvmIrqRouting::new(0).map_err(IrqError::Table)?;
        // KVM's default routes first: GSIs 0..16 also reach the PICs.
        for gsi in 0..16 {
            let mut e = kvm_irq_routing_entry { gsi, type_: KVM_IRQ_ROUTING_IRQCHIP, ..Default::default() };
            e.u.irqchip.irqchip = if gsi < 8 { KVM_IRQCHIP_PIC_MASTER } else { KVM_IRQCHIP_PIC_SLAVE };
            e.u.irqchip.pin = gsi % 8;
            table.push(e).map_err(IrqError::Table)?;
        }
        for pin in 0..FIRST_MSI_GSI {
            let mut e =
                kvm_irq_routing_entry { gsi: pin, type_: KVM_IRQ_ROUTING_IRQCHIP, ..Default::default() };
            e.u.irqchip.irqchip = KVM_IRQCHIP_IOAPIC;
            e.u.irqchip.pin = pin;
            table.push(e).map_err(IrqError::Table)?;
        }
        for (&gsi, &(address, data)) in &self.routes {
            let mut e = kvm_irq_routing_entry { gsi, type_: KVM_IRQ_ROUTING_MSI, ..Default::default() };
            #[allow(clippy::cast_possible_truncation)] // the low half, by intent
            {
                e.u.msi.address_lo = address as u32;
            }
            e.u.msi.address_hi = (address >> 32) as u32;
            e.u.msi.data = data;
            table.push(e).map_err(IrqError::Table)?;
        }
        vm.set_gsi_routing(&table)?;
        Ok(())
    }

    /// The irqfd of (`slot`, `vector`), created and registered on first
    /// use; returns a second handle to it.
    pub fn irqfd(&mut self, vm: &VmFd, slot: usize, vector: u16) -> Result<EventFd, IrqError> {
        let gsi = Self::gsi(slot, vector).ok_or(IrqError::NoGsi(vector))?;
        Ok(self.fd(vm, gsi)?.try_clone()?)
    }

    fn fd(&mut self, vm: &VmFd, gsi: u32) -> Result<&EventFd, IrqError> {
        Ok(match self.irqfds.entry(gsi) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let fd = EventFd::new(EFD_NONBLOCK)?;
                vm.register_irqfd(&fd, gsi)?;
                e.insert(fd)
            }
        })
    }

    /// Routes (`slot`, `m.vector`)'s GSI by `m`, reprogramming KVM's
    /// table only when the message changed (a function whose irqfds are
    /// signalled by another process: `remote.rs`).
    pub fn set_route(&mut self, vm: &VmFd, slot: usize, m: MsiMessage) -> Result<(), IrqError> {
        let gsi = Self::gsi(slot, m.vector).ok_or(IrqError::NoGsi(m.vector))?;
        if self.routes.get(&gsi) != Some(&(m.address, m.data)) {
            self.routes.insert(gsi, (m.address, m.data));
            if let Err(e) = self.program(vm) {
                self.routes.remove(&gsi);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Assigns or deassigns (`slot`, `vector`)'s irqfd in KVM (a masked
    /// vector's signals wait in the eventfd; KVM delivers them when it is
    /// assigned again).
    pub fn set_irqfd_assigned(
        &mut self,
        vm: &VmFd,
        slot: usize,
        vector: u16,
        on: bool,
    ) -> Result<(), IrqError> {
        let gsi = Self::gsi(slot, vector).ok_or(IrqError::NoGsi(vector))?;
        let fd = self.fd(vm, gsi)?;
        if on {
            vm.register_irqfd(fd, gsi)?;
        } else {
            vm.unregister_irqfd(fd, gsi)?;
        }
        Ok(())
    }

    /// Delivers `m`, raised by the function in `slot`, through its irqfd,
    /// first (re)programming its route if the message changed.
    pub fn deliver(&mut self, vm: &VmFd, slot: usize, m: MsiMessage) -> Result<(), IrqError> {
        self.set_route(vm, slot, m)?;
        let gsi = Self::gsi(slot, m.vector).ok_or(IrqError::NoGsi(m.vector))?;
        self.fd(vm, gsi)?.write(1)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_ioctls::Kvm;

    #[test]
    fn routes_are_programmed_once_per_message_and_bad_vectors_refused() {
        let kvm = Kvm::new().expect("/dev/kvm is needed for this test");
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let mut r = MsiRoutes::default();
        let m = MsiMessage { vector: 1, address: 0xfee0_0000, data: 0x41 };
        r.deliver(&vm, 1, m).unwrap();
        r.deliver(&vm, 1, m).unwrap();
        assert_eq!(r.routes.len(), 1);
        assert_eq!(r.irqfds.len(), 1);
        // A reprogrammed vector updates its route in place.
        r.deliver(&vm, 1, MsiMessage { data: 0x42, ..m }).unwrap();
        assert_eq!(r.routes.get(&(FIRST_MSI_GSI + GSIS_PER_SLOT + 1)), Some(&(0xfee0_0000, 0x42)));
        // Another function's vector gets its own GSI.
        r.deliver(&vm, 2, m).unwrap();
        assert_eq!(r.irqfds.len(), 2);
        // Vectors beyond the per-slot range have no GSI: an error, no panic.
        assert!(matches!(r.deliver(&vm, 1, MsiMessage { vector: 64, ..m }), Err(IrqError::NoGsi(64))));
    }
}
