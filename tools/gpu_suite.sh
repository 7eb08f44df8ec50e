#!/usr/bin/env bash
# The device run: install, GPU tests, kernel benchmarks. Logs under $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/test_gpu.log" | tail -25
timeout ${BENCH_TIMEOUT:-120} python3 tools/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.log" | tail -30
