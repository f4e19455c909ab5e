#!/usr/bin/env bash
# Acceptance run of a real pretrained vision network (docs/model-format.md,
# "The pretrained network"): PaddleOCR's text-direction classifier
# ch_ppocr_mobile_v2.0_cls (a MobileNetV3, Apache-2.0), which PyPI's
# rapidocr_onnxruntime 1.4.4 wheel ships inside it, is compiled for a vNPU,
# run by the runner guest in a VM, and checked against ONNX Runtime on
# rendered text lines (scripts/pretrained_inputs.py): max absolute and
# relative error, top-1 agreement with ONNX Runtime, accuracy on the labels.
#
#   scripts/pretrained.sh [--n IMAGES] [--batch B] [--vnpu SPEC] [--in-process]
#
# Defaults: 32 images, batches of 8, sa=4,vu=4,sram=8M,hbm=512M. Everything
# goes to .cache/pretrained/. Needs .venv-onnx (scripts/setup.sh) and the
# network to PyPI once (the wheel is kept). Exits non-zero if the relative
# error exceeds 1e-4 or a top-1 differs from ONNX Runtime.
set -euo pipefail
cd "$(dirname "$0")/.."

n=32 batch=8 vnpu="sa=4,vu=4,sram=8M,hbm=512M" where=()
while [ $# -gt 0 ]; do
    case "$1" in
        --n) n="$2"; shift 2 ;;
        --batch) batch="$2"; shift 2 ;;
        --vnpu) vnpu="$2"; shift 2 ;;
        --in-process) where=(--in-process); shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "pretrained.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ $((n % batch)) -ne 0 ]; then
    echo "pretrained.sh: --n $n is not a multiple of --batch $batch" >&2
    exit 2
fi

cache=.cache/pretrained
py=.venv-onnx/bin/python
wheel_sha=971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf
model_sha=e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c
model=$cache/ch_ppocr_mobile_v2.0_cls_infer.onnx
mkdir -p "$cache"

[ -x "$py" ] || bash scripts/setup.sh
"$py" -c "import PIL" 2>/dev/null || "$py" -m pip install -q 'pillow==13.0.0'

if ! echo "$model_sha  $model" | sha256sum -c --status 2>/dev/null; then
    echo "pretrained: fetching rapidocr_onnxruntime 1.4.4 from PyPI (the model is inside the wheel)" >&2
    "$py" -m pip download -q --no-deps 'rapidocr_onnxruntime==1.4.4' -d "$cache"
    wheel=$cache/rapidocr_onnxruntime-1.4.4-py3-none-any.whl
    echo "$wheel_sha  $wheel" | sha256sum -c --status || { echo "pretrained: wheel checksum differs" >&2; exit 1; }
    "$py" -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx'))" "$wheel" "$model"
    echo "$model_sha  $model" | sha256sum -c --status || { echo "pretrained: model checksum differs" >&2; exit 1; }
fi

echo "pretrained: $n rendered text lines (half turned by 180 degrees)" >&2
"$py" scripts/pretrained_inputs.py "$cache/x.npy" "$cache/labels.npy" --n "$n"

cargo build -q --release -p vnpu-cli
[ ${#where[@]} -gt 0 ] || bash scripts/build-guests.sh >/dev/null 2>&1
bin=./target/release/vnpu
$bin compile "$model" -o "$cache/cls.vnpu" --vnpu "$vnpu" --shape "x=$batch,3,48,192"
$bin infer "$cache/cls.vnpu" --input "x=$cache/x.npy" --output "$cache/y.npy" --show 4 "${where[@]}"
"$py" scripts/ort_ref.py "$model" "$cache/ort" "x=$cache/x.npy" >/dev/null

"$py" - "$cache/y.npy" "$cache/ort.save_infer_model_scale_0.tmp_1.npy" "$cache/labels.npy" <<'EOF'
import sys
import numpy as np
got, want, labels = (np.load(p) for p in sys.argv[1:4])
assert got.shape == want.shape, (got.shape, want.shape)
d = np.abs(got.astype(np.float64) - want)
rel = (d / np.maximum(np.abs(want), 1e-6)).max()
agree = int((got.argmax(1) == want.argmax(1)).sum())
acc_npu = (got.argmax(1) == labels).mean()
acc_ort = (want.argmax(1) == labels).mean()
n = len(labels)
print(f"pretrained: max abs {d.max():.3e}, max rel {rel:.3e}, top-1 agreement {agree}/{n}, "
      f"accuracy vNPU {acc_npu:.4f} ONNX Runtime {acc_ort:.4f}")
ok = np.isfinite(d).all() and rel <= 1e-4 and agree == n
print("pretrained: " + ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
EOF
