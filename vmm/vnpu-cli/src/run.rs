//! `vnpu run`: one VM on /dev/kvm with its vNPUs, in-process or served by
//! a board daemon (`docs/cli.md`, `docs/vfio-user.md`).

use std::path::PathBuf;

use crate::{board, manage, parse_vnpu_arg, CliError, VnpuArg};

const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 acpi=off";

/// The arguments of `vnpu run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The guest ELF (e.g. guest-images/target/x86_64-unknown-none/release/hello).
    #[arg(long)]
    pub guest: Option<PathBuf>,
    /// A Linux kernel to boot instead (bzImage, e.g. Debian's
    /// /boot/vmlinuz-*, or an ELF vmlinux), by the 64-bit boot protocol.
    #[arg(long, conflicts_with = "guest")]
    pub kernel: Option<PathBuf>,
    /// The Linux guest's initramfs (with --kernel).
    #[arg(long, requires = "kernel", conflicts_with = "guest")]
    pub initrd: Option<PathBuf>,
    /// The Linux kernel command line (with --kernel).
    #[arg(long, requires = "kernel", conflicts_with = "guest", default_value = DEFAULT_CMDLINE)]
    pub cmdline: String,
    /// Guest memory, 2M to 1G for an ELF guest, to 3G for a Linux kernel (e.g. 256M).
    #[arg(long, default_value = "256M", value_parser = vnpu_spec::parse_size)]
    pub memory: u64,
    /// A vNPU for the VM, repeatable: `sa=N,vu=M,sram=SIZE,hbm=SIZE[,cores=C][,chips=K]`,
    /// `type=small|medium|large`, `uuid=UUID` of a started instance
    /// (`vnpu create` / `vnpu start`; docs/management.md; attached
    /// through the board daemon when `vnpu daemon` serves it at
    /// STATE_DIR/sockets/UUID.sock, else in-process), or
    /// `socket=PATH` of a vfio-user socket (docs/vfio-user.md).
    /// Each becomes a PCI function (daemon-served ones after the others).
    #[arg(long = "vnpu", value_parser = parse_vnpu_arg)]
    pub vnpus: Vec<VnpuArg>,
    /// State directory of the vNPU manager, for `--vnpu uuid=...`
    /// (default: $VNPU_STATE_DIR, else ~/.local/state/vnpu).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Board config file (TOML, docs/board-config.md); default: the built-in board.
    #[arg(long)]
    pub board: Option<PathBuf>,
    /// After serving requests, each vNPU worker keeps polling its ring
    /// this many microseconds (doorbells suppressed) before sleeping;
    /// 0 = never poll (lowest host CPU use, higher latency).
    #[arg(long, default_value_t = vnpu_device::DEFAULT_POLL_US)]
    pub poll_us: u64,
    /// When the board daemon serving a vNPU hangs up (it died, or is being
    /// restarted or upgraded), wait this many seconds for it to come back
    /// on the same socket and resume the device session (the guest's
    /// device accesses wait meanwhile); after that the device reads as
    /// failed. 0: fail at once.
    #[arg(long, default_value_t = vnpu_vm::remote::DEFAULT_RECONNECT.as_secs())]
    pub reconnect_s: u64,
    /// Serve a unix socket at this path on which `vnpu snapshot` asks the
    /// running VM for a snapshot and `vnpu migrate` moves it
    /// (docs/migration.md). Bare-metal guests only, so far.
    #[arg(long)]
    pub api_socket: Option<PathBuf>,
}

/// Boots the VM and returns the exit code its guest asked for.
pub fn run_vm(args: RunArgs) -> Result<u8, CliError> {
    let RunArgs {
        guest,
        kernel,
        initrd,
        cmdline,
        memory,
        vnpus,
        state_dir,
        board: path,
        poll_us,
        reconnect_s,
        api_socket,
    } = args;
    let b = board(&path)?;
    let dir = manage::state_dir(&state_dir);
    let (vnpus, remote) = split_remote(vnpus, &dir);
    // What a migration's destination needs to admit each daemon-served vNPU.
    let remote_shapes = remote
        .iter()
        .map(|(_, u)| vnpu_vm::RemoteShape {
            uuid: u.clone(),
            spec: u.as_ref().and_then(|u| manage::active_spec(&dir, &b, u).ok()),
        })
        .collect();
    let remote_vnpus = remote.into_iter().map(|(p, _)| p).collect();
    // Managed in-process instances: (index among the vNPUs, UUID) to follow.
    let managed: Vec<(usize, String)> = vnpus
        .iter()
        .enumerate()
        .filter_map(|(i, v)| match v {
            VnpuArg::Uuid(u) => Some((i, u.clone())),
            _ => None,
        })
        .collect();
    let vnpus = vnpus
        .into_iter()
        .filter_map(|v| match v {
            VnpuArg::Spec(s) => Some(Ok(s)),
            VnpuArg::Uuid(u) => Some(manage::active_spec(&dir, &b, &u).map_err(CliError::Usage)),
            VnpuArg::Socket(_) => None,
        })
        .collect::<Result<Vec<_>, _>>()?;
    let linux = kernel.is_some().then_some(vnpu_vm::LinuxBoot { initrd, cmdline });
    let cfg = vnpu_vm::VmConfig {
        memory,
        // clap requires one of the two.
        guest: guest.or(kernel).unwrap_or_default(),
        vnpus,
        board: b,
        device: vnpu_device::DeviceOptions {
            poll: std::time::Duration::from_micros(poll_us),
            ..Default::default()
        },
        shared_cores: Vec::new(),
        name: "vm".into(),
        linux,
        remote_vnpus,
        remote_shapes,
        reconnect: std::time::Duration::from_secs(reconnect_s),
        payload: None,
    };
    let mut vm = vnpu_vm::Vm::new(&cfg, std::io::stdout())?;
    if !managed.is_empty() {
        let handles = vm.grant_handles();
        let follow = managed
            .into_iter()
            .filter_map(|(i, u)| Some((u, handles.get(i)?.clone(), *cfg.vnpus.get(i)?)))
            .collect();
        manage::follow_remaps(dir.clone(), cfg.board.clone(), follow)
            .map_err(|e| CliError::Usage(format!("cannot follow remaps: {e}")))?;
    }
    // A Linux guest's console takes our standard input.
    if cfg.linux.is_some() {
        vm.forward_input(std::io::stdin()).map_err(|e| CliError::Usage(format!("console input: {e}")))?;
    }
    if let Some(p) = &api_socket {
        crate::snapshot::serve_api(p, vm.pause_handle())?;
    }
    finish(vm.run())
}

/// The process exit code for how a VM's run ended.
pub fn finish(run: Result<u32, vnpu_vm::VmError>) -> Result<u8, CliError> {
    let code = match run {
        Err(vnpu_vm::VmError::StoppedAfterSnapshot) => {
            eprintln!("vnpu: the VM stopped after its snapshot; `vnpu restore DIR` runs it on");
            return Ok(0);
        }
        Err(vnpu_vm::VmError::MigratedAway) => {
            eprintln!("vnpu: the VM was migrated; it runs on in the destination's `vnpu receive`");
            return Ok(0);
        }
        r => r?,
    };
    // Exit codes above 255 are reported and truncated, as a shell would.
    if code > 255 {
        eprintln!(
            "vnpu: guest exit code {code} does not fit a process exit code; exiting with {}",
            code & 0xff
        );
    }
    Ok((code & 0xff) as u8)
}

/// The `--vnpu`s served in this process, and the vfio-user sockets of
/// those a board daemon serves. A started instance that a daemon serves
/// is attached through it (docs/vfio-user.md), otherwise it runs here.
/// Each is resolved once, so a socket that appears or goes meanwhile
/// cannot drop a vNPU. A daemon's vNPU comes with its instance's UUID,
/// if it was given by one.
type Remote = (PathBuf, Option<String>);
fn split_remote(vnpus: Vec<VnpuArg>, dir: &std::path::Path) -> (Vec<VnpuArg>, Vec<Remote>) {
    let mut remote_vnpus: Vec<Remote> = Vec::new();
    let local: Vec<VnpuArg> = vnpus
        .into_iter()
        .filter_map(|v| {
            let socket = match &v {
                VnpuArg::Socket(p) => Some(p.clone()),
                VnpuArg::Uuid(u) => {
                    let sockets = vnpu_manager::control::default_socket_dir(dir);
                    let p = vnpu_manager::control::instance_socket(&sockets, u);
                    if !p.exists() {
                        eprintln!(
                            "vnpu: no board daemon serves {u} at {}; its vNPU runs in this process",
                            p.display()
                        );
                    }
                    Some(p).filter(|p| p.exists())
                }
                VnpuArg::Spec(_) => None,
            };
            match socket {
                Some(p) => {
                    let uuid = match &v {
                        VnpuArg::Uuid(u) => Some(u.clone()),
                        _ => None,
                    };
                    remote_vnpus.push((p, uuid));
                    None
                }
                None => Some(v),
            }
        })
        .collect();
    (local, remote_vnpus)
}
