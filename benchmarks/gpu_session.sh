#!/usr/bin/env bash
# One batched session on the GPU machine: each argument is a stage, run in order.
#   tests        the gpu-marked suite (pytest -m gpu), log in $OUT/gpu_tests.log
#   softmax      the gpu-marked unfused softmax tests alone
#   sanitize     every kernel variant under compute-sanitizer memcheck (benchmarks/sanitize_kernels.py)
#   bench:L1,L2  benchmarks/run_gpu.py at those sequence lengths -> $OUT/gpu-bench-L1-L2.json
#   train        examples.bench_train (GPT-style model, S=8192) -> $OUT/train.json
#   compile      benchmarks/compile_time.py (cold / warm first-call times) -> $OUT/compile_time.json
#   unfused      benchmarks/unfused_bw.py (sddmm / softmax / spmm vs copy bandwidth) -> $OUT/unfused_bw.json
#   tune         benchmarks/tune_kernels.py (kernel-structure variants, S=16384) -> $OUT/tune.json
#   smoke        a one-pattern splat tune (stops the session when it fails)
#   autotune     splat tune (pruned, every default pattern, S=8192/16384, triton vs cudnn times): writes
#                the package's store for this device, copied to $OUT/store-<device>.json
#   autotune-ex  splat tune --exhaustive on the forward of four patterns at S=16384 (judges the pruning)
#                -> $OUT/tune-exhaustive.json (the store it writes goes to /tmp, not the package)
#   auto:L1,L2   splat bench --backend auto vs cudnn / FA3 / FlexAttention on the baselines and windows
#   rtests       the gpu-marked runtime-mask tests alone (segment ids, lengths, offsets, soft cap)
#   runtime      splat bench-runtime (documents, Gemma 2 local layer) vs FlexAttention / FA3
#                -> $OUT/bench-runtime.json and .png
#   neighborhood splat bench on the GRID patterns (2-D / 3-D neighborhoods) and full (splat's own
#                dense rate) at S = 16384 vs splat's Triton kernels, FlexAttention and dense cuDNN
#                -> $OUT/bench-neighborhood.json and .png (+ grid pictures)
#   cuda         the cuda backend's tests alone (compile checks + gpu suite), log in $OUT/gpu_cuda.log
#   sanitize-cuda  every cuda-backend variant of its gpu tests under compute-sanitizer memcheck
#                (benchmarks/sanitize_cuda.py: CuPy launches, no XLA; SANITIZE_CUDA_ARGS=grid: the
#                grid forward's alone; =NAME ...: those band cases alone), log in $OUT/sanitizer-cuda.log
#   cudabench:L1,L2  splat bench --backend cuda --mode fwd ($CUDA_MODE: both) on the one-band masks vs splat's Triton, cuDNN,
#                FA3, FlexAttention ($CUDA_PEERS overrides) -> $OUT/bench-cuda-L1-L2.json and .png
#   coldstart    benchmarks/compile_time.py on sliding_window(256, 256) (auto: cuda forward, triton
#                backward) -> $OUT/compile_time_cuda.json
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
    rtests)
      timeout 300 python3 -m pytest -q -m gpu tests/test_runtime_mask.py -p no:cacheprovider -rs -x \
        >"$OUT/gpu_rtests.log" 2>&1
      echo "pytest rc=$?"; grep -E "Error|error|FAIL" "$OUT/gpu_rtests.log" | head -20; tail -4 "$OUT/gpu_rtests.log" ;;
    neighborhood)
      timeout 560 python3 -m splat bench --patterns neighborhood_2d neighborhood_2d_k7 neighborhood_2d_dilated \
        neighborhood_2d_k63 neighborhood_3d full --lengths 16384 --heads 16 --head-dim 128 --dtype bfloat16 --mode both \
        --peers splat splat_triton flex cudnn_dense --out "$OUT/bench-neighborhood.json" --plot "$OUT/bench-neighborhood.png" \
        >"$OUT/bench-neighborhood.log" 2>&1
      echo "neighborhood bench rc=$?"; grep -E "neighborhood" "$OUT/bench-neighborhood.log" | tail -30 ;;
    runtime)
      timeout 420 python3 -m splat bench-runtime --out "$OUT/bench-runtime.json" --plot "$OUT/bench-runtime.png" \
        ${RUNTIME_ARGS:-} >"$OUT/bench-runtime.log" 2>&1
      echo "runtime bench rc=$?"; tail -40 "$OUT/bench-runtime.log" ;;
    tests)
      # the flax tests are CPU-only (no gpu marker); flax 0.12 does not import with jax 0.11
      timeout 380 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs --ignore=tests/test_flax.py \
        --ignore=tests/test_examples.py --ignore=tests/test_sparsify.py >"$OUT/gpu_tests.log" 2>&1
      echo "pytest rc=$?"; tail -4 "$OUT/gpu_tests.log" ;;
    sanitize)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 420 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 benchmarks/sanitize_kernels.py >"$OUT/sanitizer.log" 2>&1
      echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|launches|Invalid|Error" "$OUT/sanitizer.log" | tail -6 ;;
    bench:*)
      lengths=${stage#bench:}
      tag=${lengths//,/-}
      timeout 520 python3 benchmarks/run_gpu.py --lengths ${lengths//,/ } --repeats 6 \
        --out "$OUT/gpu-bench-$tag.json" >"$OUT/bench-$tag.log" 2>&1
      echo "bench rc=$?"; grep -vE "^\s*$" "$OUT/bench-$tag.log" | tail -75 ;;
    train)
      timeout 560 python3 -m examples.bench_train >"$OUT/train.json" 2>"$OUT/train.log"
      echo "train rc=$?"; tail -c 2500 "$OUT/train.json"; tail -5 "$OUT/train.log" ;;
    compile)
      timeout 400 python3 benchmarks/compile_time.py --out "$OUT/compile_time.json" >"$OUT/compile_time.log" 2>&1
      echo "compile rc=$?"; tail -25 "$OUT/compile_time.log" ;;
    unfused)
      timeout 300 python3 benchmarks/unfused_bw.py --out "$OUT/unfused_bw.json" >"$OUT/unfused_bw.log" 2>&1
      echo "unfused rc=$?"; tail -30 "$OUT/unfused_bw.log" ;;
    tune)
      timeout 420 python3 benchmarks/tune_kernels.py --out "$OUT/tune.json" >"$OUT/tune.log" 2>&1
      echo "tune rc=$?"; grep -E "^TUNE" "$OUT/tune.log" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[5:])
    t = r.get('tflops')
    print(r['kind'], r['pattern'], r.get('variant', r.get('impl')), r.get('tiles'), f'{t:.1f}' if t else r.get('error', '')[:150], f\"err {r['err_vs_first']:.1e}\" if 'err_vs_first' in r else '')
"; tail -8 "$OUT/tune.log" ;;
    smoke)
      timeout 120 python3 -m splat tune --patterns causal_window --lengths 8192 --ops fwd bwd_dkdv --top 1 \
        --repeats 2 --out /tmp/smoke-store.json >"$OUT/smoke.log" 2>&1
      rc=$?; echo "smoke rc=$rc"; tail -12 "$OUT/smoke.log"; [ $rc = 0 ] || exit 3 ;;
    autotune)
      timeout 240 python3 -m splat tune --repeats 3 --report "$OUT/tune-report.json" >"$OUT/autotune.log" 2>&1
      echo "autotune rc=$?"; tail -3 "$OUT/autotune.log"; cp jax_bindings/tuning/*.json "$OUT/" 2>/dev/null ;;
    autotune-ex)
      timeout 300 python3 -m splat tune --exhaustive --ops fwd --lengths 16384 --no-backends --repeats 3 \
        --patterns causal causal_window sliding_window dilated_window --out /tmp/tune-ex-store.json \
        --report "$OUT/tune-exhaustive.json" >"$OUT/autotune-ex.log" 2>&1
      echo "autotune-ex rc=$?"; tail -2 "$OUT/autotune-ex.log" ;;
    auto:*)
      lengths=${stage#auto:}
      timeout 200 python3 -m splat bench --backend auto --lengths ${lengths//,/ } --heads 16 --head-dim 128 \
        --dtype bfloat16 --mode both --repeats 5 --peers splat cudnn flash_attn3 flex \
        --patterns ${AUTO_PATTERNS:-causal_window} \
        --out "$OUT/bench-auto.json" >"$OUT/bench-auto.log" 2>&1
      echo "auto bench rc=$?"; tail -30 "$OUT/bench-auto.log" ;;
    cuda)
      timeout 480 python3 -m pytest -q tests/test_cuda_source.py tests/test_cuda_gpu.py tests/test_cuda_runtime_gpu.py \
        tests/test_cuda_grid_tiles.py tests/test_cuda_grid_gpu.py -p no:cacheprovider -rs \
        >"$OUT/gpu_cuda.log" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|Error" "$OUT/gpu_cuda.log" | head -20; tail -3 "$OUT/gpu_cuda.log" ;;
    sanitize-cuda)
      timeout 480 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_cuda.py \
        ${SANITIZE_CUDA_ARGS:-} >"$OUT/sanitizer-cuda.log" 2>&1
      echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|launches|Invalid|Error" "$OUT/sanitizer-cuda.log" | tail -6 ;;
    cudabench:*)
      lengths=${stage#cudabench:}
      tag=${lengths//,/-}
      timeout 420 python3 -m splat bench --backend cuda --lengths ${lengths//,/ } --heads 16 --head-dim 128 \
        --dtype bfloat16 --mode ${CUDA_MODE:-fwd} --repeats 5 --peers ${CUDA_PEERS:-splat splat_triton cudnn flash_attn3 flex} \
        --patterns full causal causal_window sliding_window \
        --out "$OUT/bench-cuda-$tag.json" --plot "$OUT/bench-cuda-$tag.png" >"$OUT/bench-cuda-$tag.log" 2>&1
      echo "cuda bench rc=$?"; tail -40 "$OUT/bench-cuda-$tag.log" ;;
    coldstart)
      timeout 300 python3 benchmarks/compile_time.py --pattern "sliding_window(256, 256)" \
        --out "$OUT/compile_time_cuda.json" >"$OUT/compile_time_cuda.log" 2>&1
      echo "coldstart rc=$?"; tail -25 "$OUT/compile_time_cuda.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
