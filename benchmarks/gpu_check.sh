#!/usr/bin/env bash
# One command for a CUDA machine: build the extension, run the CUDA tests and the GPU
# benchmarks (the reduction of BENCHMARKS.md, the runtime ratios of its second part, CPU replicas
# on the host's cores), then the whole suite on that host, and write OUTDIR/gpu_check.json and
# OUTDIR/summary.txt (one screen; also printed). Steps run in order of importance, each with its own
# time limit, even when an earlier one fails; each step's exit status and output (OUTDIR/<step>.log)
# are kept. The whole run stays within GPU_CHECK_SECONDS (default 420): a step gets what is left
# when that is less than its own limit, and is skipped (exit "skip") when under 10 seconds are left.
#
#   bash benchmarks/gpu_check.sh OUTDIR
set -u

out=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts in benchmarks/ import minidp, installed or not
export MINIDP_EXT=1              # a failed build is an error here, not a silent fallback
export MINIDP_BENCH_DEVICE=cuda
py=${PYTHON:-python3}  # the CUDA machines name their interpreter python3 only
budget=${GPU_CHECK_SECONDS:-420}

names=() codes=() seconds=()

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND, output to OUTDIR/NAME.log, records its exit.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "== $name: skipped, the run's $budget s are spent"
    names+=("$name") codes+=("skip") seconds+=(0)
    return
  fi
  echo "== $name: $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local code=$?
  names+=("$name") codes+=("$code") seconds+=($((SECONDS - start)))
  echo "   exit $code after $((SECONDS - start)) s"
}

step env 20 bash -c "nvidia-smi; $py -c 'import torch; print(torch.__version__, torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'"
step nvcc 10 nvcc --version
step build 150 "$py" -c "from minidp import ext; ext.load(verbose=True); print('cuda build:', ext.load().has_cuda)"
step tests 90 "$py" -m pytest -m cuda tests/ -q -rs -p no:cacheprovider
step bench 50 "$py" benchmarks/bench_reduce.py --summary --json "$out/bench.json"
step ratios 45 "$py" -m minidp bench --device cuda
step nccl 25 "$py" benchmarks/bench_ddp.py --backend nccl --rounds 20   # says why when NCCL cannot run 2 ranks here
step fsdp 25 "$py" benchmarks/bench_fsdp.py --backend nccl --rounds 20  # fully_shard vs FSDP2; the same
# CPU replicas against one device and torch DDP where there are more cores than one process's threads: the host
# where the replicas' backwards run in parallel by default (2 teams of 8 on 16 cores), and with all the threads.
step cpu 70 bash -c "$py benchmarks/bench_cpu_replicas.py --rounds 3 --threads 8 && $py benchmarks/bench_cpu_replicas.py --rounds 3"
step memory 30 "$py" -m benchmarks.steady_memory --device cuda --steps 1000
# The whole suite on a host that has a GPU (defaults that differ there: device_ids, the demo, the extension),
# in 8 workers of 2 threads each where pytest-xdist and pytest-timeout are installed; FAILED lines appear in
# suite.log as they happen.
workers=()
"$py" -c "import xdist, pytest_timeout" 2>/dev/null && workers=(-n 8 --timeout 120)
step suite 400 env OMP_NUM_THREADS=2 "$py" -m pytest tests/ -v -rf -p no:cacheprovider "${workers[@]}"
step groups 60 env MINIDP_BENCH_QUICK=1 "$py" -m pytest benchmarks/ -m cuda -q -p no:cacheprovider --benchmark-columns=median,min,rounds --benchmark-sort=name

# gpu_check.json: each step's exit status and seconds, and the benchmark rows when there are any.
{
  echo '{'
  echo '  "steps": {'
  for i in "${!names[@]}"; do
    sep=','; [ "$i" -eq $((${#names[@]} - 1)) ] && sep=''
    echo "    \"${names[$i]}\": {\"exit\": $([ "${codes[$i]}" = skip ] && echo null || echo "${codes[$i]}"), \"seconds\": ${seconds[$i]}}$sep"
  done
  echo '  },'
  if [ -s "$out/bench.json" ]; then printf '  "bench": '; cat "$out/bench.json"; echo; else echo '  "bench": null'; fi
  echo '}'
} >"$out/gpu_check.json"

{
  echo "gpu_check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null)"
  for i in "${!names[@]}"; do printf '  %-6s exit %-3s %4s s\n' "${names[$i]}" "${codes[$i]}" "${seconds[$i]}"; done
  echo "-- GPUs"; grep -m1 -E '^[0-9]+\.[0-9]+' "$out/env.log"
  echo "-- tests"; tail -n 1 "$out/tests.log"
  echo "-- reduction (ms; ratios < 1 mean the extension is faster)"; sed -n '/^device /,$p' "$out/bench.log" 2>/dev/null
  echo "-- runtime ratios"; tail -n 25 "$out/ratios.log" 2>/dev/null
  echo "-- steady memory"; tail -n 4 "$out/memory.log" 2>/dev/null
  echo "-- minidp.distributed vs torch DDP on NCCL"; tail -n 6 "$out/nccl.log" 2>/dev/null
  echo "-- fully_shard vs FSDP2 on NCCL"; tail -n 6 "$out/fsdp.log" 2>/dev/null
  echo "-- CPU replicas vs one device and torch DDP (--threads 8, then all threads)"; grep -E '^(SmallCNN|variant|minidp|one|torch)' "$out/cpu.log" 2>/dev/null
  echo "-- the whole suite"; grep -E " (FAILED|ERROR) " "$out/suite.log" 2>/dev/null | head -40; tail -n 3 "$out/suite.log" 2>/dev/null
  echo "-- failing steps"
  for i in "${!names[@]}"; do
    [ "${codes[$i]}" != 0 ] && [ "${codes[$i]}" != skip ] && { echo "   ${names[$i]}:"; tail -n 8 "$out/${names[$i]}.log" | sed 's/^/     /'; }
  done
  true
} | tee "$out/summary.txt"

for code in "${codes[@]}"; do [ "$code" = 0 ] || exit 1; done
