//! The paravirtual control mailbox: configure, resize and release the
//! vNPU, read its counters.

use super::*;

impl DeviceCore {
    pub(super) fn mailbox(&mut self, cmd: u32, a: [u64; 6]) -> (u32, u64) {
        match cmd {
            abi::MBOX_CONFIGURE => match VnpuSpec::guest_request(a, &self.grant) {
                Ok(spec) => {
                    self.configure(spec);
                    (abi::ST_OK, 0)
                }
                Err(st) => (st, 0),
            },
            abi::MBOX_RELEASE => {
                self.release();
                (abi::ST_OK, 0)
            }
            abi::MBOX_READ_COUNTERS => {
                let block = self.counters.block(self.config.as_ref());
                let len = block.len().min(usize::try_from(a[1]).unwrap_or(usize::MAX));
                match self.mem.write_slice(&block[..len], GuestAddress(a[0])) {
                    Ok(()) => {
                        self.shared.write_log.note(a[0], len as u64);
                        (abi::ST_OK, len as u64)
                    }
                    Err(_) => (abi::ST_BAD_ADDRESS, 0),
                }
            }
            abi::MBOX_RESET_COUNTERS => {
                self.counters = Counters::default();
                (abi::ST_OK, 0)
            }
            abi::MBOX_QUERY_GRANT => {
                let g = &self.grant;
                let r = u64::from(g.sa_per_core())
                    | u64::from(g.vu_per_core()) << 16
                    | u64::from(g.cores_per_chip()) << 32
                    | u64::from(g.chips()) << 48;
                (abi::ST_OK, r)
            }
            _ => {
                self.regs().set_u32(regs::ERROR, abi::ERR_MBOX_UNKNOWN);
                (abi::ST_UNKNOWN_OPCODE, 0)
            }
        }
    }
}
