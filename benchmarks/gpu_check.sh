#!/usr/bin/env bash
# The GPU figures of docs/benchmarks-runtime.md, on a machine with a CUDA GPU, from the repository root:
#   bash benchmarks/gpu_check.sh            (MINIDP_BENCH_QUICK=1 for the short version, ~2 minutes)
# 1. the ratio table (minidp / stock, minidp / single GPU; per-step overhead vs stock's; cached
#    replicate vs uncached and vs stock replicate), 2. every CUDA benchmark group, 3. steady memory.
set -euo pipefail
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')"
python -m minidp bench --device cuda $([ "${MINIDP_BENCH_QUICK:-0}" = "1" ] || echo --full)
python -m pytest benchmarks/ -m cuda -q -p no:cacheprovider --benchmark-columns=median,min,rounds --benchmark-sort=name
python -m benchmarks.steady_memory --device cuda --steps 1000
