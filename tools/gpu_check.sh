#!/usr/bin/env bash
# The one-line way in on a GPU machine: install the carried wheels, run the GPU tests, then the
# benchmarks. Logs go to $OUT (the device tool's output folder) or ./gpu_out.
#   bash tools/gpu_check.sh                 # tests + every benchmark
#   bash tools/gpu_check.sh tests           # tests only
#   bash tools/gpu_check.sh bench kernels   # only tools/bench_kernels.py
#   PYTEST_ARGS="-k rmsnorm" bash tools/gpu_check.sh tests
#   bash tools/gpu_check.sh suite           # one GPU: the single-GPU tests in three processes side by
#                                           # side (files dealt round-robin; about 4 min on an H200)
#   bash tools/gpu_check.sh pair            # two GPUs: the NCCL tests on both, beside the single-GPU
#                                           # suite split over GPU 0 and GPU 1 (about half the time)
#   bash tools/gpu_check.sh dist            # two GPUs: the 2-GPU table (0.5B/1.5B, bf16/FP8, ZeRO-1,
#                                           # 20 steps; about 2 min) and the 1.5B bf16 stream timeline
#   bash tools/gpu_check.sh fp8-delayed     # one GPU: delayed FP8 scaling (PERF_NOTES 41): its GPU tests, the
#                                           # SwiGLU kernels, FP8 steps without and with it alternated (two
#                                           # rounds, 0.5B and 1.5B; about 8 min); then, as a second call,
#   bash tools/gpu_check.sh fp8-loss        # FP8 loss curves against bf16 with and without it (3 seeds)
#   bash tools/gpu_check.sh table           # one GPU: issue 13's table with the HF peer, where each of its four
#                                           # steps goes (profile_step), B=32 x 16 and the 3B shape (about 6 min)
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
if [ "$what" = pair ]; then
  # device time counts by the second whatever the GPUs do, so keep both busy: test files alternate
  # between the two GPUs, and the two-GPU tests (test_dist.py) run beside them on both
  nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$out/gpu.txt"
  files=$(ls tests/test_*.py | grep -v -e test_dist.py -e test_kernel_emulation.py)
  g0=$(echo "$files" | awk 'NR % 2 == 1')
  g1=$(echo "$files" | awk 'NR % 2 == 0')
  p="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE ${PYTEST_ARGS:-}"
  $p tests/test_dist.py > "$out/gpu_nccl.log" 2>&1 & n=$!
  CUDA_VISIBLE_DEVICES=0 $p $g0 > "$out/gpu_tests0.log" 2>&1 & a=$!
  CUDA_VISIBLE_DEVICES=1 $p $g1 > "$out/gpu_tests1.log" 2>&1 & b=$!
  for job in $n $a $b; do wait $job || status=1; done
  for f in "$out"/gpu_nccl.log "$out"/gpu_tests0.log "$out"/gpu_tests1.log; do
    echo "== $f"; grep -E "passed|skipped|failed|FAILED|ERROR|no tests ran" "$f" | tail -15
  done
  exit "$status"
fi
if [ "$what" = suite ]; then
  # one process leaves the GPU idle between small kernels: three keep it busy and take about a third of the time
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  files=$(ls tests/test_*.py | grep -v -e test_dist.py -e test_kernel_emulation.py)
  p="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE ${PYTEST_ARGS:-}"
  pids=()
  for k in 0 1 2; do
    $p $(echo "$files" | awk -v k=$k 'NR % 3 == k') > "$out/gpu_tests$k.log" 2>&1 & pids+=($!)
  done
  for job in "${pids[@]}"; do wait $job || status=1; done
  for k in 0 1 2; do
    echo "== $out/gpu_tests$k.log"; grep -E "passed|skipped|failed|FAILED|ERROR|no tests ran" "$out/gpu_tests$k.log" | tail -15
  done
  exit "$status"
fi
if [ "$what" = dist ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 tools/bench_train.py --preset qwen2.5-0.5b qwen2.5-1.5b --dtype bf16 fp8 \
    --gpus 2 --zero-stage 1 --no-peer --steps 20 --warmup 3 2>&1 | tee "$out/bench_train_2gpu.log" || status=1
  timeout ${BENCH_TIMEOUT:-300} python3 tools/profile_dist.py --preset qwen2.5-1.5b --dtype bf16 --gpus 2 2>&1 \
    | grep -v -e Warning -e _warn_once | tee "$out/profile_dist.log" || status=1
  exit "$status"
fi
if [ "$what" = fp8-delayed ]; then
  nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
  p="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
  $p tests/test_fp8_delayed.py tests/test_activations.py tests/test_fp8.py > "$out/gpu_tests0.log" 2>&1 & a=$!
  $p tests/test_model.py tests/test_train_perf.py > "$out/gpu_tests1.log" 2>&1 & b=$!
  $p tests/test_training_semantics.py tests/test_compile.py tests/test_mlp.py > "$out/gpu_tests2.log" 2>&1 & c=$!
  for job in $a $b $c; do wait $job || status=1; done
  for k in 0 1 2; do echo "== gpu_tests$k"; grep -E "passed|failed|FAILED|ERROR" "$out/gpu_tests$k.log" | tail -12; done
  python3 tools/bench_kernels.py --family swiglu 2>&1 | tee "$out/bench_kernels.log"
  for r in 1 2; do
    for v in current delayed; do
      flag=(--fp8-amax-history 0); [ $v = delayed ] && flag=(--fp8-amax-history 16)
      python3 tools/bench_train.py --no-peer --steps 10 --warmup 3 --preset qwen2.5-0.5b qwen2.5-1.5b --dtype fp8 \
        "${flag[@]}" 2>&1 | grep -E "ms/step" | sed "s/^/$v r$r  /"
    done
  done | tee "$out/bench_train_delayed.log"
  exit "$status"
fi
if [ "$what" = fp8-loss ]; then
  python3 tools/fp8_loss.py --recipes bf16 fp8 fp8-delayed --seeds 0 1 2 --out "$out/fp8runs" 2>&1 \
    | tee "$out/fp8_loss.log" || status=1
  exit "$status"
fi
if [ "$what" = table ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee "$out/gpu.txt"
  clean() { grep -v -e Warning -e warn_once; }
  timeout 300 python3 tools/bench_train.py --preset qwen2.5-0.5b qwen2.5-1.5b --dtype bf16 fp8 --steps 10 --warmup 3 \
    2>&1 | clean | tee "$out/bench_train.log" || status=1
  for preset in qwen2.5-0.5b qwen2.5-1.5b; do
    for dtype in bf16 fp8; do
      timeout 100 python3 tools/profile_step.py --preset $preset --dtype $dtype --rows 45 2>&1 | clean \
        > "$out/profile_${preset}_$dtype.log" || status=1
      head -3 "$out/profile_${preset}_$dtype.log"
    done
  done
  timeout 100 python3 tools/bench_train.py --preset qwen2.5-0.5b qwen2.5-1.5b --dtype bf16 --batch 32 --grad-accum 16 \
    --no-peer --steps 2 --warmup 2 2>&1 | clean | tee "$out/bench_train_b32.log" || status=1
  timeout 150 python3 tools/bench_train.py --preset qwen2.5-3b --dtype bf16 fp8 --no-peer --steps 6 --warmup 2 2>&1 \
    | clean | tee "$out/bench_train_3b.log" || status=1
  exit "$status"
fi
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
