#!/usr/bin/env bash
# The GPU check (issue #37), for a machine with a CUDA device, from the repository root with the
# package installed: the CUDA tests, remote == local for an HF Llama with labels= on CUDA, and lrmp's
# throughput with 2 stages on one GPU against the same model trained locally (hidden 1024, bf16,
# m = 1 and 4). Under 8 minutes; prints a table per check and a summary, exits non-zero on a failure.
# Without a CUDA device it says so and exits 0 (CI has none).
#
#   bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: torch ($PY) sees no CUDA device here (or is not installed): skipped"
    exit 0
fi
"$PY" -c "import torch; print(f'# lrmp GPU check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}')"
started=$SECONDS
echo; echo "## CUDA tests"; echo
timeout 180 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_device_io.py tests/test_faults.py -k "cuda or device_io"
tests=$?
timeout 270 "$PY" scripts/gpu_llama.py
llama=$?
echo
echo "| check | result |"
echo "|---|---|"
echo "| CUDA tests | $([ $tests -eq 0 ] && echo passed || echo "FAILED ($tests)") |"
echo "| HF Llama: remote == local, throughput | $([ $llama -eq 0 ] && echo passed || echo "FAILED ($llama)") |"
echo "| seconds | $((SECONDS - started)) |"
[ $tests -eq 0 ] && [ $llama -eq 0 ]
