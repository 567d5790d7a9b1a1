#!/usr/bin/env bash
# One device call: GPU tests, the full test suite on the device's torch, classify on the 200 samples,
# and the benchmarks. Everything lands under $OUT. Usage (device tool): bash bench/device_run.sh [PARTS]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
OUT=${OUT:-out}; mkdir -p "$OUT"
parts=${1:-tests,classify,e2e}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip -e failed (using PYTHONPATH)"
if [[ $parts == *gputests* ]]; then
  python3 -m pytest -q -s -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "Error|error:|passed|failed|agreement" | tail -12
elif [[ $parts == *tests* ]]; then
  python3 -m pytest -q -s tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  python3 -m pytest -q tests 2>&1 | tee -a "$OUT/gpu_tests.log" | grep -E "Error|error:|passed|failed" | tail -12
fi
if [[ $parts == *classify* ]]; then
  python3 -m fullthrottle.cli classify tests/data/imagenet-sample --device cuda --no-progress \
    --out "$OUT/classify.jsonl" --report-json "$OUT/classify_report.json" >/dev/null 2>"$OUT/classify_summary.txt"
  echo "classify exit $?"; cat "$OUT/classify_summary.txt"
fi
if [[ $parts == *probe* ]]; then
  python3 bench/threads_probe.py --threads 1,8,12,16,24 --out "$OUT/threads_probe.json" 2>&1 | tail -25
fi
if [[ $parts == *e2e640* || $parts == *e2e,* || $parts == *e2e ]]; then
  python3 bench/e2e_cpu_decode.py --images 640x480 ${E2E_ARGS:-} --out "$OUT/e2e_cpu_decode_640x480.json" 2>&1 | tail -4
fi
if [[ $parts == *e2emixed* || $parts == *e2e,* || $parts == *e2e ]]; then
  python3 bench/e2e_cpu_decode.py --images mixed --n 20000 --out "$OUT/e2e_cpu_decode_mixed.json" 2>&1 | tail -4
fi
if [[ $parts == *graphs* ]]; then
  python3 bench/graphs.py --out "$OUT/graphs_resnet18.json" 2>&1 | tail -30
fi
