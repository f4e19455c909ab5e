#!/usr/bin/env python3
"""Live migration of a VM with its vNPU (docs/migration.md, "Live
migration"): the `resume-hbm` guest (its vNPU's 1 GiB of HBM written,
then one chunk more after every round of the digits) or the `resume`
guest (weights in SRAM, HBM unused) is moved back and forth with `vnpu
migrate` between `vnpu receive` processes, in-process or (--daemon)
between two board daemons with their own state directories. A VM whose
guest nears its end is let finish (it must exit 0: every answer equal to
its CPU's, and for resume-hbm all of HBM read back as written) and a new
one takes its place, until N migrations are measured. Reports
min/median/max of:

  downtime  vCPU stop to the destination's word that the VM runs there
  total     the request to the end
  precopy   the request to the vCPU's stop (guest RAM and HBM pre-copy)
  MiB       bytes of the migration stream
  stop MiB  device state sent while stopped

For scale, the published figures of NVIDIA vGPU live migration on
vSphere 7 (VMware, "vMotion of vGPU VMs", 2020): a stun of about 2 s for
1 GB of used framebuffer and 39 s for 32 GB, over 10 GbE. Here the
stream is a unix socket on one machine: the ratio is not a like-for-like
comparison of networks, only of what stops the VM.

  cargo build --release -p vnpu-cli && bash scripts/build-guests.sh
  python3 scripts/bench-migration.py [--migrations 10] [--guest resume-hbm|resume] [--daemon] [--json FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUESTS = os.path.join(ROOT, "guest-images/target/x86_64-unknown-none/release")

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--migrations", type=int, default=10)
p.add_argument("--guest", default="resume-hbm", choices=["resume-hbm", "resume"])
p.add_argument("--bin", default=os.path.join(ROOT, "target/release/vnpu"))
p.add_argument("--daemon", action="store_true", help="the vNPU served by board daemons, moved between two of them")
p.add_argument("--json", help="write the figures here")
a = p.parse_args()
guest = os.path.join(GUESTS, a.guest)
for f in (a.bin, guest):
    if not os.path.exists(f):
        sys.exit(f"bench-migration: {f} missing (cargo build --release -p vnpu-cli; bash scripts/build-guests.sh)")

tmp = tempfile.mkdtemp(prefix="vnpu-bench-migration-")
hosts = [os.path.join(tmp, "a"), os.path.join(tmp, "b")]
daemons = []


class Proc:
    """A vnpu process whose stdout is gathered as it comes."""

    def __init__(self, args):
        self.p = subprocess.Popen([a.bin] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        for src, dst in ((self.p.stdout, self.out), (self.p.stderr, self.err)):
            threading.Thread(target=lambda s=src, d=dst: [d.append(line) for line in s], daemon=True).start()

    def said(self):
        return "".join(self.out)

    def wait_for(self, text, limit=300):
        t = time.time()
        while text not in self.said():
            if self.p.poll() is not None and text not in self.said():
                sys.exit(f"bench-migration: ended before {text!r}:\n{self.said()}{''.join(self.err)}")
            if time.time() - t > limit:
                sys.exit(f"bench-migration: no {text!r} after {limit} s")
            time.sleep(0.005)

    def last_round(self):
        rounds = [line for line in self.out if line.startswith("round ")]
        return int(rounds[-1].split()[1].rstrip(":")) if rounds else -1


def wait_path(path, limit=60):
    t = time.time()
    while not os.path.exists(path):
        if time.time() - t > limit:
            sys.exit(f"bench-migration: no {path}")
        time.sleep(0.002)


uuid = None
if a.daemon:
    for h in hosts:
        os.makedirs(h)
    uuid = subprocess.check_output([a.bin, "create", "--type", "small", "--state-dir", hosts[0]], text=True).strip()
    for h in hosts:
        daemons.append(subprocess.Popen([a.bin, "daemon", "--state-dir", h, "--socket-dir", os.path.join(h, "sockets")],
                                        stdout=subprocess.DEVNULL, stderr=open(os.path.join(h, "log"), "w")))
    wait_path(os.path.join(hosts[0], "sockets", f"{uuid}.sock"))
    wait_path(os.path.join(hosts[1], "sockets", "control.sock"))

figures = []
n = 0
vms = 0
try:
    while len(figures) < a.migrations:
        vms += 1
        api = os.path.join(tmp, f"api-{n}.sock")
        args = ["run", "--memory", "64M", "--guest", guest, "--api-socket", api]
        args += ["--vnpu", f"uuid={uuid}", "--state-dir", hosts[0]] if a.daemon else ["--vnpu", "type=small"]
        chain = [Proc(args)]
        wait_path(api)
        if a.guest == "resume-hbm":
            chain[0].wait_for("hbm filled")
        chain[0].wait_for("round 3:")
        here = 0
        while len(figures) < a.migrations and max(pr.last_round() for pr in chain) < 100:
            n += 1
            to = 1 - here if a.daemon else 0
            listen = os.path.join(tmp, f"in-{n}.sock")
            nxt = os.path.join(tmp, f"api-{n}.sock")
            r = Proc(["receive", "--listen", listen, "--state-dir", hosts[to], "--api-socket", nxt])
            wait_path(listen)
            o = subprocess.run([a.bin, "migrate", "--api-socket", api, "--to", listen, "--json"],
                               capture_output=True, text=True)
            if o.returncode != 0:
                src = chain[-1]
                sys.exit(f"bench-migration: migration {n} failed: {o.stdout}{o.stderr}\n--- the destination ---\n"
                         f"{''.join(r.err)}\n--- the source ---\n{''.join(src.out[-3:])}{''.join(src.err)}")
            m = json.loads(o.stdout)
            figures.append(m)
            print(f"migration {len(figures)}: downtime {m['downtime_ms']:.1f} ms, total {m['total_ms']:.0f} ms, "
                  f"{m['bytes'] / 2**20:.1f} MiB ({m['precopy_device_bytes'] / 2**20:.1f} MiB of HBM pre-copied, "
                  f"{m['device_bytes'] / 2**20:.1f} MiB of device state stopped), {m['rounds']} rounds", file=sys.stderr)
            wait_path(nxt)
            chain.append(r)
            api, here = nxt, to
        for i, pr in enumerate(chain):
            code = pr.p.wait(timeout=600)
            if code != 0:
                sys.exit(f"bench-migration: process {i} of VM {vms} exited {code}:\n{pr.said()}{''.join(pr.err)}")
        console = "".join(pr.said() for pr in chain)
        if "all_agree=true" not in console or (a.guest == "resume-hbm" and " 0 of " not in console):
            sys.exit(f"bench-migration: VM {vms} did not check out:\n{console}")
finally:
    for d in daemons:
        d.terminate()
        d.wait()


def spread(key, scale=1.0):
    v = sorted(m[key] * scale for m in figures)
    return {"min": v[0], "median": statistics.median(v), "max": v[-1]}


out = {
    "guest": a.guest,
    "daemon": a.daemon,
    "migrations": len(figures),
    "vms": vms,
    "downtime_ms": spread("downtime_ms"),
    "total_ms": spread("total_ms"),
    "precopy_ms": spread("precopy_ms"),
    "mib": spread("bytes", 1 / 2**20),
    "stop_device_mib": spread("device_bytes", 1 / 2**20),
    "runs": figures,
}
for k in ("downtime_ms", "total_ms", "precopy_ms", "mib", "stop_device_mib"):
    s = out[k]
    print(f"{k}: min {s['min']:.1f} median {s['median']:.1f} max {s['max']:.1f}")
if a.json:
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
