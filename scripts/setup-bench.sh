#!/usr/bin/env bash
# Installs what the benchmarks need beyond the build: OpenBLAS (the CPU GEMM
# baseline) from Debian and SCALE-Sim v3 (the timing-model baseline) from
# PyPI into .venv-bench. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p | grep -q libopenblas.so.0; then
    echo "setup-bench: installing libopenblas0 (Debian)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0 >/dev/null
fi
if [ ! -x .venv-bench/bin/python ]; then
    echo "setup-bench: creating .venv-bench with scalesim (numpy<2: scalesim 3.0.0 needs it)" >&2
    python3 -m venv .venv-bench
    .venv-bench/bin/pip install -q 'scalesim==3.0.0' 'numpy<2'
fi
echo "setup-bench: ready" >&2
