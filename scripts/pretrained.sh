#!/usr/bin/env bash
# Acceptance run of real pretrained vision networks (docs/compiled-model-format.md,
# "The pretrained networks"): PaddleOCR's models (Apache-2.0) that PyPI's
# rapidocr_onnxruntime 1.4.4 wheel ships inside it, each compiled for a
# vNPU, run by the runner guest in a VM, and checked against ONNX Runtime
# on rendered text (scripts/pretrained_inputs.py, scripts/pretrained_check.py):
#   cls  ch_ppocr_mobile_v2.0_cls, text direction (a MobileNetV3).
#   rec  ch_PP-OCRv4_rec, text recognition (PP-LCNetV3, an SVTR neck with
#        attention and decomposed layer norms, a CTC head).
#   det  ch_PP-OCRv4_det, text detection (DBNet: PP-LCNetV3, a feature
#        pyramid with nearest Resize, transposed convolutions).
#
#   scripts/pretrained.sh [--model cls|rec|det|all] [--n N] [--batch B] [--vnpu SPEC] [--dtype f32|bf16] [--in-process]
#
# Defaults: all three. cls: 32 text lines at 48x192 in batches of 8 on
# sa=4,vu=4,sram=8M,hbm=512M; rec: 16 lines at 48x320 in batches of 8 and
# det: 8 pages of 160x320 in batches of 4, both on sa=4,vu=4,sram=8M,hbm=1G
# (--n/--batch/--vnpu override them); f32 (--dtype bf16: bf16 weights and
# SA operands, checked against the bf16 bound). Everything goes to
# .cache/pretrained/.
# Needs .venv-onnx (scripts/setup.sh) and PyPI once (the wheel is kept).
# Exits non-zero if a check of scripts/pretrained_check.py fails.
set -euo pipefail
cd "$(dirname "$0")/.."

models=(cls rec det) n="" batch="" vnpu="" dtype=f32 where=()
while [ $# -gt 0 ]; do
    case "$1" in
        --model)
            case "$2" in
                all) models=(cls rec det) ;;
                cls|rec|det) models=("$2") ;;
                *) echo "pretrained.sh: unknown model $2 (cls, rec, det or all)" >&2; exit 2 ;;
            esac
            shift 2 ;;
        --n) n="$2"; shift 2 ;;
        --batch) batch="$2"; shift 2 ;;
        --vnpu) vnpu="$2"; shift 2 ;;
        --dtype)
            case "$2" in
                f32|bf16) dtype="$2" ;;
                *) echo "pretrained.sh: --dtype $2: expected f32 or bf16" >&2; exit 2 ;;
            esac
            shift 2 ;;
        --in-process) where=(--in-process); shift ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "pretrained.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

cache=.cache/pretrained
py=.venv-onnx/bin/python
wheel_sha=971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf
wheel=$cache/rapidocr_onnxruntime-1.4.4-py3-none-any.whl
mkdir -p "$cache"

[ -x "$py" ] || bash scripts/setup.sh
"$py" -c "import PIL" 2>/dev/null || "$py" -m pip install -q 'pillow==13.0.0'
"$py" -c "import onnx" 2>/dev/null || "$py" -m pip install -q 'onnx==1.23.2'

# The model files inside the wheel, and their checksums.
declare -A file=(
    [cls]=ch_ppocr_mobile_v2.0_cls_infer.onnx
    [rec]=ch_PP-OCRv4_rec_infer.onnx
    [det]=ch_PP-OCRv4_det_infer.onnx
)
declare -A sha=(
    [cls]=e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c
    [rec]=48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b
    [det]=d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9
)

cargo build -q --release -p vnpu-cli
[ ${#where[@]} -gt 0 ] || bash scripts/build-guests.sh >/dev/null 2>&1
bin=./target/release/vnpu
status=0
for m in "${models[@]}"; do
    case "$m" in
        cls) mn=${n:-32} mb=${batch:-8} mv=${vnpu:-sa=4,vu=4,sram=8M,hbm=512M} shape=3,48,192 gen=(--kind cls) ;;
        rec) mn=${n:-16} mb=${batch:-8} mv=${vnpu:-sa=4,vu=4,sram=8M,hbm=1G} shape=3,48,320 gen=(--kind rec) ;;
        det) mn=${n:-8} mb=${batch:-4} mv=${vnpu:-sa=4,vu=4,sram=8M,hbm=1G} shape=3,160,320
             gen=(--kind det --height 160 --width 320) ;;
    esac
    if [ $((mn % mb)) -ne 0 ]; then
        echo "pretrained.sh: --n $mn is not a multiple of --batch $mb" >&2
        exit 2
    fi
    model=$cache/${file[$m]}
    if ! echo "${sha[$m]}  $model" | sha256sum -c --status 2>/dev/null; then
        if ! echo "$wheel_sha  $wheel" | sha256sum -c --status 2>/dev/null; then
            echo "pretrained: fetching rapidocr_onnxruntime 1.4.4 from PyPI (the models are inside the wheel)" >&2
            "$py" -m pip download -q --no-deps 'rapidocr_onnxruntime==1.4.4' -d "$cache"
            echo "$wheel_sha  $wheel" | sha256sum -c --status || { echo "pretrained: wheel checksum differs" >&2; exit 1; }
        fi
        "$py" -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('rapidocr_onnxruntime/models/' + sys.argv[3]))" \
            "$wheel" "$model" "${file[$m]}"
        echo "${sha[$m]}  $model" | sha256sum -c --status || { echo "pretrained: $m model checksum differs" >&2; exit 1; }
    fi
    echo "pretrained: $m on $mn rendered inputs, batches of $mb, vNPU $mv, $dtype" >&2
    x=$cache/$m-x.npy labels=$cache/$m-labels.npy
    "$py" scripts/pretrained_inputs.py "$x" "$labels" --n "$mn" "${gen[@]}"
    $bin compile "$model" -o "$cache/$m.vnpu" --vnpu "$mv" --shape "x=$mb,$shape" --dtype "$dtype"
    $bin infer "$cache/$m.vnpu" --input "x=$x" --output "$cache/$m-y.npy" --show 2 --top 3 "${where[@]}"
    rm -f "$cache/$m-ort".*.npy
    "$py" scripts/ort_ref.py "$model" "$cache/$m-ort" "x=$x" >/dev/null
    "$py" scripts/pretrained_check.py "$m" "$model" "$cache/$m-y.npy" "$cache/$m-ort".*.npy "$labels" --dtype "$dtype" || status=1
done
exit "$status"
