//! Connection slots that a crowd of idle clients cannot all hold: when
//! every slot is taken, a newcomer takes the slot of the connection that
//! has been idle longest (no request in progress, idle for at least
//! [`Slots::min_idle`]), which is shut down. Honest clients send their
//! request as soon as they connect, so they are never idle that long; a
//! client that holds connections open without using them loses them to
//! whoever comes next, instead of locking everyone out until its
//! connections time out.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A connection's standing.
#[derive(Debug)]
struct State {
    /// A request is being read or answered.
    busy: AtomicBool,
    /// Milliseconds since the slots' epoch when it last became idle.
    idle_since: AtomicU64,
    /// Shut down to make room: not chosen again.
    evicted: AtomicBool,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    /// `None` when no duplicate could be made (descriptors exhausted):
    /// the connection holds its slot but cannot be evicted.
    fd: Option<OwnedFd>,
    state: Arc<State>,
}

impl Entry {
    /// Marks the connection evicted and shuts it down: its reads and
    /// writes fail, so its thread ends and drops its slot.
    fn shut_down(&self) {
        self.state.evicted.store(true, Ordering::SeqCst);
        if let Some(fd) = &self.fd {
            // SAFETY: shutdown(2) on the duplicate descriptor this entry
            // owns; it only ends the connection's traffic.
            unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

/// The slots of one listening socket.
#[derive(Debug)]
pub(crate) struct Slots {
    max: usize,
    min_idle: Duration,
    epoch: Instant,
    entries: Mutex<(u64, Vec<Entry>)>,
}

/// One admitted connection's slot, freed when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    id: u64,
    state: Arc<State>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Slots {
    /// `max` slots; a connection idle for `min_idle` may be evicted.
    pub fn new(max: usize, min_idle: Duration) -> Arc<Self> {
        Arc::new(Self { max, min_idle, epoch: Instant::now(), entries: Mutex::new((0, Vec::new())) })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A slot for the connection `fd` (a duplicate of its descriptor, kept
    /// to shut it down; `None` if none could be made), or `None` when
    /// every slot is held by a connection that is busy or was idle for less
    /// than `min_idle`.
    pub fn admit(self: &Arc<Self>, fd: Option<OwnedFd>) -> Option<Slot> {
        let now = self.now_ms();
        let min_idle = u64::try_from(self.min_idle.as_millis()).unwrap_or(u64::MAX);
        let mut guard = lock(&self.entries);
        let (next, entries) = &mut *guard;
        let held = entries.iter().filter(|e| !e.state.evicted.load(Ordering::SeqCst)).count();
        if held >= self.max {
            let victim = entries
                .iter()
                .filter(|e| {
                    e.fd.is_some()
                        && !e.state.evicted.load(Ordering::SeqCst)
                        && !e.state.busy.load(Ordering::SeqCst)
                })
                .map(|e| (e.state.idle_since.load(Ordering::SeqCst), e))
                .filter(|(since, _)| now.saturating_sub(*since) >= min_idle)
                .min_by_key(|(since, _)| *since)
                .map(|(_, e)| e)?;
            victim.shut_down();
            log::warn!(
                "a connection idle for {} ms gave its slot up to a new one",
                now - victim.state.idle_since.load(Ordering::SeqCst)
            );
        }
        *next += 1;
        let state = Arc::new(State {
            busy: AtomicBool::new(false),
            idle_since: AtomicU64::new(now),
            evicted: AtomicBool::new(false),
        });
        entries.push(Entry { id: *next, fd, state: Arc::clone(&state) });
        Some(Slot { slots: Arc::clone(self), id: *next, state })
    }

    /// Shuts every admitted connection down (a stop): their threads' reads
    /// and writes fail, so they end and drop their slots.
    pub fn shutdown_all(&self) {
        lock(&self.entries).1.iter().for_each(Entry::shut_down);
    }

    /// Connections admitted and not yet dropped (evicted ones included
    /// until their threads end).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.entries).1.len()
    }
}

impl Slot {
    /// A request is in progress: the connection may not be evicted.
    pub fn busy(&self) {
        self.state.busy.store(true, Ordering::SeqCst);
    }

    /// The request is done: the connection is idle from now on.
    pub fn idle(&self) {
        self.state.idle_since.store(self.slots.now_ms(), Ordering::SeqCst);
        self.state.busy.store(false, Ordering::SeqCst);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.slots.entries).1.retain(|e| e.id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    fn pair() -> (UnixStream, Option<OwnedFd>) {
        let (a, b) = UnixStream::pair().unwrap();
        (a, Some(OwnedFd::from(b)))
    }

    #[test]
    fn the_longest_idle_connection_makes_room_and_busy_or_fresh_ones_do_not() {
        let slots = Slots::new(2, Duration::from_millis(50));
        let (mut peer1, fd1) = pair();
        let (_peer2, fd2) = pair();
        let s1 = slots.admit(fd1).unwrap();
        let s2 = slots.admit(fd2).unwrap();
        // Both fresh: nobody can be evicted yet.
        assert!(slots.admit(pair().1).is_none());
        std::thread::sleep(Duration::from_millis(80));
        // Both idle long enough; the second is busy: the first goes.
        s2.busy();
        let (_peer3, fd3) = pair();
        let s3 = slots.admit(fd3).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(peer1.read(&mut b).unwrap(), 0, "the evicted connection was shut down");
        drop(s1);
        assert_eq!(slots.len(), 2);
        // The busy one stays, the new one is fresh: no room.
        assert!(slots.admit(pair().1).is_none());
        s2.idle();
        drop((s2, s3));
        assert_eq!(slots.len(), 0);
    }
}
