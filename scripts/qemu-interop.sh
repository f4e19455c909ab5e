#!/usr/bin/env bash
# Attaches a vNPU of our board daemon to QEMU's own vfio-user client
# (QEMU >= 10.1, `-device vfio-user-pci`) and boots the Linux guest of the
# nested test (docs/linux-guests.md) in that QEMU: the guest's kernel
# enumerates the vNPU through QEMU, loads the vnpu module, and runs the
# digits classifier and vnpu-infer on two compiled ONNX models against
# ONNX Runtime's outputs (docs/vfio-user.md, "Attaching other VMMs").
#
# Not part of CI: this machine kind's Debian has QEMU 7.2. Give a QEMU
# >= 10.1 in QEMU=...; docs/vfio-user.md says how one was built here from
# Debian's source package. The guest runs under TCG (a stock kernel cannot
# boot on this machine kind's nested /dev/kvm), the daemon natively.
#
# Usage: QEMU=/path/to/qemu-system-x86_64 bash scripts/qemu-interop.sh
#   QEMU_FIRMWARE  QEMU's -L directories (default "/usr/share/qemu
#                  /usr/share/seabios": the option ROMs of Debian's
#                  qemu-system-data and SeaBIOS, which setup.sh installs)
#   TIMEOUT        seconds for the guest to power off (default 300)
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
cargo build --release -q -p vnpu-cli
vnpu=target/release/vnpu
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
firmware=()
for d in ${QEMU_FIRMWARE:-/usr/share/qemu /usr/share/seabios}; do firmware+=(-L "$d"); done
# The guest prompts for a line of console input (the nested test checks
# that path; here it only has to end the prompt).
start=$(date +%s.%N)
set +e
echo "typed-into-qemu" | timeout "${TIMEOUT:-300}" "$qemu" -accel tcg -cpu max -smp 1 -m 512M \
    -machine q35,memory-backend=mem \
    -object memory-backend-memfd,id=mem,size=512M,share=on,seal=on \
    -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"path\":\"$sock\",\"type\":\"unix\"}}" \
    -kernel "$img/vmlinuz" -initrd "$img/l2-initrd.gz" \
    -append "console=ttyS0 panic=-1" \
    "${firmware[@]}" \
    -nodefaults -display none -monitor none -serial stdio -no-reboot > "$log" 2>&1
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
need "L2: vnpu-infer sklearn-mlp exit 0"
need "L2: vnpu-infer torch-cnn exit 0"
need ": client attached"
[ "$st" = 0 ] || { echo "qemu-interop: FAIL: QEMU exit $st (124: no power-off in time)" >&2; fail=1; }
served=$(awk '/^cores: 0 / { print $3; exit }' "$log")
echo "qemu-interop: the daemon's core 0 served ${served:-no} requests" >&2
awk -v s="$start" -v e="$end" 'BEGIN { printf "qemu-interop: QEMU start to power-off %.1f s wall\n", e - s }' >&2
rm -rf "$work"
if [ "$fail" != 0 ]; then
    echo "qemu-interop: the last 40 lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
fi
echo "qemu-interop: PASS ($log)" >&2
