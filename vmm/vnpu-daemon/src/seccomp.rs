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
//! A vNPU instance's threads (its vfio-user connection and the worker it
//! starts), which run what a tenant sends, are narrowed further
//! ([`confine_instance_thread`]): no sockets, no file creation, no other
//! process (`tgkill` of their own process only, `clone` of threads
//! only), no executable mappings, no memfds; and Landlock confines their
//! file accesses to the files of their session folder (so neither
//! `/proc/PID/mem` nor any other file of the host can be opened), their
//! signals to their own domain, and TCP to nothing.
//!
//! A call outside the list fails with `EPERM` by default ([`Mode::Errno`]:
//! a path the trace missed degrades that request instead of killing every
//! tenant's device); [`Mode::Kill`] kills the process instead, and
//! [`Mode::Off`] installs nothing (`vnpu daemon --seccomp`).

use std::collections::BTreeMap;
use std::path::Path;

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
    #[error("building the seccomp filter's argument rules: {0}")]
    Rule(#[source] seccompiler::BackendError),
    #[error("confining the instance's files with Landlock: {0}")]
    Landlock(#[source] landlock::RulesetError),
    #[error("confining the instance's files with Landlock: {0}: {1}")]
    LandlockPath(std::path::PathBuf, #[source] landlock::PathFdError),
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
    // Only ever narrow what a thread may do (the per-thread filters and
    // the instance threads' Landlock domain).
    libc::SYS_seccomp,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_restrict_self,
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
/// rename, remove, lock, sync or change the mode of files, make memfds.
/// A vNPU instance's threads (its vfio-user connection and the worker it
/// starts) may not: what they serve reaches them as descriptors.
const MANAGEMENT: &[i64] = &[
    libc::SYS_memfd_create,
    libc::SYS_open,
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
    compile(calls.map(|n| (n, Vec::new())).collect(), mismatch(mode), SeccompAction::Allow)
}

/// The filter of `rules`: a call they match takes `matched`, any other
/// `otherwise`.
fn compile(
    rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>>,
    otherwise: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let filter =
        SeccompFilter::new(rules, otherwise, matched, TargetArch::x86_64).map_err(SeccompError::Build)?;
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
/// instance's threads need, when the daemon installed its filter;
/// otherwise (a daemon in a test or a benchmark's process) does nothing.
/// `files` is the only folder they may open files in (the session's),
/// `None` for none.
pub fn confine_instance_thread(files: Option<&Path>) -> Result<(), SeccompError> {
    let Some(&mode) = INSTALLED.get() else { return Ok(()) };
    confine(mode, files).map(|_| ())
}

/// The instance threads' calls: [`CORE`] (no [`MANAGEMENT`] calls), with
/// the arguments of those that could reach beyond the process checked.
fn instance_program(mode: Mode) -> Result<BpfProgram, SeccompError> {
    use seccompiler::{SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompRule};
    let rule = |conds: Vec<Cond>| SeccompRule::new(conds).map_err(SeccompError::Rule);
    // `int` arguments are compared on their low 32 bits.
    let cond =
        |arg: u8, op: Op, value: u64| Cond::new(arg, Len::Dword, op, value).map_err(SeccompError::Rule);
    let pid = u64::from(std::process::id());
    let thread = u64::try_from(libc::CLONE_THREAD).unwrap_or(0);
    let exec = u64::try_from(libc::PROT_EXEC).unwrap_or(0);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = CORE.iter().map(|&n| (n, Vec::new())).collect();
    // A signal to its own process only (Rust's abort and thread exit).
    rules.insert(libc::SYS_tgkill, vec![rule(vec![cond(0, Op::Eq, pid)?])?]);
    // Threads of this process, never a new process.
    let flags = Cond::new(0, Len::Qword, Op::MaskedEq(thread), thread).map_err(SeccompError::Rule)?;
    rules.insert(libc::SYS_clone, vec![rule(vec![flags])?]);
    // No mapping may be executable (nor become so).
    rules.insert(libc::SYS_mmap, vec![rule(vec![cond(2, Op::MaskedEq(exec), 0)?])?]);
    rules.insert(libc::SYS_mprotect, vec![rule(vec![cond(2, Op::MaskedEq(exec), 0)?])?]);
    compile(rules, mismatch(mode), SeccompAction::Allow)
}

/// `clone3` passes its flags in memory a filter cannot read: it fails
/// with `ENOSYS`, and the C library falls back to `clone`, whose flags
/// [`instance_program`] checks.
fn no_clone3() -> Result<BpfProgram, SeccompError> {
    let enosys = SeccompAction::Errno(u32::try_from(libc::ENOSYS).unwrap_or(38));
    compile([(libc::SYS_clone3, Vec::new())].into(), SeccompAction::Allow, enosys)
}

/// Confines the calling thread's file accesses to `files` (read, write
/// and truncate the files in it, list it; create nothing, and nothing
/// else anywhere), its signals and abstract sockets to its own domain,
/// and TCP to nothing, as far as the kernel's Landlock supports (best
/// effort: an older kernel enforces less, which is logged). Says whether
/// the kernel enforces it at all.
fn landlock(files: Option<&Path>) -> Result<bool, SeccompError> {
    use landlock::{
        Access, AccessFs, AccessNet, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr,
        RulesetStatus, Scope, ABI,
    };
    let abi = ABI::V6;
    let ll = SeccompError::Landlock;
    let mut ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
        .and_then(|r| r.scope(Scope::from_all(abi)))
        .and_then(Ruleset::create)
        .map_err(ll)?;
    if let Some(dir) = files {
        let fd = PathFd::new(dir).map_err(|e| SeccompError::LandlockPath(dir.to_path_buf(), e))?;
        // No `MakeReg`: the daemon created every file they use
        // (`vnpu_device::prepare_files`).
        let access = AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::ReadDir | AccessFs::Truncate;
        ruleset = ruleset.add_rule(PathBeneath::new(fd, access)).map_err(ll)?;
    }
    let status = ruleset.restrict_self().map_err(ll)?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => {}
        RulesetStatus::PartiallyEnforced => {
            log::warn!("this kernel's Landlock enforces the instance threads' confinement only partly");
        }
        _ => log::warn!("this kernel has no Landlock: the instance threads' files are not confined"),
    }
    Ok(status.ruleset != RulesetStatus::NotEnforced)
}

/// Confines the calling thread; says whether its files are confined too
/// (the kernel has Landlock).
fn confine(mode: Mode, files: Option<&Path>) -> Result<bool, SeccompError> {
    // Landlock first: its calls (and the folder's `open`) go through the
    // filters installed after it.
    let confined = landlock(files)?;
    seccompiler::apply_filter(&instance_program(mode)?).map_err(SeccompError::Install)?;
    seccompiler::apply_filter(&no_clone3()?).map_err(SeccompError::Install)?;
    Ok(confined)
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

    /// An instance thread, confined (Landlock and the instance filter;
    /// per thread, so the test process stays as it was), can still do
    /// what serving needs (the files of its folder, memory, eventfds, a
    /// thread of its own) and nothing that reaches beyond its process or
    /// those files: new files, sockets, folders, files elsewhere
    /// (`/proc/self/mem` among them), another process, a new process,
    /// executable memory, memfds.
    #[test]
    fn an_instance_thread_reaches_nothing_beyond_its_process_and_folder() {
        let dir = std::env::temp_dir().join(format!("vnpu-seccomp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let outside = std::env::temp_dir().join(format!("vnpu-seccomp-outside-{}", std::process::id()));
        let _ = std::fs::remove_file(&outside);
        let (inside, d) = (dir.join("core0.sram"), dir.clone());
        let new_inside = dir.join("core1.sram");
        // Made by the daemon before it serves (`prepare_files`).
        std::fs::write(&inside, b"").unwrap();
        let out = outside.clone();
        let (checks, files_confined) = std::thread::spawn(move || -> (Vec<(&'static str, bool)>, bool) {
            let files_confined = confine(Mode::Errno, Some(&d)).unwrap();
            if !files_confined {
                eprintln!("this kernel has no Landlock: the file checks are skipped");
            }
            let open = |p: &std::path::Path, create: bool| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(create)
                    .truncate(false)
                    .open(p)
                    .is_ok()
            };
            let eperm = |r: libc::c_long| {
                r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
            };
            // SAFETY: plain system calls on no memory of ours but static
            // strings; a mapping that succeeds is unmapped below.
            let (sock, mkdir, efd, memfd, kill_init, exec_map, rw_ok) = unsafe {
                let map = |prot| {
                    libc::mmap(
                        std::ptr::null_mut(),
                        4096,
                        prot,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                let x = map(libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC);
                let rw = map(libc::PROT_READ | libc::PROT_WRITE);
                let x_failed = x == libc::MAP_FAILED;
                let rw_ok = rw != libc::MAP_FAILED;
                for m in [x, rw] {
                    if m != libc::MAP_FAILED {
                        libc::munmap(m, 4096);
                    }
                }
                (
                    libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0),
                    libc::mkdir(c"/tmp/vnpu-seccomp-test-dir".as_ptr(), 0o700),
                    libc::eventfd(0, 0),
                    eperm(libc::syscall(libc::SYS_memfd_create, c"x".as_ptr(), 0)),
                    eperm(libc::syscall(libc::SYS_tgkill, 1, 1, 0)),
                    x_failed,
                    rw_ok,
                )
            };
            // A new process: refused, so the child branch never runs (it
            // would only exit).
            // SAFETY: clone(2) with fork's flags and no stack of its own;
            // a child, if one were made, exits at once.
            let fork = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) };
            if fork == 0 {
                // SAFETY: ends a child without running the harness's code.
                unsafe { libc::_exit(0) };
            }
            let thread = std::thread::spawn(|| 7).join().ok() == Some(7);
            (
                vec![
                    ("open a file of its folder", open(&inside, true)),
                    ("create a file in its folder refused", !files_confined || !open(&new_inside, true)),
                    (
                        "open /proc/self/mem refused",
                        !files_confined || !open(std::path::Path::new("/proc/self/mem"), false),
                    ),
                    ("create a file elsewhere refused", !files_confined || !open(&out, true)),
                    ("socket refused", sock == -1),
                    ("mkdir refused", mkdir == -1),
                    ("eventfd", efd >= 0),
                    ("memfd_create refused", memfd),
                    ("signal to another process refused", kill_init),
                    ("executable mapping refused", exec_map),
                    ("read-write mapping", rw_ok),
                    ("new process refused", fork == -1),
                    ("a thread of its own", thread),
                ],
                files_confined,
            )
        })
        .join()
        .unwrap();
        let failed: Vec<_> = checks.iter().filter(|(_, ok)| !ok).map(|(what, _)| *what).collect();
        assert!(failed.is_empty(), "failed: {failed:?}");
        assert!(!files_confined || !outside.exists(), "a file was made outside the folder");
        let _ = std::fs::remove_file(&outside);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
