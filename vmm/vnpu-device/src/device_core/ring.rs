//! The command ring: requests walked off the virtio split ring, programs
//! copied out of guest memory, decoded, verified and run, completions
//! written back.

use super::*;

/// A request's status block: its last device-writable descriptor, if
/// large enough.
fn status_desc(descs: &[Desc]) -> Option<Desc> {
    descs.iter().rfind(|d| d.write).filter(|d| d.len as usize >= abi::STATUS_BYTES).copied()
}

impl DeviceCore {
    /// Serves the ring until it is empty, gone, broken or the core is
    /// stopped; control work (a reset, a stop, a grant change) takes effect
    /// between requests.
    pub fn drain_ring(&mut self) {
        loop {
            if self.stopped {
                return;
            }
            // Control work (a reset, a stop, a grant change) takes effect
            // between requests, whatever the ring still holds: a guest that
            // keeps its ring full cannot hold a stop off.
            if !lock(&self.shared.controls).is_empty() {
                self.handle_controls();
                if self.stopped {
                    return;
                }
            }
            let Some(taken_at) = self.queue.as_ref().map(QueueT::next_avail) else { return };
            let Some((head, descs)) = self.take_request() else { return };
            self.begin_request(taken_at);
            let (len, interrupt) = self.process(&descs);
            if !self.push_used(head, len) {
                return;
            }
            self.end_request();
            if interrupt {
                self.shared.notify(abi::INT_QUEUE, regs::QUEUE_VECTOR);
            }
        }
    }

    /// Puts the request at `head` on the used ring (`len` bytes written)
    /// and counts it in `COMPLETED`; false when the ring is gone or broke
    /// (then failed).
    pub(super) fn push_used(&mut self, head: u16, len: u32) -> bool {
        let Some(q) = self.queue.as_mut() else { return false };
        if let Err(e) = q.add_used(&self.mem, head, len) {
            self.fail_ring(&format!("completing the request at head {head}: {e}"));
            return false;
        }
        self.note_used_ring();
        self.regs().update_u32(regs::COMPLETED, |c| c.wrapping_add(1));
        true
    }

    /// The next request on the ring (its head and descriptors), taken off
    /// it; none when the ring is empty or gone. A ring that cannot be read
    /// (the available index more than a ring ahead, or the ring outside
    /// guest memory) is failed.
    pub(super) fn take_request(&mut self) -> Option<(u16, Vec<Desc>)> {
        let q = self.queue.as_mut()?;
        match q.iter(&self.mem) {
            Ok(mut it) => it.next().map(|chain| {
                let head = chain.head_index();
                let descs: Vec<Desc> = chain
                    .map(|d| Desc { addr: d.addr().0, len: d.len(), write: d.is_write_only() })
                    .collect();
                (head, descs)
            }),
            Err(e) => {
                let why = format!("reading the available ring (next {}): {e}", q.next_avail());
                self.fail_ring(&why);
                None
            }
        }
    }

    /// Runs one request; returns the used length and whether to interrupt.
    pub(super) fn process(&mut self, descs: &[Desc]) -> (u32, bool) {
        let t0 = Instant::now();
        if status_desc(descs).is_none() {
            self.regs().set_u32(regs::ERROR, abi::ERR_NO_STATUS_BLOCK);
            self.counters.failed += 1;
            return (0, true);
        }
        let mut header = abi::RequestHeader::default();
        let outcome = self.run_request(descs, &mut header);
        let wall_ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);

        self.counters.requests += 1;
        self.counters.wall_ns += wall_ns;
        if let Some(t) = &self.opts.telemetry {
            t.request(outcome.status, wall_ns, outcome.report.as_ref());
        }
        if outcome.status != abi::ST_OK {
            self.counters.failed += 1;
        }
        let used = self.complete(descs, &outcome, header.tag, wall_ns);
        (used, header.flags & abi::FLAG_NO_INTERRUPT == 0)
    }

    /// Completes a request without running it, with `status` and
    /// `message` (its header's tag kept when it can be read); returns the
    /// used length.
    pub(super) fn complete_unrun(&mut self, descs: &[Desc], status: u32, message: &str) -> u32 {
        let mut hb = [0u8; abi::HEADER_BYTES];
        let tag = descs
            .first()
            .filter(|d| !d.write && d.len as usize >= abi::HEADER_BYTES)
            .filter(|d| self.mem.read_slice(&mut hb, GuestAddress(d.addr)).is_ok())
            .map_or(0, |_| abi::RequestHeader::from_bytes(&hb).tag);
        self.complete(descs, &Outcome::fail(status, message), tag, 0)
    }

    /// Writes a request's message and status block; returns the used
    /// length (0, with `ERR_NO_STATUS_BLOCK`, when the block cannot be
    /// written).
    fn complete(&mut self, descs: &[Desc], outcome: &Outcome, tag: u64, wall_ns: u64) -> u32 {
        let Some(status_desc) = status_desc(descs) else {
            self.regs().set_u32(regs::ERROR, abi::ERR_NO_STATUS_BLOCK);
            return 0;
        };
        let writable: Vec<&Desc> = descs.iter().filter(|d| d.write).collect();
        let message_desc = (writable.len() > 1).then(|| writable[0]);
        let mut block = abi::StatusBlock {
            status: outcome.status,
            detail: outcome.detail,
            tag,
            wall_ns,
            ..Default::default()
        };
        if let Some(r) = &outcome.report {
            let t = r.totals();
            block.cycles = crate::count(r.cycles.ceil());
            block.sa_active = crate::count(t.sa_active_cycles);
            block.vu_active = crate::count(t.vu_active_cycles);
            block.dma_active = crate::count(t.dma_active_cycles);
            block.flops = t.flops;
        }
        let mut used = 0u32;
        if let Some(m) = message_desc {
            let text = outcome.message.as_bytes();
            let n = text.len().min(MAX_MESSAGE).min(m.len as usize);
            if n > 0 && self.mem.write_slice(&text[..n], GuestAddress(m.addr)).is_ok() {
                self.shared.write_log.note(m.addr, n as u64);
                used += u32::try_from(n).unwrap_or(0);
            }
        }
        if self.mem.write_slice(&block.to_bytes(), GuestAddress(status_desc.addr)).is_err() {
            self.regs().set_u32(regs::ERROR, abi::ERR_NO_STATUS_BLOCK);
            return 0;
        }
        self.shared.write_log.note(status_desc.addr, abi::STATUS_BYTES as u64);
        used + u32::try_from(abi::STATUS_BYTES).unwrap_or(0)
    }

    pub(super) fn run_request(&mut self, descs: &[Desc], header: &mut abi::RequestHeader) -> Outcome {
        // Device-readable descriptors come first, then device-writable ones.
        let first_write = descs.iter().position(|d| d.write).unwrap_or(descs.len());
        if descs[first_write..].iter().any(|d| !d.write) {
            return Outcome::fail(abi::ST_BAD_REQUEST, "a device-readable descriptor follows a writable one");
        }
        let readable = &descs[..first_write];
        let Some(h) = readable.first().filter(|d| d.len as usize >= abi::HEADER_BYTES) else {
            return Outcome::fail(
                abi::ST_BAD_REQUEST,
                "the first descriptor is not a 32-byte request header",
            );
        };
        let mut hb = [0u8; abi::HEADER_BYTES];
        if self.mem.read_slice(&mut hb, GuestAddress(h.addr)).is_err() {
            return Outcome::fail(
                abi::ST_BAD_REQUEST,
                format!("header at {:#x} is not in guest memory", h.addr),
            );
        }
        *header = abi::RequestHeader::from_bytes(&hb);
        match header.opcode {
            abi::OP_NOP => Outcome::default(),
            abi::OP_RUN => self.run(&readable[1..], header),
            abi::OP_REGISTER => self.register(&readable[1..]),
            abi::OP_RUN_REGISTERED => match self.registered(header.handle) {
                Ok(p) => self.execute(p, header),
                Err(o) => o,
            },
            abi::OP_UNREGISTER => match self.registered(header.handle) {
                Ok(_) => {
                    self.programs[header.handle as usize] = None;
                    self.programs_changed.insert(header.handle as usize);
                    Outcome::default()
                }
                Err(o) => o,
            },
            op => Outcome::fail(abi::ST_UNKNOWN_OPCODE, format!("unknown opcode {op}")),
        }
    }

    /// Copies the program out of guest memory, decodes and verifies it
    /// against the current configuration.
    pub(super) fn load_verified(&self, payload: &[Desc]) -> Result<Program, Outcome> {
        let Some(spec) = self.config else {
            return Err(Outcome::fail(abi::ST_NOT_CONFIGURED, "the vNPU is released; configure it first"));
        };
        let total: u64 = payload.iter().map(|d| u64::from(d.len)).sum();
        if total > u64::from(abi::MAX_PROGRAM_BYTES) {
            return Err(Outcome::fail(
                abi::ST_TOO_LARGE,
                format!("program of {total} bytes, limit {}", abi::MAX_PROGRAM_BYTES),
            ));
        }
        // Copied out first: the guest cannot change what was checked.
        let Ok(total) = usize::try_from(total) else {
            return Err(Outcome::fail(abi::ST_TOO_LARGE, "program larger than this host's address space"));
        };
        let mut bytes = vec![0u8; total];
        let mut at = 0usize;
        for d in payload {
            let end = at + d.len as usize;
            if self.mem.read_slice(&mut bytes[at..end], GuestAddress(d.addr)).is_err() {
                return Err(Outcome::fail(
                    abi::ST_BAD_REQUEST,
                    format!("program buffer [{:#x}, +{:#x}) is not in guest memory", d.addr, d.len),
                ));
            }
            at = end;
        }
        let program =
            Program::decode(&bytes).map_err(|e| Outcome::fail(abi::ST_BAD_PROGRAM, e.to_string()))?;
        if let Err(e) = npu_model::verify(&program, &self.limits(&spec)) {
            let detail = e.position().map_or(NO_DETAIL, |(s, i)| crate::position_detail(s, i));
            return Err(Outcome {
                status: abi::ST_VERIFY_FAILED,
                detail,
                report: None,
                message: e.to_string(),
            });
        }
        Ok(program)
    }

    /// What the verifier checks a program against: `spec` and the guest
    /// memory mapped now.
    pub(super) fn limits(&self, spec: &VnpuSpec) -> npu_model::VnpuLimits {
        spec.limits(guest_ranges(&self.mem), self.borrow_cap(spec))
    }

    /// The vNPU's borrowing cap per core (SAs, VUs).
    pub(super) fn borrow_cap(&self, spec: &VnpuSpec) -> (u32, u32) {
        vnpu_spec::Qos { borrow: self.opts.borrow, ..Default::default() }.borrow_cap(spec)
    }

    /// `RUN`: load, verify, execute.
    pub(super) fn run(&mut self, payload: &[Desc], header: &abi::RequestHeader) -> Outcome {
        match self.load_verified(payload) {
            Ok(program) => self.execute(Arc::new(program), header),
            Err(o) => o,
        }
    }

    /// `REGISTER`: load and verify once; the handle is in `detail`.
    pub(super) fn register(&mut self, payload: &[Desc]) -> Outcome {
        let program = match self.load_verified(payload) {
            Ok(p) => p,
            Err(o) => return o,
        };
        let Some(slot) = (0..abi::MAX_REGISTERED).find(|&i| self.programs.get(i).is_none_or(Option::is_none))
        else {
            return Outcome::fail(
                abi::ST_NO_SPACE,
                format!("all {} program handles are in use", abi::MAX_REGISTERED),
            );
        };
        let held: usize = self.programs.iter().flatten().map(|p| p.instruction_count()).sum();
        let count = program.instruction_count();
        if held.saturating_add(count) > abi::MAX_REGISTERED_INSTRUCTIONS {
            return Outcome::fail(
                abi::ST_NO_SPACE,
                format!(
                    "registered programs hold {held} instructions; {count} more would pass the limit of {}",
                    abi::MAX_REGISTERED_INSTRUCTIONS
                ),
            );
        }
        if slot >= self.programs.len() {
            self.programs.resize_with(slot + 1, || None);
        }
        self.programs[slot] = Some(Arc::new(program));
        self.programs_changed.insert(slot);
        Outcome {
            status: abi::ST_OK,
            detail: u32::try_from(slot).unwrap_or(NO_DETAIL),
            report: None,
            message: String::new(),
        }
    }

    pub(super) fn registered(&self, handle: u32) -> Result<Arc<Program>, Outcome> {
        self.programs.get(handle as usize).and_then(Clone::clone).ok_or_else(|| {
            Outcome::fail(abi::ST_BAD_HANDLE, format!("no program is registered under handle {handle}"))
        })
    }

    /// Runs a verified program on the header's core.
    pub(super) fn execute(&mut self, program: Arc<Program>, header: &abi::RequestHeader) -> Outcome {
        let Some(spec) = self.config else {
            return Outcome::fail(abi::ST_NOT_CONFIGURED, "the vNPU is released; configure it first");
        };
        let Some(Some(core_slot)) = usize::try_from(header.core).ok().map(|c| self.cores.get(c).map(|_| c))
        else {
            let n = spec.cores();
            return Outcome::fail(
                abi::ST_BAD_CORE,
                format!("core {} does not exist ({n} cores)", header.core),
            );
        };
        let budget = match header.max_cycles {
            0 => DEFAULT_BUDGET,
            n => n.min(MAX_BUDGET),
        };
        let cap = self.borrow_cap(&spec);
        if self.cores[core_slot].is_none() {
            self.cores[core_slot] = Some(self.core_memory(core_slot, &spec));
        }
        let Some(core) = self.cores[core_slot].as_mut() else {
            return Outcome::fail(abi::ST_EXEC_FAULT, format!("core {core_slot} has no memory"));
        };
        let result = if let Some(shared) = self.opts.cores.get(core_slot).cloned() {
            // Lend the core's memory to the shared physical core for the batch.
            let lent = std::mem::replace(core, Core { sram: Sram::new(0), hbm: LazyHbm::new(0) });
            let claim = npu_board_runtime::Claim {
                sa: spec.sa_per_core(),
                vu: spec.vu_per_core(),
                priority: self.opts.priority,
                slo_cycles: self.opts.slo_us.saturating_mul(u64::from(self.board.clock_mhz)),
                borrow: npu_board_runtime::Engines::new(cap.0, cap.1),
            };
            // Co-located tenants wait for this batch: a tighter budget.
            let budget = budget.min(self.opts.shared_max_cycles.max(1));
            let host_work = self.opts.shared_max_host_work;
            match shared.run(
                &self.name,
                claim,
                program,
                lent,
                Box::new(
                    GuestRam::with_files(&self.mem, self.opts.guest_files.clone())
                        .logged(Arc::clone(&self.shared.write_log)),
                ),
                budget,
                host_work,
            ) {
                Some((back, r, _, _)) => {
                    *core = back;
                    r
                }
                None => return Outcome::fail(abi::ST_EXEC_FAULT, "the physical core stopped"),
            }
        } else {
            let mut guest = GuestRam::with_files(&self.mem, self.opts.guest_files.clone())
                .logged(Arc::clone(&self.shared.write_log));
            let mem = CoreMemory { sram: &mut core.sram, hbm: &mut core.hbm, guest: &mut guest };
            run_program(&self.board, &program, Some(mem), Some(budget))
        };
        if self.mem_watch.as_ref().is_some_and(crate::MemoryWatch::lost) {
            return Outcome::fail(
                abi::ST_EXEC_FAULT,
                "guest memory behind a DMA mapping was lost while the request ran (a hole punched in it); its data is not trusted",
            );
        }
        match result {
            Ok(report) => {
                self.counters.add(header.core, &report);
                Outcome { status: abi::ST_OK, detail: 0, report: Some(report), message: String::new() }
            }
            Err(e) => {
                let (status, detail) = match &e {
                    ExecError::Budget { .. } | ExecError::HostWork { .. } => {
                        (abi::ST_BUDGET_EXHAUSTED, NO_DETAIL)
                    }
                    ExecError::Kernel { stream, index, .. } | ExecError::Deadlock { stream, index, .. } => {
                        (abi::ST_EXEC_FAULT, crate::position_detail(*stream, *index))
                    }
                };
                Outcome { status, detail, report: None, message: e.to_string() }
            }
        }
    }
}

/// The guest address ranges `mem` covers, regions that meet merged into
/// one range: a DMA access may cross from one region into the next (a
/// VMM with a vIOMMU maps a buffer contiguous in guest addresses page by
/// page from wherever its pages are), and vm-memory's accessors cross
/// such a boundary.
pub(crate) fn guest_ranges(mem: &GuestMemoryMmap<()>) -> Vec<std::ops::Range<u64>> {
    let mut out: Vec<std::ops::Range<u64>> = Vec::new();
    for r in mem.iter() {
        let (start, end) = (r.start_addr().0, r.start_addr().0.saturating_add(r.len()));
        match out.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ => out.push(start..end),
        }
    }
    out
}
