#!/usr/bin/env python3
"""Snapshot and restore of the digits VM with its vNPU (docs/migration.md):
for each guest memory size, N rounds of: boot `vnpu run --api-socket`,
wait until the CNN's requests are under way, `vnpu snapshot --stop`,
then `vnpu restore` in a new process, which must finish the run with
every answer equal to the guest's CPU's. Reports min/median/max of:

  pause     how long the VM stood still for its snapshot (vCPU stop to
            files written)
  drain     of the pause, the wait for each vNPU to finish the request
            it was running
  size      bytes the snapshot's files hold on disk (holes are free)
  restore   `Vm::restore`: from reading vm.json to a VM ready to run
            (checksums of every file, KVM state, vNPU state back)
  first     restore plus the process start, to the VM's first output
            after it (the wall clock of `vnpu restore` until its guest
            prints its next line)

Firecracker's published figure, for scale (docs/snapshotting/
snapshot-support.md, "Performance"): snapshot resume latency under
8 ms, 5 ms p90, for 2 vCPU / 512 MB / 1 block / 1 net device on an
m5d.metal.

  cargo build --release -p vnpu-cli && bash scripts/build-guests.sh
  python3 scripts/bench-snapshot.py [--rounds 10] [--memory 64M,512M] [--daemon] [--json FILE]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGREE = "digits: vNPU and CPU agree on every image"

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--rounds", type=int, default=10)
p.add_argument("--memory", default="64M,512M")
p.add_argument("--bin", default=os.path.join(ROOT, "target/release/vnpu"))
p.add_argument("--guest", default=os.path.join(ROOT, "guest-images/target/x86_64-unknown-none/release/digits"))
p.add_argument("--json", help="write the figures here")
p.add_argument("--daemon", action="store_true",
               help="the vNPU served by a board daemon (its state through vfio-user migration v2) instead of in-process")
a = p.parse_args()
for f in (a.bin, a.guest):
    if not os.path.exists(f):
        sys.exit(f"bench-snapshot: {f} missing (cargo build --release -p vnpu-cli; bash scripts/build-guests.sh)")


def wait_for(proc, buf, text, limit=120):
    t = time.time()
    while text not in buf[0]:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench-snapshot: the VM ended before printing {text!r}:\n{buf[0]}")
        buf[0] += line
        if time.time() - t > limit:
            raise SystemExit(f"bench-snapshot: no {text!r} after {limit} s")


def one(mem, work, vnpu):
    api = os.path.join(work, "api.sock")
    snap = os.path.join(work, "snap")
    shutil.rmtree(snap, ignore_errors=True)
    vm = subprocess.Popen([a.bin, "run", "--memory", mem, "--guest", a.guest] + vnpu +
                          ["--api-socket", api], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    buf = [""]
    wait_for(vm, buf, "model cnn")
    s = subprocess.run([a.bin, "snapshot", "--api-socket", api, snap, "--stop"], capture_output=True, text=True)
    vm.wait(timeout=120)
    if s.returncode != 0:
        raise SystemExit(f"bench-snapshot: snapshot failed: {s.stdout}{s.stderr}")
    m = re.search(r"\(([\d.]+) MiB on disk, (\d+) RAM pages, the VM paused ([\d.]+) ms, ([\d.]+) of them", s.stdout)
    size_mib, pause_ms, drain_ms = float(m.group(1)), float(m.group(3)), float(m.group(4))
    t0 = time.perf_counter()
    r = subprocess.Popen([a.bin, "restore", snap], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    out = ""
    for line in r.stdout:
        if first is None and "restored" not in line:
            first = (time.perf_counter() - t0) * 1e3
        out += line
    r.wait()
    if r.returncode != 0 or AGREE not in out:
        raise SystemExit(f"bench-snapshot: the restored VM did not finish correctly:\n{out}")
    restore_ms = float(re.search(r"restored \S+ in ([\d.]+) ms", out).group(1))
    return {"pause_ms": pause_ms, "drain_ms": drain_ms, "size_mib": size_mib, "restore_ms": restore_ms, "first_ms": first}


def mmm(v):
    return {"min": min(v), "median": statistics.median(v), "max": max(v)}


results = {}
work = tempfile.mkdtemp(prefix="vnpu-bench-snapshot-")
daemon = None
vnpu = ["--vnpu", "type=small"]
try:
    if a.daemon:
        state = os.path.join(work, "state")
        uuid = subprocess.run([a.bin, "create", "--type", "small", "--state-dir", state],
                              capture_output=True, text=True, check=True).stdout.strip()
        daemon = subprocess.Popen([a.bin, "daemon", "--state-dir", state], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        sock = os.path.join(state, "sockets", f"{uuid}.sock")
        t = time.time()
        while not os.path.exists(sock):
            if time.time() - t > 30:
                raise SystemExit("bench-snapshot: the daemon did not serve the instance")
            time.sleep(0.05)
        vnpu = ["--vnpu", f"uuid={uuid}", "--state-dir", state]
    for mem in a.memory.split(","):
        rows = []
        for i in range(a.rounds):
            rows.append(one(mem, work, vnpu))
            print(f"bench-snapshot: {mem} round {i + 1}/{a.rounds}: {rows[-1]}", file=sys.stderr)
        results[mem] = {k: mmm([r[k] for r in rows]) for k in rows[0]}
finally:
    if daemon:
        daemon.terminate()
        daemon.wait()
    shutil.rmtree(work, ignore_errors=True)

print(f"| guest RAM | pause ms | of it, drain ms | snapshot MiB on disk | restore ms | to first output ms |")
print(f"| --- | --- | --- | --- | --- | --- |")
for mem, r in results.items():
    cell = lambda k: "{min:.1f} / {median:.1f} / {max:.1f}".format(**r[k])
    print(f"| {mem} | {cell('pause_ms')} | {cell('drain_ms')} | {cell('size_mib')} | {cell('restore_ms')} | {cell('first_ms')} |")
print(f"(min / median / max over {a.rounds} rounds each; the vNPU {'served by a board daemon' if a.daemon else 'in-process'})")
if a.json:
    with open(a.json, "w") as f:
        json.dump({"rounds": a.rounds, "results": results}, f, indent=1)
