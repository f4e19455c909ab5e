#!/usr/bin/env bash
# Attaches a vNPU of our board daemon to QEMU's own vfio-user client
# (QEMU >= 10.1, `-device vfio-user-pci`) and boots the Linux guest of the
# nested test (docs/linux-guests.md) in that QEMU: the guest's kernel
# enumerates the vNPU through QEMU, loads the vnpu module, and runs the
# digits classifier and vnpu-infer on every compiled ONNX model against
# ONNX Runtime's outputs; then QEMU's monitor unplugs the vNPU and plugs it
# in again, and the digits run on it once more (docs/vfio-user.md,
# "Attaching other VMMs").
#
# CI runs it after the nested test with the QEMU scripts/build-qemu.sh
# builds (this machine kind's Debian has QEMU 7.2). The guest runs under
# TCG (a stock kernel cannot boot on this machine kind's nested /dev/kvm),
# the daemon natively. It fails unless every guest check passes: every
# model in the image exits 0 (their list is read from the initrd, not from
# the guest), the guest's status line says 0, the vNPU leaves and comes
# back, QEMU warns about nothing, and the daemon served at least one
# request per digits image and saw QEMU attach and let go twice.
#
# Usage: QEMU=$(bash scripts/build-qemu.sh) bash scripts/qemu-interop.sh
#   QEMU_FIRMWARE  QEMU's -L directories (default "/usr/share/qemu
#                  /usr/share/seabios": the option ROMs of Debian's
#                  qemu-system-data and SeaBIOS, which setup.sh installs)
#   TIMEOUT        seconds for the guest to power off (default 300)
#   VIOMMU=1       the guest behind QEMU's vIOMMU (intel-iommu with
#                  caching-mode=on, the guest's intel_iommu=on): QEMU then
#                  maps each page the guest's IOMMU maps with a DMA_MAP of
#                  its own, and sends the unmaps the guest's IOMMU does
# Needs: bash scripts/setup.sh && bash scripts/build-guests.sh and the
# Linux images (bash guest-images/linux/build-image.sh, which
# scripts/nested-test.sh runs).
set -euo pipefail
cd "$(dirname "$0")/.."
qemu="${QEMU:-}"
[ -n "$qemu" ] && [ -x "$qemu" ] || { echo "qemu-interop: set QEMU to a qemu-system-x86_64 >= 10.1" >&2; exit 2; }
version=$("$qemu" --version | head -1)
echo "qemu-interop: $version" >&2
"$qemu" -device help 2>/dev/null | grep -q '"vfio-user-pci"' \
    || { echo "qemu-interop: this QEMU has no vfio-user-pci device (QEMU >= 10.1 on Linux)" >&2; exit 2; }
img=guest-images/target/linux
for f in "$img/vmlinuz" "$img/l2-initrd.gz"; do
    [ -f "$f" ] || { echo "qemu-interop: $f missing (bash guest-images/linux/build-image.sh)" >&2; exit 2; }
done
# The static release build the nested test made (a cache hit then).
vnpu=$(bash scripts/build-static-vmm.sh)
work=$(mktemp -d /tmp/vnpu-qemu-interop.XXXXXX)
state=$work/state
log=target/qemu-interop.log
mkdir -p target
"$vnpu" daemon --state-dir "$state" 2> "$work/daemon.log" &
daemon=$!
cleanup() {
    kill -TERM "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 200); do
    [ -S "$state/sockets/control.sock" ] && break
    sleep 0.05
done
uuid=$("$vnpu" create --type small --state-dir "$state")
sock="$state/sockets/$uuid.sock"
echo "qemu-interop: the daemon serves $uuid at $sock" >&2
iommu=()
cmdline_iommu=""
if [ "${VIOMMU:-0}" = 1 ]; then
    iommu=(-device intel-iommu,caching-mode=on)
    cmdline_iommu="intel_iommu=on"
fi
firmware=()
for d in ${QEMU_FIRMWARE:-/usr/share/qemu /usr/share/seabios}; do firmware+=(-L "$d"); done
# The guest prompts for a line of console input (the nested test checks
# that path; here it only has to end the prompt).
# The vnpu module's DMA memory above 4 MiB, as the nested test reserves it
# (guest-images/linux/l1-init): the large batch's buffer comes from there.
reserve='memmap=32M$0x10000000 vnpu.reserve=32M@0x10000000'
# Every compiled model the image carries, read from the initrd itself.
mapfile -t models < <(zcat "$img/l2-initrd.gz" | cpio -t --quiet 2>/dev/null \
    | sed -n 's|^\(\./\)\{0,1\}models/\([^/]*\)\.vnpu$|\2|p' | sort)
[ "${#models[@]}" -gt 0 ] || { echo "qemu-interop: no models/*.vnpu in $img/l2-initrd.gz" >&2; exit 2; }
echo "qemu-interop: the image carries ${#models[@]} models: ${models[*]}" >&2
# The vNPU sits behind a PCIe root port, so that it can be unplugged and
# plugged in again (a device on q35's root bus cannot).
device() {
    printf '{"driver":"vfio-user-pci","id":"%s","bus":"rp0","socket":{"path":"%s","type":"unix"}}' "$1" "$sock"
}
qmp() {
    python3 - "$work/qmp.sock" "$1" <<'PY'
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rw")
f.readline()  # greeting
for cmd in ({"execute": "qmp_capabilities"}, json.loads(sys.argv[2])):
    f.write(json.dumps(cmd) + "\n")
    f.flush()
    while True:
        reply = json.loads(f.readline())
        if "return" in reply or "error" in reply:
            break
    if "error" in reply:
        sys.exit("qmp: %s: %s" % (cmd["execute"], reply["error"]))
PY
}
# Waits (up to $2 s) until the guest's console says $1.
console_says() {
    local i
    for i in $(seq $(($2 * 10))); do
        grep -qF -- "$1" "$log" 2>/dev/null && return 0
        kill -0 "$qemu_pid" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
start=$(date +%s.%N)
echo "typed-into-qemu" | timeout "${TIMEOUT:-300}" "$qemu" -accel tcg -cpu max -smp 1 -m 512M \
    -machine q35,memory-backend=mem \
    -object memory-backend-memfd,id=mem,size=512M,share=on,seal=on \
    "${iommu[@]}" \
    -device pcie-root-port,id=rp0,chassis=1,slot=1 \
    -device "$(device vnpu0)" \
    -kernel "$img/vmlinuz" -initrd "$img/l2-initrd.gz" \
    -append "console=ttyS0 panic=-1 $reserve $cmdline_iommu l2.hotplug" \
    -qmp "unix:$work/qmp.sock,server=on,wait=off" \
    "${firmware[@]}" \
    -nodefaults -display none -monitor none -serial stdio -no-reboot > "$log" 2>&1 &
qemu_pid=$!
# Hot-unplug through QEMU's monitor (device_del: QEMU asks the guest to
# eject the device, the guest lets go, QEMU closes the vfio-user
# connection and the daemon's instance is free for the next client), then
# hot-plug (device_add on the same instance); the guest runs the digits
# again. QEMU 10.2.2's vfio-user-pci never registers the device-request
# interrupt, so `vnpu stop` cannot ask it to let go (docs/vfio-user.md).
unplug_s=""
if console_says "L2: hotplug: waiting for the vNPU to leave" 240; then
    t=$(date +%s.%N)
    qmp '{"execute":"device_del","arguments":{"id":"vnpu0"}}' || echo "qemu-interop: device_del failed" >&2
    if console_says "L2: hotplug: the vNPU left" 60; then
        unplug_s=$(awk -v s="$t" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
        qmp "{\"execute\":\"device_add\",\"arguments\":$(device vnpu1)}" || echo "qemu-interop: device_add failed" >&2
    fi
fi
set +e
wait "$qemu_pid"
st=$?
set -e
end=$(date +%s.%N)
tr -d '\r' < "$log" > "$log.tmp" && mv "$log.tmp" "$log"
"$vnpu" cores --state-dir "$state" | sed 's/^/cores: /' >> "$log"
cleanup
trap - EXIT
sed 's/^/daemon: /' "$work/daemon.log" >> "$log"
grep -E '^(L2:|accuracy|check|digits:|pci|msix|latency|batch)' "$log" >&2 || true
fail=0
need() {
    if ! grep -qF -- "$1" "$log"; then
        echo "qemu-interop: FAIL: missing: $1" >&2
        fail=1
    fi
}
need "class 0x120000 driver vnpu"
need "msix: capability with 8 vectors, enabled; completions by interrupt (vnpu kernel module)"
need "accuracy vnpu=0.9733 cpu=0.9733 model=mlp agree=450/450 batch_agree=450/450"
need "accuracy vnpu=0.9911 cpu=0.9911 model=cnn agree=450/450 batch_agree=450/450"
need "digits: vNPU and CPU agree on every image"
need "L2: vnpu-digits exit 0"
for m in "${models[@]}"; do
    need "L2: vnpu-infer $m exit 0"
done
if ! [ "$(grep -cE '^check .* top-1 agree [0-9]+/[0-9]+$' "$log")" = "${#models[@]}" ] \
    || grep -E '^check .* top-1 agree ([0-9]+)/([0-9]+)$' "$log" | awk '{ split($NF, a, "/"); if (a[1] != a[2]) bad = 1 } END { exit !bad }'; then
    echo "qemu-interop: FAIL: vnpu-infer: not one agreeing top-1 check per model" >&2
    fail=1
fi
need "L2: status 0"
need ": client attached"
need "L2: hotplug: the vNPU left"
need "L2: hotplug: a vNPU arrived"
need "L2: hotplug: vnpu-digits exit 0"
if [ "$(grep -cF "$uuid: client attached" "$log")" != 2 ] || [ "$(grep -cF "$uuid: client detached" "$log")" != 2 ]; then
    echo "qemu-interop: FAIL: the daemon did not see QEMU attach twice and let go twice (plugged, unplugged, plugged, powered off)" >&2
    fail=1
fi
# QEMU's own messages: prefixed with its name, or (from the monitor) bare.
if grep -E "^(qemu-system-[a-z0-9_]+: |warning: )" "$log" >&2; then
    echo "qemu-interop: FAIL: QEMU warned or failed (the lines above)" >&2
    fail=1
fi
[ "$st" = 0 ] || { echo "qemu-interop: FAIL: QEMU exit $st (124: no power-off in time)" >&2; fail=1; }
served=$(awk '/^cores: 0 / { print $3; exit }' "$log")
echo "qemu-interop: the daemon's core 0 served ${served:-no} requests" >&2
echo "qemu-interop: from device_del to the guest's unplug: ${unplug_s:-never} s" >&2
if [ "${served:-0}" -lt 900 ]; then
    echo "qemu-interop: FAIL: the daemon's core 0 served ${served:-no} requests (want >= 900: one per batch-1 digits image)" >&2
    fail=1
fi
awk -v s="$start" -v e="$end" 'BEGIN { printf "qemu-interop: QEMU start to power-off %.1f s wall\n", e - s }' >&2
rm -rf "$work"
if [ "$fail" != 0 ]; then
    echo "qemu-interop: the last 40 lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
fi
echo "qemu-interop: PASS ($log)" >&2
