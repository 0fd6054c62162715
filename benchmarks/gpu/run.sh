#!/usr/bin/env bash
# GPU check of the Triton attention backend, in one go on any NVIDIA machine (about 3-5 minutes):
#   1. the kernel tests (tests/unit/test_triton_attention.py) on the GPU, bf16 included;
#   2. benchmarks/gpu/bench_attention.py: memory bandwidth, decode attention against its HBM
#      floor, prefill attention against torch's flash SDPA; it writes benchmarks/gpu/RESULTS.md.
# Needs python with a CUDA build of torch and triton (PYTHON=... to pick one); tessera itself
# need not be installed: the repository root goes on PYTHONPATH.
#   bash benchmarks/gpu/run.sh            # full sweep
#   QUICK=1 bash benchmarks/gpu/run.sh    # fewer tile settings
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

log=$(mktemp)
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_triton_attention.py 2>&1 | tee "$log"
tests_rc=${PIPESTATUS[0]}
summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$log" | tail -1 | tr -d '=' | xargs)
summary="${summary:-no summary (exit code $tests_rc)}"
if [ "$tests_rc" -ne 0 ]; then
  summary="FAILED (exit code $tests_rc): $summary; failures: $(grep -E '^FAILED' "$log" | cut -c1-160 | tr '\n' ';')"
fi

timeout 330 "$PY" benchmarks/gpu/bench_attention.py --tests "$summary" ${QUICK:+--quick} \
  --out benchmarks/gpu/RESULTS.md --json benchmarks/gpu/results.json
bench_rc=$?
echo "kernel tests: $summary"
exit $(( tests_rc != 0 || bench_rc != 0 ))
