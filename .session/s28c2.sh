#!/usr/bin/env bash
# Twenty-eighth session, call 2: delayed FP8 scaling (fp8_amax_history) on the GPU: tests, kernels, the step
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader
p="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
$p tests/test_fp8_delayed.py tests/test_activations.py tests/test_fp8.py > "$out/t1.log" 2>&1 &
$p tests/test_model.py tests/test_train_perf.py > "$out/t2.log" 2>&1 &
$p tests/test_training_semantics.py tests/test_compile.py tests/test_mlp.py > "$out/t3.log" 2>&1 &
wait
for f in t1 t2 t3; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR" "$out/$f.log" | tail -12; done
python3 tools/bench_kernels.py --family swiglu 2>&1 | tee "$out/kern.log" | grep -E "swiglu|copy"
for r in 1 2; do
  for v in cur del; do
    flag=""; [ $v = del ] && flag="--fp8-amax-history 16"
    python3 tools/bench_train.py --no-peer --steps 10 --warmup 3 --preset qwen2.5-0.5b qwen2.5-1.5b --dtype fp8 $flag \
      2>&1 | grep -E "ms/step" | sed "s/^/$v r$r  /"
  done
done | tee "$out/train.log"
