#!/usr/bin/env bash
# The device run: install, GPU tests, step profiles, benchmarks. Logs under $OUT (or ./out).
# SUITE picks the parts: any of tests profile decode spec kernels tune variants (default: tests
# profile).
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
  timeout ${TUNE_TIMEOUT:-300} python3 tools/tune_linear.py ${TUNE_ARGS:-} --out "$OUT" \
    2>&1 | tee "$OUT/tune_linear.log" | grep -v "^ " | tail -40
fi
if has variants; then  # tools/decode_variants.py: whole decode steps, a process each
  for v in ${VARIANTS:-shipped down1024 norm2048 norm4x2048}; do
    timeout 120 python3 tools/decode_variants.py $v ${VARIANT_ARGS:-} 2>&1 | grep '"variant"'
  done | tee -a "$OUT/decode_variants.log"
  for v in ${VARIANTS_B64:-shipped down-triton lmhead-triton both-triton}; do
    timeout 120 python3 tools/decode_variants.py $v --batch 64 2>&1 | grep '"variant"'
  done | tee -a "$OUT/decode_variants.log"
fi
if has kernels; then
  timeout 120 python3 tools/bench_kernels.py --out "$OUT/kernels.json" 2>&1 \
    | tee "$OUT/bench_kernels.log" | tail -30
fi
