//! The board daemon's system-call filter (rust-vmm's `seccompiler`), as
//! Firecracker and Cloud Hypervisor install theirs: once the daemon has
//! started, every thread of the process may make only the calls below.
//!
//! The list is what the daemon was seen to call (`strace -f` over the
//! daemon tests: control requests, vfio-user clients with memory and
//! interrupts, VMs running inference, metrics, descriptor exhaustion,
//! stops), plus the calls the Rust runtime makes on rare paths (thread
//! exit, signal return, sleeping). Left out, among others: `execve`,
//! `fork`, `ptrace`, `mount`, `setuid` and the other credential calls,
//! `kexec_load`, `bpf`, `perf_event_open`, `init_module`, `keyctl`,
//! `userfaultfd`: a daemon compromised through a client could not run a
//! program, change who it is or reach into the kernel beyond what it
//! already does.
//!
//! A call outside the list fails with `EPERM` by default ([`Mode::Errno`]:
//! a path the trace missed degrades that request instead of killing every
//! tenant's device); [`Mode::Kill`] kills the process instead, and
//! [`Mode::Off`] installs nothing (`vnpu daemon --seccomp`).

use std::collections::BTreeMap;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
use thiserror::Error;

/// What a call outside the list does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Mode {
    /// Fails with `EPERM`.
    #[default]
    Errno,
    /// Kills the daemon (`SECCOMP_RET_KILL_PROCESS`).
    Kill,
    /// No filter.
    Off,
}

/// Why the filter could not be installed.
#[derive(Debug, Error)]
pub enum SeccompError {
    #[error("building the seccomp filter: {0}")]
    Build(#[source] seccompiler::BackendError),
    #[error("compiling the seccomp filter: {0}")]
    Compile(#[source] seccompiler::BackendError),
    #[error("installing the seccomp filter: {0}")]
    Install(#[source] seccompiler::Error),
}

/// The calls every daemon thread may make, a vNPU instance's threads
/// included.
const CORE: &[i64] = &[
    // Memory.
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_memfd_create,
    libc::SYS_ftruncate,
    // A vNPU's kept memories (`vnpu_device::SessionStore`).
    libc::SYS_fallocate,
    // Threads, time, signals.
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_prctl,
    // Only ever narrows what a thread may do (the per-thread filters).
    libc::SYS_seccomp,
    libc::SYS_getrandom,
    // Identity (read only) and limits.
    libc::SYS_geteuid,
    libc::SYS_getuid,
    libc::SYS_getegid,
    libc::SYS_getgid,
    libc::SYS_getgroups,
    libc::SYS_prlimit64,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    // Descriptors and files (state directory, sockets, board files).
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_close,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_ioctl,
    libc::SYS_openat,
    libc::SYS_open,
    libc::SYS_stat,
    libc::SYS_fstat,
    libc::SYS_lstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_access,
    libc::SYS_readlink,
    libc::SYS_getcwd,
    libc::SYS_getdents64,
    libc::SYS_pipe2,
    libc::SYS_eventfd2,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    // Sockets the daemon was handed or accepted.
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
];

/// The calls only the daemon's management threads may make (control,
/// accepting, metrics, the state directory): make sockets, and create,
/// rename, remove, lock, sync or change the mode of files. A vNPU
/// instance's threads (its vfio-user connection and the worker it starts)
/// may not: what they serve reaches them as descriptors.
const MANAGEMENT: &[i64] = &[
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_flock,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
];

/// The calls every daemon thread may make.
fn allowed() -> impl Iterator<Item = i64> {
    CORE.iter().chain(MANAGEMENT).copied()
}

/// The compiled filter: the calls of [`allowed`] pass, others as `mode`.
fn program(mode: Mode) -> Result<BpfProgram, SeccompError> {
    program_of(allowed(), mode)
}

/// The mode [`install`] installed, for the per-thread filters.
static INSTALLED: std::sync::OnceLock<Mode> = std::sync::OnceLock::new();

fn program_of(calls: impl Iterator<Item = i64>, mode: Mode) -> Result<BpfProgram, SeccompError> {
    let rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> = calls.map(|n| (n, Vec::new())).collect();
    let filter = SeccompFilter::new(rules, mismatch(mode), SeccompAction::Allow, TargetArch::x86_64)
        .map_err(SeccompError::Build)?;
    filter.try_into().map_err(SeccompError::Compile)
}

fn mismatch(mode: Mode) -> SeccompAction {
    match mode {
        Mode::Kill => SeccompAction::KillProcess,
        _ => SeccompAction::Errno(u32::try_from(libc::EPERM).unwrap_or(1)),
    }
}

/// Installs the filter on every thread of the process (`mode` says what a
/// call outside the list does). Call it once the daemon has read what it
/// needs to start; it cannot be undone.
pub fn install(mode: Mode) -> Result<(), SeccompError> {
    if mode == Mode::Off {
        return Ok(());
    }
    seccompiler::apply_filter_all_threads(&program(mode)?).map_err(SeccompError::Install)?;
    let _ = INSTALLED.set(mode);
    Ok(())
}

/// Narrows the calling thread (and the threads it starts) to what a vNPU
/// instance's threads need ([`CORE`]: no [`MANAGEMENT`] calls), when the
/// daemon installed its filter; otherwise (a daemon in a test or a
/// benchmark's process) does nothing.
pub fn confine_instance_thread() -> Result<(), SeccompError> {
    let Some(&mode) = INSTALLED.get() else { return Ok(()) };
    seccompiler::apply_filter(&program_of(CORE.iter().copied(), mode)?).map_err(SeccompError::Install)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The filter compiles; installed in a child process, it refuses
    /// `execve` with EPERM (of `/bin/false`, so an `execve` let through
    /// fails the test too) and lets the allowed calls through.
    #[test]
    fn the_filter_refuses_execve_and_allows_the_daemons_calls() {
        assert!(program(Mode::Kill).is_ok());
        // Compiled before the fork: the child of a threaded process must
        // not allocate.
        let bpf = program(Mode::Errno).unwrap();
        // SAFETY: fork(2) in a test process; the child only makes system
        // calls and exits with _exit, never returning into the harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = if seccompiler::apply_filter(&bpf).is_err() {
                10
            } else {
                let argv = [std::ptr::null::<libc::c_char>()];
                // SAFETY: execve with a NUL-terminated path and empty
                // argument and environment arrays; it must fail.
                let r = unsafe { libc::execve(c"/bin/false".as_ptr(), argv.as_ptr(), argv.as_ptr()) };
                let errno = std::io::Error::last_os_error().raw_os_error();
                // SAFETY: getpid and a zero-length write on stderr are
                // allowed calls.
                let allowed =
                    unsafe { libc::getpid() } > 0 && unsafe { libc::write(2, c"".as_ptr().cast(), 0) } == 0;
                if r == -1 && errno == Some(libc::EPERM) && allowed {
                    0
                } else {
                    11
                }
            };
            // SAFETY: ends the child without running the harness's code.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "the child died: {status:#x}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "10: not installed; 11: execve not refused or a call refused"
        );
    }

    /// The instance filter, stacked on the daemon's in a child process,
    /// refuses sockets and file creation and still allows what serving
    /// needs (reads, writes, memory, eventfds).
    #[test]
    fn the_instance_filter_refuses_sockets_and_file_creation() {
        let base = program(Mode::Errno).unwrap();
        let narrow = program_of(CORE.iter().copied(), Mode::Errno).unwrap();
        // SAFETY: fork(2) in a test process; the child only makes system
        // calls and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let applied =
                seccompiler::apply_filter(&base).is_ok() && seccompiler::apply_filter(&narrow).is_ok();
            // SAFETY: plain system calls on no memory but a static string.
            let (sock, dir, efd) = unsafe {
                (
                    libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0),
                    libc::mkdir(c"/tmp/vnpu-seccomp-test-dir".as_ptr(), 0o700),
                    libc::eventfd(0, 0),
                )
            };
            let code = if applied && sock == -1 && dir == -1 && efd >= 0 { 0 } else { 12 };
            // SAFETY: ends the child without running the harness's code.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status:#x}");
    }
}
