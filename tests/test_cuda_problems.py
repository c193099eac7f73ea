"""The CUDA extension's argument checks (``csrc/problems.h``: what each launcher relies on, and the
problem it is given) run on CPU tensors: what they accept, and the error each refusal raises.  The raw
ops call them on CUDA tensors (``csrc/bindings.cpp``); here ``tests/csrc/problems_driver.cpp`` does,
compiled against torch's CPU headers and libraries.  Needs a host C++ compiler and the CUDA toolkit's
headers (for ``cuda_runtime.h``'s types in the launchers' headers).
"""

import pathlib
import re
import shutil
import subprocess

import pytest
from _helpers import cuda_include_dir
from torch.utils.cpp_extension import get_cxx_compiler, include_paths, library_paths

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The compiler the extension's build uses (torch's choice: $CXX, else c++).
COMPILER = shutil.which(get_cxx_compiler())
CUDA_INCLUDE = cuda_include_dir()

pytestmark = [
    pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler"),
    pytest.mark.skipif(CUDA_INCLUDE is None, reason="nvcc not found: the CUDA toolkit's headers are needed"),
]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """``driver(lines) -> list of ("ok", fields) or ("error", message)``, one per driver line."""
    binary = tmp_path_factory.mktemp("problems") / "problems_driver"
    libraries = library_paths()[0]
    compiled = subprocess.run(
        [COMPILER, "-std=c++20", "-O0", "-Wall", "-Werror", *(f"-I{path}" for path in include_paths()),
         f"-I{CUDA_INCLUDE}", f"-I{ROOT / 'csrc'}", "-o", str(binary),
         str(ROOT / "tests" / "csrc" / "problems_driver.cpp"), f"-L{libraries}", f"-Wl,-rpath,{libraries}", "-lc10",
         "-ltorch_cpu"],
        capture_output=True, text=True,
    )
    assert compiled.returncode == 0, compiled.stderr[-6000:]

    def run(lines):
        result = subprocess.run([str(binary)], input="".join(line + "\n" for line in lines), capture_output=True,
                                text=True)
        # A crash (a refusal that kills the process rather than raising) shows the calls answered before it.
        assert result.returncode == 0, f"the driver exited with {result.returncode} after:\n{result.stdout}"
        return [tuple(line.split(" ", 1)) for line in result.stdout.splitlines()]

    return run


def _contiguous(dtype, *sizes, offset=0):
    strides, stride = [], 1
    for size in reversed(sizes):
        strides.insert(0, stride)
        stride *= size
    return f"{dtype}:{','.join(map(str, sizes))}:{','.join(map(str, strides))}" + (f":{offset}" if offset else "")


X, WEIGHT, HEAD = _contiguous("f16", 2, 9, 32), _contiguous("f16", 96, 32), _contiguous("f16", 2, 4, 9, 8)
Q, KV = _contiguous("f16", 2, 4, 10, 64), _contiguous("f16", 2, 2, 12, 64)
MASK = _contiguous("bool", 2, 4, 10, 12)

# (call, "ok <fields>" or a pattern of the error message)
CASES = {
    # The decoding step reads rows of C_in * k elements: any kernel size whose rows hold 16-byte chunks.
    "step_k3": (f"step {_contiguous('f16', 3, 24, 3)} {_contiguous('f16', 136, 24, 3)} {_contiguous('f16', 136)} "
                f"{_contiguous('f16', 3, 68, 1)}", "ok 3 24 68 3"),
    "step_k1": (f"step {_contiguous('f16', 2, 8, 1)} {_contiguous('f16', 8, 8, 1)} - -", "ok 2 8 4 1"),
    "step_rows_not_in_chunks": (f"step {_contiguous('f16', 2, 6, 3)} {_contiguous('f16', 8, 6, 3)} - -",
                                r"step: C_in \* k must be a multiple of 8, got 18"),
    "step_weight_mismatch": (f"step {_contiguous('f16', 2, 8, 3)} {_contiguous('f16', 8, 8, 2)} - -",
                             r"step: weight must be a contiguous \[2\*C, C_in, k\] tensor matching window"),
    "step_residual_shape": (f"step {_contiguous('f16', 3, 8, 3)} {_contiguous('f16', 8, 8, 3)} - "
                            f"{_contiguous('f16', 3, 4, 2)}", r"step: residual must be \[B, C, 1\] = \[3, 4, 1\]"),
    "step_bias_length": (f"step {_contiguous('f16', 2, 8, 3)} {_contiguous('f16', 8, 8, 3)} {_contiguous('f16', 6)} -",
                         r"step: bias must be a contiguous \[2\*C\] tensor, got shape \[6\]"),
    "step_float32": (f"step {_contiguous('f32', 2, 8, 3)} {_contiguous('f32', 8, 8, 3)} - -",
                     "step: window must be float16 or bfloat16, got Float"),
    "qkv": (f"qkv {X} {WEIGHT} {HEAD} 3", "ok 3 2 9 32 8"),
    "qkv_head_dim_4": (f"qkv {X} {WEIGHT} {_contiguous('f16', 2, 8, 9, 4)} 3",
                       "qkv: the head dim must be a multiple of 8, got 4"),
    "qkv_x_transposed": (f"qkv f16:2,9,32:288,1,9 {WEIGHT} {HEAD} 3",
                         r"qkv: x must have unit stride along its last dim, got strides \[288, 1, 9\]"),
    "qkv_weight_width": (f"qkv {X} f16:96,16:32,1 {HEAD} 3", r"qkv: weight must be \[n\*E, E\] with E = x.size\(2\) = 32"),
    "qkv_x_misaligned": (f"qkv {_contiguous('f16', 2, 9, 32, offset=4)} {WEIGHT} {HEAD} 3", "qkv: x must be 16-byte aligned"),
    # E = 0 once divided the weight's rows by it (a SIGFPE that took the process down).
    "qkv_no_embedding": ("qkv f16:2,9,0:0,0,1 f16:0,0:0,1 f16:2,1,9,0:0,0,0,1 1",
                         r"qkv: x must be \[B, L, E\] with E > 0, got shape \[2, 9, 0\]"),
    "qkv_weight_dtype": (f"qkv {X} {_contiguous('bf16', 96, 32)} {HEAD} 3", "qkv: weight must have dtype Half, got BFloat16"),
    "conv": (f"conv {_contiguous('f16', 2, 12, 16)} {_contiguous('f16', 8, 48)} 10 1", "ok 16 4 3 10"),
    "conv_channels_in": (f"conv {_contiguous('f16', 2, 12, 12)} {_contiguous('f16', 8, 36)} 10 1",
                         "conv: C_in must be a positive multiple of 8, got 12"),
    # Past 2**31 elements of the pre-activation's gradient, which no tensor given holds: the message
    # names the product.
    "conv_grad_z_too_large": (f"conv {_contiguous('f16', 64, 4098, 16)} {_contiguous('f16', 8192, 48)} 4096 1",
                              r"conv: B \* L_out \* 2C \(the pre-activation's gradient\) must be below 2\*\*31, "
                              r"got 2147483648"),
    "conv_xpad_short": (f"conv {_contiguous('f16', 2, 12, 16)} {_contiguous('f16', 8, 48)} 12 1",
                        "conv: xpad of length 12 does not hold 12 positions after 1 of padding"),
    "attention": (f"attention {Q} {KV} {KV} - - - 0 - 0", "ok 2 4 2 10 12 64 64 padding 0 bounds 0"),
    # No query row (or no batch): an empty grid is an invalid launch, and the backward would leave dk, dv
    # unwritten.
    "attention_no_query": (f"attention {_contiguous('f16', 2, 4, 0, 64)} {KV} {KV} - - - 0 - 0",
                           r"attention: B, Hq and Lq must be positive, got query of shape \[2, 4, 0, 64\]"),
    "attention_no_batch": (f"attention {_contiguous('f16', 0, 4, 10, 64)} {_contiguous('f16', 0, 2, 12, 64)} "
                           f"{_contiguous('f16', 0, 2, 12, 64)} - - - 0 - 0",
                           r"attention: B, Hq and Lq must be positive"),
    "attention_broadcast_mask": (f"attention {Q} {KV} {KV} - - bool:2,4,10,12:0,0,12,1 1 - 0",
                                 "ok 2 4 2 10 12 64 64 padding 0 bounds 0"),
    "attention_heads": (f"attention {Q} {_contiguous('f16', 2, 3, 12, 64)} {_contiguous('f16', 2, 3, 12, 64)} - - - 0 - 0",
                        "attention: Hk must divide Hq, got Hq = 4, Hk = 3"),
    "attention_head_dim": (f"attention {_contiguous('f16', 2, 4, 10, 264)} {_contiguous('f16', 2, 2, 12, 264)} "
                           f"{KV} - - - 0 - 0", "attention: the head dims must be multiples of 8 up to 256, got E = 264"),
    "attention_mask_dtype": (f"attention {Q} {KV} {KV} - - {_contiguous('f32', 2, 4, 10, 12)} 0 - 0",
                             r"attention: attn_mask must be a bool or Half \[B, Hq, Lq, Lk\] tensor"),
    "attention_padding": (f"attention {Q} {KV} {KV} {_contiguous('bool', 2, 12)} {_contiguous('i32', 2, 3)} - 0 - 0",
                          "ok 2 4 2 10 12 64 64 padding 1 bounds 1"),
    # The bounds carry the kept count (ops.attention.key_padding_bounds), which tells the kernels
    # whether a row has holes, hence whether they must read its padding mask.
    "attention_bounds_without_count": (
        f"attention {Q} {KV} {KV} {_contiguous('bool', 2, 12)} {_contiguous('i32', 2, 2)} - 0 - 0",
        r"attention: key_bounds must be a contiguous int32 \[B, 3\] tensor"),
    # Short keys go without bounds: the kernels then test every key's padding.
    "attention_padding_alone": (f"attention {Q} {KV} {KV} {_contiguous('bool', 2, 12)} - - 0 - 0",
                                "ok 2 4 2 10 12 64 64 padding 1 bounds 0"),
    "attention_bounds_alone": (f"attention {Q} {KV} {KV} - {_contiguous('i32', 2, 3)} - 0 - 0",
                               "attention: key_bounds come with a key_padding_mask"),
    "key_bounds": (f"key_bounds {_contiguous('bool', 3, 70)}", "ok 3 70"),
    "key_bounds_transposed": ("key_bounds bool:3,70:1,3", r"key_bounds: key_padding_mask must be a contiguous bool \[B, Lk\]"),
    "key_bounds_dtype": (f"key_bounds {_contiguous('i32', 3, 70)}",
                         r"key_bounds: key_padding_mask must be a contiguous bool \[B, Lk\] tensor, got Int"),
    "output": (f"output {_contiguous('f16', 2, 4, 10, 64)}", "ok "),
    # An expanded output would have every head's programs write the same rows.
    "output_expanded": ("output f16:2,4,10,64:640,0,64,1",
                        r"output: out must not have elements that share memory \(an expanded output\), "
                        r"got strides \[640, 0, 64, 1\]"),
    "attention_causal": (f"attention {Q} {KV} {KV} - - - 3 - 0", r"attention: causal must be 0 \(none\), 1"),
    "attention_dropout_threshold": (f"attention {Q} {KV} {KV} - - - 0 {_contiguous('i64', 2)} 70000",
                                    r"attention: dropout_threshold must be in \[0, 65536\), got 70000"),
}


def test_each_problem_is_accepted_or_refused_by_name(driver):
    results = dict(zip(CASES, driver([call for call, _ in CASES.values()])))
    for name, (_, expected) in CASES.items():
        outcome, detail = results[name]
        if expected.startswith("ok "):
            assert (outcome, detail) == ("ok", expected[3:]), name
        else:
            assert outcome == "error" and re.match(expected, detail), (name, outcome, detail)
