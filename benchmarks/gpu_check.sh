#!/usr/bin/env bash
# One-shot verification on a CUDA machine without network access:
#   bash benchmarks/gpu_check.sh [OUTDIR]      # default benchmarks/results/<gpu>-<date>/
# Installs the package (building the CUDA extension when there is one), runs the GPU tests, runs
# every Triton kernel under compute-sanitizer, the gradient self-check (--check) and the full
# benchmark report.  Everything lands in OUTDIR, which is what gets committed:
#   gpu_check.log  tests.xml  check.md  report.md  results.json  *.png
# Budget: about 10 minutes on one H100; each step has its own time limit.
set -u
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr '[:upper:]' '[:lower:]' \
      | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
out=${1:-benchmarks/results/$gpu-$(date -u +%F)}
mkdir -p "$out"
log="$out/gpu_check.log"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
status=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)" | tee -a "$log"
    timeout -k 30 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
    return $rc
}

{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$log" 2>&1
step install 150 python3 -m pip install --no-build-isolation --no-deps -e .
# Compiling the kernels dominates the tests: spread them over processes when pytest-xdist is there.
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
step tests 240 python3 -m pytest tests -q -m "not slow" -p no:cacheprovider $parallel -rf --junitxml="$out/tests.xml"
step sanitizer 120 compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/gpu_smoke.py
step check 120 bash -c "set -o pipefail; python3 -m transformer_kernels.bench --check | tee '$out/check.md'"
# results.json is rewritten after every group; stopped by its time limit, the command still
# writes report.md and the plots from what it measured.
step benchmarks 360 python3 -m transformer_kernels.bench --full --out "$out"
tail -n 40 "$out/report.md" 2>/dev/null
grep -E "^=== .*exit" "$log"
exit $status
