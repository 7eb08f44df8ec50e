#!/usr/bin/env bash
# The device run: install, GPU tests, step profiles, benchmarks. Logs under $OUT (or ./out).
# SUITE picks the parts: any of tests profile decode spec kernels tune variants tp quant
# (default: tests profile). quant: the quantized-weight and fp8-KV tests, then llama-8b decode
# in bf16, fp8 and int4 in one call (the goals), and with the fp8 KV cache. tp needs
# two GPUs: the two-GPU tests, llama-8b at size 1 and 2, the all-reduce profile and llama-70b
# at size 2.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
SUITE=${SUITE:-"tests profile"}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
has() { [[ " $SUITE " == *" $1 "* ]]; }
if has tests; then
  # SIGINT on timeout: pytest stops cleanly and still prints failures and durations.
  timeout -s INT ${TEST_TIMEOUT:-540} python3 -m pytest -v -m gpu ${TEST_PATHS:-tests/} \
    -p no:cacheprovider --durations=25 \
    -rfE > "$OUT/test_gpu.log" 2>&1
  grep -E "FAILED|ERROR| passed| failed|slowest|^[0-9.]+s " "$OUT/test_gpu.log" | tail -60
fi
if has profile; then
  timeout ${PROFILE_TIMEOUT:-150} python3 tools/profile_step.py ${PROFILE_ARGS:---model llama-1b --batch 1 64} \
    --out "$OUT" 2>&1 | grep -v Warning > "$OUT/profile.log"; grep -v "^  " "$OUT/profile.log" | head -20
fi
if has decode; then
  timeout ${DECODE_TIMEOUT:-300} python3 tools/bench.py decode ${DECODE_ARGS:-} --out "$OUT" \
    2>&1 | tee "$OUT/decode.log" | tail -40
fi
if has spec; then
  timeout ${SPEC_TIMEOUT:-300} python3 tools/bench.py spec ${SPEC_ARGS:-} --out "$OUT" \
    2>&1 | tee "$OUT/spec.log" | tail -30
fi
if has tune; then
  timeout ${TUNE_TIMEOUT:-300} python3 tools/lab/tune_linear.py ${TUNE_ARGS:-} --out "$OUT" \
    2>&1 | tee "$OUT/tune_linear.log" | grep -v "^ " | tail -40
fi
if has variants; then  # tools/lab/decode_variants.py: whole decode steps, a process each
  # VARIANTS: space-separated tuning-table entries to try, one run each ("-" is the table as
  # shipped), e.g. VARIANTS="- linear.auto_max_rows=8"
  for v in ${VARIANTS:--}; do
    set_arg=(); [ "$v" != "-" ] && set_arg=(--set "$v")
    timeout 120 python3 tools/lab/decode_variants.py "${set_arg[@]}" ${VARIANT_ARGS:-} 2>&1 \
      | grep '"set"'
  done | tee -a "$OUT/decode_variants.log"
fi
if has kernels; then
  timeout 120 python3 tools/bench_kernels.py --out "$OUT/kernels.json" 2>&1 \
    | tee "$OUT/bench_kernels.log" | tail -30
fi
if has quant; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_quant.py \
    tests/test_kernels_quant_linear.py tests/test_kernels_quant_ops.py tests/test_kernels_kv_fp8.py \
    -rfE > "$OUT/test_quant.log" 2>&1; tail -5 "$OUT/test_quant.log"
  timeout ${QUANT_TIMEOUT:-400} python3 tools/bench.py decode --models llama-8b --batches 1 16 64 \
    --shapes 128+128 --modes async+graphs --hf-kinds --quantization none fp8 int4 \
    --kv-cache-dtype auto fp8 --out "$OUT" 2>&1 | tee "$OUT/quant.log" | grep '^|'
fi
if has tp; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_tensor_parallel.py \
    tests/test_gpu_tensor_parallel_quant.py -rfE > "$OUT/test_tp.log" 2>&1
  tail -5 "$OUT/test_tp.log"
  timeout 200 python3 tools/bench.py decode --models llama-8b --batches 1 64 --shapes 128+128 \
    --modes async+graphs --hf-kinds --tp 1 2 --out "$OUT" 2>&1 | tee "$OUT/tp.log" | grep '^|'
  GRAPHEXEC_PDL=off timeout 100 python3 tools/profile_step.py --model llama-8b --batch 1 \
    --engine-gaps 100 --tp 2 > "$OUT/profile_tp.log" 2>&1
  grep -E '"all_reduce_us_per_step"|"mean"' "$OUT/profile_tp.log" | head -3
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 240 python3 tools/bench.py decode \
    --models llama-70b --batches 1 64 --shapes 128+128 --modes async+graphs --hf-kinds --tp 2 \
    --out "$OUT" 2>&1 | tee "$OUT/tp70.log" | grep '^|'
fi
