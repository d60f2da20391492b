#!/usr/bin/env bash
# One batched session on the GPU machine: each argument is a stage, run in order.
#   tests        the gpu-marked suite (pytest -m gpu), log in $OUT/gpu_tests.log
#   sanitize     the Triton GPU tests under compute-sanitizer memcheck (one allocation per buffer)
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
    tests)
      timeout 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs >"$OUT/gpu_tests.log" 2>&1
      echo "pytest rc=$?"; tail -4 "$OUT/gpu_tests.log" ;;
    sanitize)
      XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m pytest -q -m gpu tests/test_triton_gpu.py -p no:cacheprovider >"$OUT/sanitizer.log" 2>&1
      echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|passed|failed|Invalid" "$OUT/sanitizer.log" | tail -5 ;;
    bench:*)
      lengths=${stage#bench:}
      tag=${lengths//,/-}
      timeout 450 python3 benchmarks/run_gpu.py --lengths ${lengths//,/ } --repeats 10 \
        --out "$OUT/gpu-bench-$tag.json" >"$OUT/bench-$tag.log" 2>&1
      echo "bench rc=$?"; grep -vE "^\s*$" "$OUT/bench-$tag.log" | tail -75 ;;
    train)
      timeout 300 python3 -m examples.bench_train >"$OUT/train.json" 2>"$OUT/train.log"
      echo "train rc=$?"; tail -c 2500 "$OUT/train.json"; tail -5 "$OUT/train.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
