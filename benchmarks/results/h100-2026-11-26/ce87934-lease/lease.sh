#!/usr/bin/env bash
# One short lease: the CUDA extension's build, tests and sanitizers beside the Triton tests that the
# last run did not reach (from a copy of the tree without the extension).  Deadline-driven.
out=$1; deadline=$((SECONDS + ${2:-250}))
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=2
mkdir -p "$out/c" "$out/t"
left() { local l=$((deadline - SECONDS)); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
copy=$(mktemp -d); tar cf - --exclude=./.whl --exclude=./.git . | tar xf - -C "$copy"
(cd "$copy" && PYTHONPATH="$copy" timeout -s INT -k 10 $(left 170) python3 -m pytest \
  tests/test_qkv.py tests/test_triton_direct_launch.py tests/test_cuda_graphs.py tests/test_generation.py \
  tests/test_train.py tests/test_bench.py tests/test_supported_versions.py tests/test_models_transformer.py \
  tests/test_models_conv_seq2seq.py tests/test_attention.py::test_torch_compile_fullgraph_matches_eager \
  tests/test_glu_conv.py::test_torch_compile_fullgraph_encoder_layer \
  tests/test_glu_conv.py::test_fp32_error_is_within_twice_the_direct_convolutions \
  -k "not cuda or (graphs and triton)" -q -m "not slow" -p no:cacheprovider -n 5 -rf \
  --junitxml="$out/t/tests.xml" > "$out/t/tests.log" 2>&1) &
{
  python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl
  s=$SECONDS
  TORCH_CUDA_ARCH_LIST=9.0a TRANSFORMER_KERNELS_BUILD_CUDA=1 MAX_JOBS=16 timeout $(left 160) \
    python3 -m pip install --no-build-isolation --no-deps -v -e .
  echo "build: exit $? in $((SECONDS - s)) s"
} > "$out/c/build.log" 2>&1
timeout -s INT -k 10 $(left 75) python3 -m pytest tests --ignore=tests/test_cuda_host.py --ignore=tests/test_cuda_build.py \
  -k "cuda and not (graphs and triton)" -q -m "not slow" -p no:cacheprovider -n 8 -rf \
  --junitxml="$out/c/tests.xml" > "$out/c/tests.log" 2>&1
echo "cuda tests: exit $?" >> "$out/c/build.log"
timeout -k 5 $(left 40) compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/cuda_smoke.py > "$out/c/memcheck.log" 2>&1
echo "memcheck: exit $?" >> "$out/c/build.log"
[ $(left 999) -gt 20 ] && { timeout -k 5 $(left 999) compute-sanitizer --tool racecheck --error-exitcode 1 python3 benchmarks/cuda_smoke.py > "$out/c/racecheck.log" 2>&1; echo "racecheck: exit $?" >> "$out/c/build.log"; }
wait
cat "$out/c/build.log" | grep -E "exit|error" ; tail -3 "$out/t/tests.log" "$out/c/tests.log"
