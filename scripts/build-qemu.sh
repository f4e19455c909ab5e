#!/usr/bin/env bash
# Builds QEMU 10.2.2's qemu-system-x86_64 (the first QEMU line with a
# vfio-user client, `-device vfio-user-pci`) from Debian's source package,
# for scripts/qemu-interop.sh (docs/vfio-user.md, "Building QEMU 10.2.2").
# This machine kind's Debian (bookworm) ships QEMU 7.2.
#
#   bash scripts/build-qemu.sh          # prints the binary's path on stdout
#   bash scripts/build-qemu.sh --deps   # only installs the build dependencies
#
# Reproducible: the source is Debian's `qemu 1:10.2.2+ds-1` exactly, fetched
# through a private apt source list (sid's deb-src, verified against
# Debian's archive keyring; the system's own apt sources and lists are not
# touched); meson and pycotap are pinned from PyPI in a venv of their own.
# The build is cached in target/qemu-10.2.2/ and reused while its stamp
# (the version and this script's hash) matches. Takes about 4 minutes on 2
# cores the first time, a second after.
#
# Needs root for the Debian build dependencies it installs when missing
# (ninja-build, libglib2.0-dev, flex, bison, dpkg-dev, python3-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
version=10.2.2
debian_version=1:10.2.2+ds-1
meson_version=1.9.1
pycotap_version=1.3.1
dest=$PWD/target/qemu-$version
bin=$dest/qemu-system-x86_64
stamp="qemu $debian_version meson $meson_version $(sha256sum "$0" | cut -d' ' -f1)"
deps_only=false
case "${1:-}" in
    --deps) deps_only=true ;;
    "") ;;
    *) echo "usage: bash scripts/build-qemu.sh [--deps]" >&2; exit 2 ;;
esac
if ! $deps_only && [ -x "$bin" ] && [ "$(cat "$dest/stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "build-qemu: cached $bin" >&2
    echo "$bin"
    exit 0
fi
log() { echo "build-qemu: $*" >&2; }
t0=$(date +%s)

# 1. Build dependencies, from the system's own apt sources.
deps=(ninja-build libglib2.0-dev flex bison dpkg-dev python3-venv pkg-config zlib1g-dev)
missing=()
for p in "${deps[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    [ "$(id -u)" = 0 ] || { log "install these Debian packages first: ${missing[*]}"; exit 2; }
    log "installing ${missing[*]}"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
fi
$deps_only && exit 0

# 2. The source package, through a private apt source list.
work=$(mktemp -d /tmp/build-qemu.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/apt/lists/partial" "$work/apt/archives/partial"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" \
    > "$work/apt/sources.list"
apt_opts=(
    -o "Dir::Etc::SourceList=$work/apt/sources.list"
    -o "Dir::Etc::SourceParts=/nonexistent"
    -o "Dir::State::Lists=$work/apt/lists"
    -o "Dir::Cache::Archives=$work/apt/archives"
    -o "APT::Sandbox::User=root"
)
log "fetching Debian's qemu $debian_version source (private apt source list)"
apt-get "${apt_opts[@]}" -q update >/dev/null
(cd "$work" && apt-get "${apt_opts[@]}" -q source --download-only "qemu=$debian_version" >/dev/null) || {
    log "could not fetch qemu $debian_version from sid's deb-src index (it carries: $(apt-cache "${apt_opts[@]}" showsrc qemu 2>/dev/null | awk '/^Version:/ { printf "%s ", $2 }'))"
    exit 1
}
dsc=$(ls "$work"/qemu_*.dsc)
# dpkg-source checks the files against the .dsc's checksums (apt checked
# the .dsc against the signed index).
dpkg-source --no-copy --skip-patches -x "$dsc" "$work/src" >/dev/null 2>&1 \
    || dpkg-source --skip-patches -x "$dsc" "$work/src" >/dev/null
src=$work/src

# 3. meson and pycotap (QEMU's configure wants them; the +ds tarball strips
# the wheels QEMU bundles), pinned, in a venv configure uses as its Python.
log "meson $meson_version and pycotap $pycotap_version from PyPI"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "meson==$meson_version" "pycotap==$pycotap_version"

# 4. The two firmware steps that need files the +ds tarball strips: the
# edk2 images (unpacked from .bz2 blobs) and the prebuilt device trees
# (installed as files when dtc is missing). qemu-system-x86_64 needs
# neither: its firmware comes from Debian's qemu-system-data and seabios.
sed -i 's/^\( *\)unpack_edk2_blobs = bzip2.found()/\1unpack_edk2_blobs = false/' "$src/meson.build"
grep -q "unpack_edk2_blobs = false" "$src/meson.build" || { log "meson.build: no edk2 step to turn off"; exit 1; }
sed -i "s/^subdir('dtb')/# subdir('dtb')  (build-qemu.sh: no prebuilt dtbs in +ds)/" "$src/pc-bios/meson.build"

# 5. One QEMU bug patched: unplugging any vfio-user-pci device with MSI-X
# (device_del) aborts QEMU 10.2.2 in vfio_user_pci_finalize ->
# vfio_user_msix_teardown -> memory_region_del_subregion, "Assertion
# `subregion->container == mr' failed": by finalize the PBA region is no
# longer in the BAR it was added to (the PCI core removed the BARs at
# unrealize), as reported on qemu-devel (Akihiko Odaki, 2025-10-10). The
# removal is made conditional on the region still being there.
pci_c=$src/hw/vfio-user/pci.c
grep -q '^    memory_region_del_subregion(mr, sub);$' "$pci_c" || { log "$pci_c: the teardown to patch is not there"; exit 1; }
sed -i 's/^    memory_region_del_subregion(mr, sub);$/    if (sub->container == mr) {\n        memory_region_del_subregion(mr, sub);\n    }/' "$pci_c"

# 6. Configure and build the one binary.
log "configure"
mkdir -p "$src/build"
(
    cd "$src/build"
    PATH="$work/venv/bin:$PATH" ../configure --python="$work/venv/bin/python3" \
        --target-list=x86_64-softmmu --without-default-features --enable-kvm --enable-tcg \
        --disable-rust --disable-docs --disable-install-blobs --disable-download \
        > "$work/configure.log" 2>&1 || { tail -n 40 "$work/configure.log" >&2; exit 1; }
)
log "ninja qemu-system-x86_64 ($(nproc) jobs)"
(cd "$src/build" && ninja -j "$(nproc)" qemu-system-x86_64 > "$work/ninja.log" 2>&1) \
    || { tail -n 40 "$work/ninja.log" >&2; exit 1; }
"$src/build/qemu-system-x86_64" -device help 2>/dev/null | grep -q '"vfio-user-pci"' \
    || { log "the built QEMU has no vfio-user-pci device"; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
cp "$src/build/qemu-system-x86_64" "$bin"
echo "$stamp" > "$dest/stamp"
log "built $("$bin" --version | head -1) in $(($(date +%s) - t0)) s: $bin"
echo "$bin"
