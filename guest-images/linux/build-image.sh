#!/usr/bin/env bash
# Builds the Linux guest images from Debian packages (docs/linux-guests.md):
#   OUT/vmlinuz        Debian's linux-image-amd64 kernel (L1 and L2)
#   OUT/l2-initrd.gz   L2: busybox-static + vnpu-digits + vnpu-infer + the
#                      vnpu kernel module (kmod/, built against
#                      linux-headers-KVER) + l2-init + /models: two fixture
#                      models compiled for type=small (`vnpu compile`), their
#                      test inputs and ONNX Runtime's outputs on them
#                      (scripts/ort_ref.py in .venv-onnx, scripts/setup.sh)
#   OUT/l1-initrd.gz   L1: busybox-static + kvm/kvm-amd modules + vnpu
#                      (static) + the L2 kernel and initrd + l1-init
# Needs apt-get (Debian's packages), cpio and gzip, and the binaries built
# first: `bash scripts/build-guests.sh` (vnpu-digits) and the static VMM
#   RUSTFLAGS="-C target-feature=+crt-static" cargo build --release \
#       -p vnpu-cli --target x86_64-unknown-linux-gnu
# OUT defaults to guest-images/target/linux.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/guest-images/target/linux}"
digits="$root/guest-images/target/x86_64-unknown-linux-gnu/release/vnpu-digits"
infer="$root/guest-images/target/x86_64-unknown-linux-gnu/release/vnpu-infer"
vmm="$root/target/x86_64-unknown-linux-gnu/release/vnpu"
for f in "$digits" "$infer" "$vmm"; do
    [ -x "$f" ] || { echo "build-image: $f is missing; see the header of $0" >&2; exit 1; }
done
mkdir -p "$out/debs"
cd "$out/debs"
# The kernel package linux-image-amd64 points at, and busybox-static.
kpkg_of() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
kpkg="$(kpkg_of)"
if [ -z "$kpkg" ] && [ "$(id -u)" = 0 ]; then
    echo "build-image: apt-get update (no package lists yet)" >&2
    apt-get update -q >/dev/null && kpkg="$(kpkg_of)"
fi
[ -n "$kpkg" ] || { echo "build-image: apt knows no linux-image-amd64 (apt-get update?)" >&2; exit 1; }
for p in "$kpkg" busybox-static; do
    ls "${p}"_*.deb >/dev/null 2>&1 || { echo "build-image: fetching $p" >&2; apt-get download "$p" >/dev/null 2>&1 || apt-get download "$p"; }
done
rm -rf "$out/pkgs" && mkdir -p "$out/pkgs"
for d in ./*.deb; do dpkg-deb -x "$d" "$out/pkgs"; done
kver="${kpkg#linux-image-}"
mods="$out/pkgs/lib/modules/$kver/kernel"
cp "$out/pkgs/boot/vmlinuz-$kver" "$out/vmlinuz"

pack() { (cd "$1" && find . | cpio -o -H newc --quiet | gzip -1) > "$2"; }

l2="$out/l2-root"
rm -rf "$l2" && mkdir -p "$l2"/{bin,dev,proc,sys,lib/modules,models}
cp "$out/pkgs/bin/busybox" "$digits" "$infer" "$l2/bin/"
# The models vnpu-infer runs in L2 (l2-init): NAME ONNX INPUT-NAME INPUT
# OUTPUT BATCH REPEAT. REPEAT > 1 tiles the input that many times (NumPy
# in .venv-onnx): sklearn-mlp-x32 is the MLP compiled for one batch of
# 14,400 rows, whose I/O window (4.3 MB) is more DMA memory than the
# kernel's buddy allocator gives at once (4 MiB), so it tests the vnpu
# module's buffers from CMA (l1-init boots L2 with cma=); token-embedding
# takes int64 token ids (its `-x.npy` is an integer array).
py="$root/.venv-onnx/bin/python"
fix="$root/tests/fixtures/onnx"
while read -r name model xname input output batch repeat; do
    if [ "$repeat" != 1 ]; then
        [ -x "$py" ] || { echo "build-image: no $py (bash scripts/setup.sh): no $name in L2" >&2; continue; }
        "$py" -c 'import sys, numpy as np; a = np.load(sys.argv[1]); np.save(sys.argv[2], np.tile(a, (int(sys.argv[3]),) + (1,) * (a.ndim - 1)))' \
            "$fix/$input" "$l2/models/$name-x.npy" "$repeat"
    else
        cp "$fix/$input" "$l2/models/$name-x.npy"
    fi
    "$vmm" compile "$fix/$model" --vnpu type=small --batch "$batch" --output "$output" \
        -o "$l2/models/$name.vnpu" >"$out/compile-$name.log" \
        || { cat "$out/compile-$name.log" >&2; exit 1; }
    if [ -x "$py" ]; then
        "$py" "$root/scripts/ort_ref.py" "$fix/$model" "$out/ort-$name" "$xname=$l2/models/$name-x.npy" --output "$output" >/dev/null
        cp "$out/ort-$name.$output.npy" "$l2/models/$name-ort.npy"
    else
        echo "build-image: no $py (bash scripts/setup.sh): $name has no ONNX Runtime reference in L2" >&2
    fi
done <<'MODELS'
sklearn-mlp digits-mlp.onnx X digits-x.npy probabilities 50 1
sklearn-mlp-x32 digits-mlp.onnx X digits-x.npy probabilities 14400 32
torch-cnn torch/digits-cnn.onnx x torch/digits-img-x.npy logits 50 1
token-embedding ops/token-embedding.onnx ids ops/token-embedding-ids.npy matmul_18 3 1
MODELS
# The vnpu kernel module (MSI-X completions), built against the headers of
# the same kernel (Debian's linux-headers-$kver, installed if missing).
hdr="/lib/modules/$kver/build"
if [ ! -d "$hdr" ] && [ "$(id -u)" = 0 ]; then
    echo "build-image: installing linux-headers-$kver" >&2
    apt-get install -y -q "linux-headers-$kver" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q "linux-headers-$kver" >/dev/null; } || true
fi
if [ -d "$hdr" ]; then
    rm -rf "$out/kmod" && cp -r "$here/kmod" "$out/kmod"
    make -s -C "$hdr" M="$out/kmod" modules >"$out/kmod/build.log" 2>&1 \
        || { cat "$out/kmod/build.log" >&2; exit 1; }
    cp "$out/kmod/vnpu.ko" "$l2/lib/modules/"
else
    echo "build-image: no headers for $kver: the L2 guest polls (no vnpu.ko)" >&2
fi
install -m 755 "$here/l2-init" "$l2/init"
pack "$l2" "$out/l2-initrd.gz"

l1="$out/l1-root"
rm -rf "$l1" && mkdir -p "$l1"/{bin,dev,proc,sys,l2,lib/modules}
cp "$out/pkgs/bin/busybox" "$l1/bin/"
install -m 755 "$vmm" "$l1/bin/vnpu"
strip "$l1/bin/vnpu" 2>/dev/null || true
cp "$mods/virt/lib/irqbypass.ko" "$mods/arch/x86/kvm/kvm.ko" "$mods/arch/x86/kvm/kvm-amd.ko" \
    "$mods/drivers/crypto/ccp/ccp.ko" "$l1/lib/modules/"
cp "$out/vmlinuz" "$l1/l2/vmlinuz"
cp "$out/l2-initrd.gz" "$l1/l2/initrd.gz"
install -m 755 "$here/l1-init" "$l1/init"
pack "$l1" "$out/l1-initrd.gz"
echo "build-image: $kpkg; $(du -h "$out/l2-initrd.gz" | cut -f1) L2 initrd, $(du -h "$out/l1-initrd.gz" | cut -f1) L1 initrd in $out" >&2
