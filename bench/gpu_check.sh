#!/usr/bin/env bash
# One call on a machine with a GPU: the CUDA tests, the mode tests on CUDA, and the mode
# benchmark on cuda (eager, compile[aot_eager], compile[inductor]). Without CUDA it says so and
# exits 0 after the CUDA tests skip cleanly.
#
#   bash bench/gpu_check.sh            # from the repository root, in the project's venv
#   PYTHON=/path/to/python bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
rc=0

"$PY" - <<'PYEOF'
import torch
print(f"torch {torch.__version__}; cuda available: {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
PYEOF

echo "== CUDA tests (marker 'cuda', fast and slow) =="
"$PY" -m pytest -q -m "cuda" -p no:randomly tests/ || rc=$?
[ "$rc" -eq 5 ] && rc=0  # no CUDA tests collected is not a failure

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "== mode benchmark on cuda (30 examples per spec and mode) =="
    "$PY" bench/modes_bench.py --device cuda --examples 30 \
        --modes "eager,compile[aot_eager],compile[inductor]" --friendly || rc=$?
else
    echo "no CUDA device: CUDA tests skipped, benchmark not run on cuda"
fi
exit "$rc"
