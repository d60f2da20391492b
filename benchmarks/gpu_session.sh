#!/usr/bin/env bash
# One batched session on the GPU machine: each argument is a stage, run in order.
#   tests        the gpu-marked suite (pytest -m gpu), log in $OUT/gpu_tests.log
#   softmax      the gpu-marked unfused softmax tests alone
#   sanitize     every kernel variant under compute-sanitizer memcheck (benchmarks/sanitize_kernels.py)
#   bench:L1,L2  benchmarks/run_gpu.py at those sequence lengths -> $OUT/gpu-bench-L1-L2.json
#   train        examples.bench_train (GPT-style model, S=8192) -> $OUT/train.json
# Usage there (after the wheel install prefix): bash benchmarks/gpu_session.sh tests sanitize
set -u
OUT=${OUT:-/tmp/splat-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    softmax)
      timeout 200 python3 -m pytest -q -m gpu tests/test_ops.py -k softmax -p no:cacheprovider 2>&1 | tail -3 ;;
    tests)
      # the flax tests are CPU-only (no gpu marker); flax 0.12 does not import with jax 0.11
      timeout 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs --ignore=tests/test_flax.py \
        --ignore=tests/test_examples.py --ignore=tests/test_sparsify.py >"$OUT/gpu_tests.log" 2>&1
      echo "pytest rc=$?"; tail -4 "$OUT/gpu_tests.log" ;;
    sanitize)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 benchmarks/sanitize_kernels.py >"$OUT/sanitizer.log" 2>&1
      echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|launches|Invalid|Error" "$OUT/sanitizer.log" | tail -6 ;;
    bench:*)
      lengths=${stage#bench:}
      tag=${lengths//,/-}
      timeout 520 python3 benchmarks/run_gpu.py --lengths ${lengths//,/ } --repeats 6 \
        --out "$OUT/gpu-bench-$tag.json" >"$OUT/bench-$tag.log" 2>&1
      echo "bench rc=$?"; grep -vE "^\s*$" "$OUT/bench-$tag.log" | tail -75 ;;
    train)
      timeout 300 python3 -m examples.bench_train >"$OUT/train.json" 2>"$OUT/train.log"
      echo "train rc=$?"; tail -c 2500 "$OUT/train.json"; tail -5 "$OUT/train.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
