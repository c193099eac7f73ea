#!/usr/bin/env bash
# One-shot verification on a CUDA machine without network access:
#   bash benchmarks/gpu_check.sh OUTDIR
# Installs the package and builds the CUDA extension (both dtypes, sm_80 and sm_90a: the full set),
# runs the GPU tests (the cuda backend included), runs every Triton kernel under compute-sanitizer
# memcheck and one small case per CUDA extension kernel under memcheck and racecheck, and writes the
# benchmark report. Everything lands in OUTDIR (at most 8 files):
#   gpu_check.log  tests.xml  report.md  results.csv  environment.json  <suite>.json
# The extension needs the CUTLASS headers (the nvidia-cutlass wheel). Without network, bring the
# wheel along in .whl/ (git-ignored; pass it with the tree):
#   pip download --no-deps -d .whl nvidia-cutlass==4.2.0.0
# and it is installed from there (--no-deps: the headers need none of its dependencies).
# Budget: about 13 minutes on one H100; each step has its own time limit.
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
log="$out/gpu_check.log"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
status=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)" | tee -a "$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
    return $rc
}

{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$log" 2>&1
if ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
    step cutlass 60 python3 -m pip install --no-index --no-deps .whl/nvidia_cutlass-*.whl
fi
# Forced: a missing CUTLASS or nvcc fails the install instead of skipping the extension.
TRANSFORMER_KERNELS_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} step install 420 \
    python3 -m pip install --no-build-isolation --no-deps -v -e .
# Compiling the kernels dominates the tests: spread them over processes when pytest-xdist is there.
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
# Every kernel source with both dtypes for sm_80 and sm_90a: ptxas spills or local memory fail it.
step nvcc 300 env TRANSFORMER_KERNELS_NVCC_ALL_DTYPES=1 python3 -m pytest tests/test_cuda_compile.py -q \
    -p no:cacheprovider $parallel
step tests 300 python3 -m pytest tests -q -m "not slow" -p no:cacheprovider $parallel -rf --junitxml="$out/tests.xml"
step sanitizer 120 compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/gpu_smoke.py
step cuda-memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/cuda_smoke.py
step cuda-racecheck 180 compute-sanitizer --tool racecheck --error-exitcode 1 python3 benchmarks/cuda_smoke.py
# Every group's per-round times reach <suite>.json as soon as it is measured; should the
# benchmarks run out of time, the report is rewritten from what the JSON holds.
step benchmarks 300 python3 benchmarks/report.py --out "$out"
[ $? -ne 124 ] || step report 60 python3 benchmarks/report.py --report-only --out "$out"
tail -n 40 "$out/report.md" 2>/dev/null
grep -E "^=== .*exit" "$log"
exit $status
