//! Who may manage the board: the control socket checks each client's
//! credentials (`SO_PEERCRED`) before it reads a request, as a privileged
//! service must not rely on the socket file's mode alone. Allowed: root,
//! the daemon's own user, and members (primary or supplementary) of the
//! group given with `vnpu daemon --control-group`.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// The peer of a UNIX stream: process, user and group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// The credentials the kernel recorded for `stream`'s peer at connect.
pub fn peer(stream: &UnixStream) -> std::io::Result<Peer> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    // `ucred` is 12 bytes: the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation)]
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `cred`, which
    // lives for the call, for a socket we own.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Peer { pid: cred.pid, uid: cred.uid, gid: cred.gid })
}

/// The gid of group `name`, if the host has it.
pub fn group_id(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: getgrnam(3) reads a NUL-terminated name; the result is read
    // at once, before any other call could reuse its static buffer.
    let g = unsafe { libc::getgrnam(c.as_ptr()) };
    // SAFETY: non-null results point to a valid `group`.
    (!g.is_null()).then(|| unsafe { (*g).gr_gid })
}

/// Whether `peer` may manage the board: root, the daemon's own user, or a
/// member of `group` (its primary group, or a supplementary one as
/// `/proc/PID/status` lists them).
pub fn allowed(peer: &Peer, group: Option<u32>) -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    let me = unsafe { libc::geteuid() };
    if peer.uid == 0 || peer.uid == me {
        return true;
    }
    let Some(g) = group else { return false };
    if peer.gid == g {
        return true;
    }
    std::fs::read_to_string(format!("/proc/{}/status", peer.pid))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .map(|l| l.split_whitespace().any(|x| x.parse() == Ok(g)))
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_its_process_and_root_or_the_daemons_user_may_manage() {
        let (a, _b) = UnixStream::pair().expect("pair");
        let p = peer(&a).expect("credentials");
        assert_eq!(p.pid, i32::try_from(std::process::id()).expect("pid"));
        assert!(allowed(&p, None));
        // SAFETY: geteuid(2) has no preconditions.
        let me = unsafe { libc::geteuid() };
        let other = Peer { pid: p.pid, uid: me.wrapping_add(12_345).max(1), gid: 54_321 };
        if other.uid != me {
            assert!(!allowed(&other, None), "a stranger without the group");
            assert!(allowed(&other, Some(54_321)), "a stranger in the group");
        }
        assert_eq!(group_id("root"), Some(0));
        assert_eq!(group_id("no-such-group-vnpu"), None);
    }
}
