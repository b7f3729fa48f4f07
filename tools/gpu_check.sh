#!/usr/bin/env bash
# The one-line way in on a GPU machine: install the carried wheels, run the GPU tests, then the
# benchmarks. Logs go to $OUT (the device tool's output folder) or ./gpu_out.
#   bash tools/gpu_check.sh                 # tests + every benchmark
#   bash tools/gpu_check.sh tests           # tests only
#   bash tools/gpu_check.sh bench kernels   # only tools/bench_kernels.py
#   PYTEST_ARGS="-k rmsnorm" bash tools/gpu_check.sh tests
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
what=${1:-all}
status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  python3 -m pytest -m gpu -q -x ${PYTEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  for script in tools/bench_${2:-*}.py; do
    [ -f "$script" ] || continue
    name=$(basename "$script" .py)
    echo "== $script"
    timeout ${BENCH_TIMEOUT:-300} python3 "$script" 2>&1 | tee "$out/$name.log"
  done
fi
exit "$status"
