#!/usr/bin/env bash
# GPU checks in one go on any NVIDIA machine (about 6-8 minutes in all):
#   tests:     the Triton kernel tests (tests/unit/test_triton_attention.py, the layers' fused
#              elementwise kernels in test_triton_elementwise.py) on the GPU, bf16
#              included, and the CUDA-graph decode tests (tests/unit/test_decode_graphs.py:
#              captured graphs against the CPU engine's tokens, padding rows write no K/V);
#   engine:    benchmarks/gpu/engine_check.py: the whole engine, CUDA graphs against eager
#              (tokens, start-up, one-stream and batch speed); writes benchmarks/gpu/ENGINE.md;
#   attention: benchmarks/gpu/bench_attention.py: memory bandwidth, decode attention against its
#              HBM floor, prefill attention against torch's flash SDPA; writes RESULTS.md.
# Needs python with a CUDA build of torch and triton (PYTHON=... to pick one); tessera itself
# need not be installed: the repository root goes on PYTHONPATH.
#   bash benchmarks/gpu/run.sh                      # every step
#   STEPS="tests engine" bash benchmarks/gpu/run.sh # some of them
#   QUICK=1 bash benchmarks/gpu/run.sh              # fewer tile settings in the attention sweep
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

"$PY" - <<'PYCHECK' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"run.sh needs an NVIDIA GPU and a CUDA build of torch; torch {torch.__version__} sees no GPU")
import triton
print(f"{torch.cuda.get_device_name(0)}: torch {torch.__version__}, triton {triton.__version__}")
PYCHECK
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || true

STEPS=${STEPS:-tests engine attention}
rc=0
tests_file=benchmarks/gpu/tests.txt

if [[ " $STEPS " == *" tests "* ]]; then
  log=$(mktemp)
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_triton_attention.py tests/unit/test_triton_elementwise.py \
    tests/unit/test_decode_graphs.py 2>&1 | tee "$log"
  tests_rc=${PIPESTATUS[0]}
  summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$log" | tail -1 | tr -d '=' | xargs)
  summary="${summary:-no summary (exit code $tests_rc)}"
  if [ "$tests_rc" -ne 0 ]; then
    summary="FAILED (exit code $tests_rc): $summary; failures: $(grep -E '^FAILED' "$log" | cut -c1-160 | tr '\n' ';')"
    rc=1
  fi
  echo "$summary" > "$tests_file"
  echo "kernel and graph tests: $summary"
fi

if [[ " $STEPS " == *" engine "* ]]; then
  timeout 300 "$PY" benchmarks/gpu/engine_check.py --out benchmarks/gpu/ENGINE.md \
    --json benchmarks/gpu/engine.json || rc=1
fi

if [[ " $STEPS " == *" attention "* ]]; then
  summary=$(cat "$tests_file" 2>/dev/null || echo "not run")
  timeout 330 "$PY" benchmarks/gpu/bench_attention.py --tests "$summary" ${QUICK:+--quick} \
    --out benchmarks/gpu/RESULTS.md --json benchmarks/gpu/results.json || rc=1
fi
exit $rc
