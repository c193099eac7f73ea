"""The index arithmetic of the CUDA kernels (``csrc/common/index.h``, ``__host__ __device__``
functions) compiled for the host and checked against the Python definitions it implements: the op
layer's head-split layout, the eager backend's padded windows, the decoding step's window and state.
No GPU and no nvcc needed: the header compiles with the host C++ compiler.
"""

import pathlib
import random
import shutil
import subprocess

import pytest
import torch
import triton
import triton.language as tl

import transformer_kernels
from transformer_kernels.backends.triton import attention_kernels as triton_attention_kernels
from transformer_kernels.backends.eager import glu_conv as eager_glu_conv
from transformer_kernels.backends.eager import qkv as eager_qkv
from transformer_kernels.ops.attention import Causal, dropout_threshold, key_padding_bounds
from transformer_kernels.ops.glu_conv import GluConvArgs
from transformer_kernels.ops.qkv import QkvProjectionArgs

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler")


def query_driver(tmp_path_factory, name: str, parse=int):
    """Builds ``tests/csrc/<name>.cpp`` and returns ``run(queries) -> list of result tuples``, each
    query ``(function, *args)`` and each result value read by ``parse``."""
    binary = tmp_path_factory.mktemp(name) / name
    subprocess.run(
        [COMPILER, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}", "-o", str(binary),
         str(ROOT / "tests" / "csrc" / f"{name}.cpp")],
        check=True, capture_output=True,
    )

    def run(queries):
        text = "".join(" ".join(map(str, query)) + "\n" for query in queries)
        result = subprocess.run([str(binary)], input=text, capture_output=True, text=True, check=True)
        return [tuple(parse(v) for v in line.split()) for line in result.stdout.splitlines()]

    return run


@pytest.fixture(scope="module")
def index_h(tmp_path_factory):
    """``index_h(queries) -> list of result tuples``, each query ``(function, *ints)``."""
    return query_driver(tmp_path_factory, "index_driver")


@pytest.mark.parametrize("tiles_m, tiles_n, group_m", [(1, 1, 8), (5, 3, 8), (17, 4, 8), (16, 7, 8), (3, 9, 2)])
def test_grouped_tile_order_visits_every_tile_once_group_by_group(index_h, tiles_m, tiles_n, group_m):
    count = tiles_m * tiles_n
    tiles = index_h([("grouped_tile", i, tiles_m, tiles_n, group_m) for i in range(count)])
    assert sorted(tiles) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
    # Tile i belongs to group i // (group_m * tiles_n), the tile rows [group * group_m, ... + group_m).
    for i, (m, _) in enumerate(tiles):
        assert m // group_m == i // (group_m * tiles_n)
    # Inside a group, consecutive tiles walk down a column of tiles first.
    if count > 1:
        assert tiles[1] == ((1, 0) if tiles_m > 1 else (0, 1))


def test_fast_divisor_divides_exactly_over_the_int_range(index_h):
    """``FastDivisor`` (a multiply-high and a shift) against ``//`` for divisors of every magnitude,
    powers of two and their neighbours among them, and numerators up to ``2^31 - 1``, where the
    rounding of its magic number is tightest."""
    generator = random.Random(0)
    divisors = sorted({1, 2, 3, 5, 7, 8, 16, 40, 64, 96, 384, 512, 1536, 2 ** 30, 2 ** 31 - 1}
                      | {2 ** e + delta for e in range(1, 31) for delta in (-1, 1)}
                      | {generator.randrange(1, 2 ** 31) for _ in range(40)})
    queries = []
    for divisor in divisors:
        numerators = {0, 1, divisor - 1, divisor, divisor + 1, 2 ** 31 - 1, 2 ** 31 - 2}
        numerators |= {q * divisor - 1 for q in (2, 3, 1000)} | {generator.randrange(0, 2 ** 31) for _ in range(20)}
        queries += [("fast_divisor", divisor, n) for n in sorted(numerators) if 0 <= n < 2 ** 31]
    got = index_h(queries)
    assert [q for (q,) in got] == [n // divisor for _, divisor, n in queries]


@pytest.mark.parametrize("batch, seq_len, num_heads, head_dim, num_proj",
                         [(2, 5, 3, 8, 3), (1, 7, 2, 16, 2), (3, 1, 1, 8, 1)])
def test_head_split_index_is_where_the_op_puts_each_packed_column(
    index_h, batch, seq_len, num_heads, head_dim, num_proj
):
    """The packed GEMM result's element (token t, feature f) lands at output ``proj``, element
    ``offset``, exactly where the eager backend's head split puts it."""
    embed = num_heads * head_dim
    tokens, features = batch * seq_len, num_proj * embed
    # weight = the identity times (i + 1) in row block i: packed[t, f] = (f // E + 1) * x[t, f % E],
    # distinct for every (t, f) since x holds distinct positive values.
    x = torch.arange(1, tokens * embed + 1, dtype=torch.float64).view(batch, seq_len, embed)
    weight = torch.cat([torch.eye(embed, dtype=torch.float64) * (i + 1) for i in range(num_proj)])
    outputs = eager_qkv.forward(x, weight, None, QkvProjectionArgs(num_heads))
    stride_b, stride_h, stride_l, stride_d = outputs[0].stride()
    assert stride_d == 1
    queries = [
        ("head_split_index", seq_len, embed, head_dim, stride_b, stride_h, stride_l, t, f)
        for t in range(tokens) for f in range(features)
    ]
    found = [outputs[proj].flatten()[offset].item() for proj, offset in index_h(queries)]
    x_rows = x.view(tokens, embed)
    assert found == [(f // embed + 1) * x_rows[t, f % embed].item() for t in range(tokens) for f in range(features)]


@pytest.mark.parametrize("kernel_size, padding", [(3, "same"), (4, "same"), (3, "causal"), (1, "same"), (5, "causal")])
def test_tap_position_reads_the_padded_window_the_eager_backend_builds(index_h, kernel_size, padding):
    batch, channels_in, length = 2, 3, 6
    pad_left = (kernel_size - 1) // 2 if padding == "same" else kernel_size - 1
    pad_right = kernel_size // 2 if padding == "same" else 0
    pad_value = -1.0
    x = torch.arange(batch * channels_in * length, dtype=torch.float64).view(batch, channels_in, length)
    cols = eager_glu_conv._windows(x, kernel_size, pad_left, pad_right, pad_value)
    length_out = GluConvArgs(pad_left, pad_right, pad_value, 1.0).output_length(length, kernel_size)
    assert index_h([("conv_output_length", length, kernel_size, pad_left, pad_right)]) == [(length_out,)]
    queries = [("tap_position", s, tap, pad_left, length) for s in range(length_out) for tap in range(kernel_size)]
    positions = dict(zip([(q[1], q[2]) for q in queries], index_h(queries)))
    for b in range(batch):
        for s in range(length_out):
            for ci in range(channels_in):
                for tap in range(kernel_size):
                    position, inside = positions[(s, tap)]
                    expected = x[b, ci, position].item() if inside else pad_value
                    assert cols[b * length_out + s, ci * kernel_size + tap].item() == expected


@pytest.mark.parametrize("cols", [8, 16, 24, 40, 64, 72, 128, 200, 256])
def test_row_dot_split_sums_every_chunk_once_and_shuffles_within_each_row(index_h, cols):
    """The attention backward's dO . O pre-pass: over three warps, every 8-element chunk of each of
    their rows is read by exactly one thread, and a thread's partners at the shuffle offsets below
    its row's lane count (``lane ^ offset``) sum the same row."""
    chunk, threads = 8, 96
    results = index_h([("row_dot_split", cols, chunk, thread) for thread in range(threads)])
    lanes = results[0][0]
    assert lanes & (lanes - 1) == 0 and lanes <= 32 and (lanes >= -(-cols // chunk) or lanes == 32)
    read = [(row, col) for _, row, first, step in results for col in range(first, cols, step)]
    rows = threads // 32 * (32 // lanes)
    assert sorted(read) == [(row, col) for row in range(rows) for col in range(0, cols, chunk)]
    row_of = [row for _, row, _, _ in results]
    offsets = [1 << bit for bit in range(5) if 1 << bit < lanes]
    assert all(row_of[thread ^ offset] == row_of[thread] for thread in range(threads) for offset in offsets)


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
def test_step_window_is_state_then_input_and_new_state_drops_the_oldest(index_h, kernel_size):
    """``glu_conv1d_step``'s window is ``cat(state, x_t)`` and its new state ``window[:, :, 1:]``."""
    state = torch.arange(kernel_size - 1, dtype=torch.float64).view(1, 1, -1)
    x_t = torch.tensor([[100.0]], dtype=torch.float64)
    weight = torch.zeros(2, 1, kernel_size, dtype=torch.float64)
    _, new_state = transformer_kernels.glu_conv1d_step(x_t, state, weight, backend="eager")
    window = [state[0, 0, tap].item() if tap < kernel_size - 1 else 100.0 for tap in range(kernel_size)]
    results = index_h([("step_window", tap, kernel_size) for tap in range(kernel_size)])
    for tap, (from_state, _) in enumerate(results):
        assert bool(from_state) == (tap < kernel_size - 1)
        assert (state[0, 0, tap].item() if from_state else 100.0) == window[tap]
    sources = index_h([("step_window", slot, kernel_size) for slot in range(kernel_size - 1)])
    assert [window[source] for _, source in sources] == new_state.flatten().tolist()


# ---------------------------------------------------------------------------------------------------
# The GEMM kernels' operands and epilogues (qkv_tiles.h, glu_conv_tiles.h), run on the host by
# tests/csrc/gemm_emulator.cpp in place of the tensor-core main loop, against the eager backend.
# Inputs go through the cuda backend's own Python glue (packing, padding, unpacking).


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """``emulator(kernel, numbers, tensors) -> list of 1-D float64 tensors``; built with
    AddressSanitizer where the compiler has it, so an epilogue writing out of bounds fails."""
    binary = tmp_path_factory.mktemp("emulator") / "gemm_emulator"
    base = [COMPILER, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}", "-o", str(binary),
            str(ROOT / "tests" / "csrc" / "gemm_emulator.cpp")]
    if subprocess.run([*base, "-fsanitize=address"], capture_output=True).returncode != 0:
        subprocess.run(base, check=True, capture_output=True)

    def run(kernel, numbers, tensors):
        parts = [kernel, *map(str, numbers)]
        for t in tensors:
            values = t.detach().double().flatten().tolist()
            parts += [str(len(values)), *map(repr, values)]
        result = subprocess.run([str(binary)], input=" ".join(parts), capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs = []
        for line in result.stdout.splitlines():
            size, *values = line.split()
            assert len(values) == int(size)
            outputs.append(torch.tensor([float(v) for v in values], dtype=torch.float64))
        return outputs

    return run


def storage(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t``'s storage from its first element on, as a 1-D tensor."""
    size = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return torch.as_strided(t, (size,), (1,), t.storage_offset())


def from_storage(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(flat, like.shape, like.stride())


def assert_close(actual, expected, name):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


QKV_CASES = [
    # num_proj, batch, seq_len, embed, heads, x padded along E (strided rows), bias
    (3, 2, 70, 16, 2, False, True),
    (2, 1, 9, 24, 3, True, False),
    (1, 3, 50, 136, 1, True, True),
]


@pytest.mark.parametrize("num_proj, batch, seq_len, embed, heads, strided_x, with_bias", QKV_CASES)
def test_qkv_kernels_on_the_host_match_the_eager_backend(
    emulator, num_proj, batch, seq_len, embed, heads, strided_x, with_bias
):
    from transformer_kernels.backends.cuda import qkv as cuda_qkv

    args = QkvProjectionArgs(heads)
    x = torch.randn(batch, seq_len, embed + (8 if strided_x else 0), dtype=torch.float64)[..., :embed]
    weight = torch.randn(num_proj * embed, embed, dtype=torch.float64)
    bias = torch.randn(num_proj * embed, dtype=torch.float64) if with_bias else None
    expected = eager_qkv.forward(x, weight, bias, args)
    grads = [torch.randn_like(out) for out in expected]
    expected_grads = eager_qkv.backward(grads, x, weight, args, with_bias, True, True, True)

    shape = (num_proj, batch, seq_len, embed, heads)
    x3 = cuda_qkv._as_3d(x)
    assert x3.data_ptr() == x.data_ptr()  # read in place: strided rows need no copy
    outputs = emulator(
        "qkv_forward", [*shape, x3.stride(0), x3.stride(1), weight.stride(0), int(with_bias)],
        [storage(x3), weight, *([bias] if with_bias else [])],
    )
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert_close(out.view(want.shape), want, f"out {i}")

    grads4 = cuda_qkv._head_split_4d(grads)
    g_strides = grads4[0].stride()[:3]
    (grad_x,) = emulator("qkv_grad_input", [*shape, *g_strides, weight.stride(0)], [*map(storage, grads4), weight])
    assert_close(grad_x.view(x.shape), expected_grads[0], "grad x")
    grad_weight, grad_bias = emulator(
        "qkv_grad_weight", [*shape, *g_strides, x3.stride(0), x3.stride(1), int(with_bias)],
        [*map(storage, grads4), storage(x3)],
    )
    assert_close(grad_weight.view(weight.shape), expected_grads[1], "grad weight")
    if with_bias:
        assert_close(grad_bias, expected_grads[2], "grad bias")


GLU_CASES = [
    # batch, C_in, C, k, L, padding, pad_value, channel-last x, residual, bias
    (2, 16, 8, 3, 70, "same", 0.0, False, True, True),
    (1, 24, 68, 4, 33, "same", 1.5, True, False, True),
    (3, 8, 4, 3, 45, "causal", 1.0, False, True, False),
    (2, 16, 12, 5, 9, "causal", 0.0, True, True, True),
    (2, 8, 4, 3, 3, "step", 0.0, False, False, True),  # one position, no padding: a step's window
]


@pytest.mark.parametrize("batch, channels_in, channels, kernel_size, length, padding, pad_value, channel_last, "
                         "with_residual, with_bias", GLU_CASES)
def test_glu_conv_kernels_on_the_host_match_the_eager_backend(
    emulator, batch, channels_in, channels, kernel_size, length, padding, pad_value, channel_last, with_residual,
    with_bias,
):
    from transformer_kernels.backends.cuda import glu_conv as cuda_glu
    from transformer_kernels.ops.glu_conv import empty_output

    pad_left = {"same": (kernel_size - 1) // 2, "causal": kernel_size - 1, "step": 0}[padding]
    pad_right = {"same": kernel_size // 2, "causal": 0, "step": 0}[padding]
    args = GluConvArgs(pad_left, pad_right, pad_value, 0.7)
    length_out = args.output_length(length, kernel_size)
    x = torch.randn(batch, channels_in, length, dtype=torch.float64)
    if channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    weight = torch.randn(2 * channels, channels_in, kernel_size, dtype=torch.float64)
    bias = torch.randn(2 * channels, dtype=torch.float64) if with_bias else None
    residual = torch.randn(batch, length_out, channels, dtype=torch.float64).transpose(1, 2) if with_residual else None
    expected, z = eager_glu_conv.forward(x, weight, bias, residual, args)
    grad_out = torch.randn(batch, channels, length_out, dtype=torch.float64)
    expected_grads = eager_glu_conv.backward(grad_out, x, weight, bias, z, args, True, True, True)

    xpad = cuda_glu._xpad(x, args)
    packed = cuda_glu._packed_weight(weight)
    packed_bias = cuda_glu._packed_bias(bias)
    shape = [batch, channels_in, 2 * channels, kernel_size, length, length_out, pad_left]
    out = empty_output(x, channels, length_out)
    bias_inputs = [packed_bias] if with_bias else []
    (out_flat,) = emulator(
        "glu_forward",
        [*shape, args.residual_scale, int(with_bias), int(with_residual),
         *(residual.stride() if with_residual else (0, 0, 0)), *out.stride(), out.numel()],
        [xpad, packed, *bias_inputs, *([storage(residual)] if with_residual else [])],
    )
    assert_close(from_storage(out_flat, out), expected, "out")

    (grad_z,) = emulator(
        "glu_grad_preactivation",
        [*shape, args.residual_scale, int(with_bias), 1, *grad_out.stride(), 0, 0, 0,
         batch * length_out * 2 * channels],
        [xpad, packed, *bias_inputs, grad_out],
    )
    grad_x_like = empty_output(x, channels_in, length)
    (grad_x,) = emulator("glu_grad_input", [*shape, *grad_x_like.stride(), grad_x_like.numel()], [grad_z, packed])
    assert_close(from_storage(grad_x, grad_x_like), expected_grads[0], "grad x")
    grad_packed, grad_packed_bias = emulator("glu_grad_weight", [*shape, int(with_bias)], [grad_z, xpad])
    assert_close(cuda_glu._unpacked_weight(grad_packed.view(packed.shape), weight), expected_grads[1], "grad weight")
    if with_bias:
        assert_close(cuda_glu._unpacked_bias(grad_packed_bias), expected_grads[2], "grad bias")


@pytest.mark.parametrize("batch, channels_in, channels, kernel_size, with_residual, with_bias", [
    (3, 16, 8, 3, True, True),     # C_in * k = 48: lanes past the row's end add nothing
    (11, 64, 12, 4, False, True),  # two CTAs of batch rows, the second partial; 256 = 32 lanes x 8
    (1, 8, 4, 1, True, False),
])
def test_glu_step_kernel_on_the_host_matches_the_eager_step(
    emulator, batch, channels_in, channels, kernel_size, with_residual, with_bias
):
    x_t = torch.randn(batch, channels_in, dtype=torch.float64)
    state = torch.randn(batch, channels_in, kernel_size - 1, dtype=torch.float64)
    weight = torch.randn(2 * channels, channels_in, kernel_size, dtype=torch.float64)
    bias = torch.randn(2 * channels, dtype=torch.float64) if with_bias else None
    residual = torch.randn(channels, batch, dtype=torch.float64).t() if with_residual else None  # strided
    expected, _ = transformer_kernels.glu_conv1d_step(
        x_t, state, weight, bias, residual=residual, residual_scale=0.7, backend="eager"
    )
    window = torch.cat([state, x_t.unsqueeze(2)], dim=2)  # what the op hands the backend
    args = GluConvArgs(0, 0, 0.0, 0.7)
    _, expected_z = eager_glu_conv.forward(window, weight, bias, None, args)
    out, z = emulator(
        "glu_step",
        [batch, channels_in, channels, kernel_size, 0.7, int(with_bias), int(with_residual),
         *(residual.stride() if with_residual else (0, 0))],
        [window, weight, *([bias] if with_bias else []), *([storage(residual)] if with_residual else [])],
    )
    assert_close(out.view(batch, channels), expected, "out")
    assert_close(z.view(batch, 1, 2 * channels), expected_z, "pre-activation")


@pytest.mark.parametrize("batch, channels_in, channels, kernel_size, with_bias", [
    (3, 16, 8, 3, True),     # 8-element slices that cross channels of 3 taps
    (11, 64, 12, 4, False),  # two CTAs of batch rows, the second partial
    (2, 8, 4, 1, True),      # a ring of one slot: the window is the new input alone
])
def test_glu_update_kernel_on_the_host_matches_the_eager_update(emulator, batch, channels_in, channels, kernel_size,
                                                                 with_bias):
    """The CUDA step through a ring (glu_conv1d_update): the same outputs and ring as the eager
    backend's, for rows at positions of every residue modulo k (and a negative one, taken modulo k
    the floor way)."""
    x_t = torch.randn(batch, channels_in, dtype=torch.float64)
    ring = torch.randn(batch, channels_in, kernel_size, dtype=torch.float64)
    weight = torch.randn(2 * channels, channels_in, kernel_size, dtype=torch.float64)
    bias = torch.randn(2 * channels, dtype=torch.float64) if with_bias else None
    positions = torch.arange(batch) * 5 - 1
    expected_ring = ring.clone()
    expected = transformer_kernels.glu_conv1d_update(x_t, expected_ring, weight, bias, position=positions,
                                                      residual_scale=0.7, backend="eager")
    out, new_ring = emulator(
        "glu_update", [batch, channels_in, channels, kernel_size, 0.7, int(with_bias)],
        [ring, x_t, positions.double(), weight, *([bias] if with_bias else [])],
    )
    assert_close(out.view(batch, channels), expected, "out")
    assert_close(new_ring.view(ring.shape), expected_ring, "ring")


# ---------------------------------------------------------------------------------------------------
# The attention kernels' mask, key-block and dropout logic (csrc/common/attention_masks.h), against
# the op layer's definitions and the Triton backend's kernels (run by Triton's interpreter on CPU).


@pytest.fixture(scope="module")
def attention_h(tmp_path_factory):
    return query_driver(tmp_path_factory, "attention_driver", parse=float)


def _visible(padding_row: torch.Tensor, lq: int, causal: bool, shift: int) -> torch.Tensor:
    """bool [Lq, Lk]: query i sees key j (key padding ``padding_row``, True = padding; causal j <= i + shift)."""
    lk = padding_row.shape[0]
    rows, keys = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    visible = ~padding_row[None, :].expand(lq, lk)
    return visible & (keys <= rows + shift) if causal else visible


@pytest.mark.parametrize("with_bounds", [True, False], ids=["bounds", "no_bounds"])
@pytest.mark.parametrize("padding", [None, "suffix", "left", "holes", "all"])
def test_row_keys_keep_exactly_the_kept_keys_with_or_without_bounds(attention_h, padding, with_bounds):
    """A batch row's key range and per-key test keep its kept keys and no other, whether the caller
    computed its bounds (``key_padding_bounds``) or left them out (short keys); with bounds, only a
    row with padding between its kept keys pays for the per-key test."""
    lk = 40
    keys = torch.arange(lk)
    pad = {
        None: torch.zeros(lk, dtype=torch.bool), "suffix": keys >= 25, "left": keys < 7,
        "holes": (keys % 7 == 3) | (keys < 5), "all": torch.ones(lk, dtype=torch.bool),
    }[padding]
    bounds = key_padding_bounds(pad[None])[0].tolist() if padding is not None and with_bounds else None
    query = ("row_keys", int(bounds is not None), *(bounds or (0, 0, 0)), int(padding is not None), lk)
    first, end, holes = map(int, attention_h([query])[0])
    kept = (keys >= first) & (keys < end)
    if holes:
        kept &= ~pad
    assert torch.equal(kept, ~pad)
    assert holes == (padding == "holes" if bounds is not None else padding is not None)


@pytest.mark.parametrize("threads", [1, 32, 256])
@pytest.mark.parametrize("lk", [65, 300, 1000])
@pytest.mark.parametrize("padding", [None, "suffix", "left", "holes", "all", "last_only"])
def test_key_bounds_reduction_gives_key_padding_bounds(attention_h, padding, lk, threads):
    """The bounds kernel's reduction (each thread's keys, then the threads' bounds merged) gives what
    ``key_padding_bounds`` gives the eager backend, a row of padding only included."""
    keys = torch.arange(lk)
    pad = {
        None: torch.zeros(lk, dtype=torch.bool), "suffix": keys >= lk // 3, "left": keys < lk // 2,
        "holes": (keys % 7 == 3) | (keys < 5) | (keys >= lk - 9), "all": torch.ones(lk, dtype=torch.bool),
        "last_only": keys != lk - 1,
    }[padding]
    bits = "".join("1" if p else "0" for p in pad.tolist())
    (got,) = attention_h([("key_bounds", threads, lk, bits)])
    assert list(map(int, got)) == key_padding_bounds(pad[None])[0].tolist()


KEY_BLOCK_CASES = [
    # Lq, Lk, causal kind, padding kind
    (100, 100, Causal.NONE, "suffix"), (100, 100, Causal.TOP_LEFT, None), (70, 200, Causal.BOTTOM_RIGHT, "left"),
    (200, 70, Causal.BOTTOM_RIGHT, None), (130, 130, Causal.TOP_LEFT, "holes"), (1, 300, Causal.BOTTOM_RIGHT, "suffix"),
    (65, 129, Causal.TOP_LEFT, "left"), (64, 64, Causal.NONE, "all"),
]


@pytest.mark.parametrize("block_m, block_n", [(64, 64), (128, 64), (128, 32)])
@pytest.mark.parametrize("lq, lk, causal, padding", KEY_BLOCK_CASES)
def test_key_blocks_visit_every_visible_key_and_skip_masks_only_where_all_are_visible(
    attention_h, lq, lk, causal, padding, block_m, block_n
):
    from transformer_kernels.backends.eager._attention_common import causal_shift

    keys = torch.arange(lk)
    pad = {
        None: torch.zeros(lk, dtype=torch.bool), "suffix": keys >= lk * 2 // 3, "left": keys < lk // 3,
        "holes": (keys % 7 == 3) | (keys < 5) | (keys >= lk - 9), "all": torch.ones(lk, dtype=torch.bool),
    }[padding]
    first, end, _ = key_padding_bounds(pad[None]).flatten().tolist()
    if padding is None:
        first, end = 0, lk
    (shift,) = attention_h([("causal_shift", int(causal), lq, lk)])[0]
    assert shift == (causal_shift(causal, lq, lk) or 0)
    is_causal = causal != Causal.NONE
    # Interior blocks skip the causal and bounds tests, not the per-key padding (holes) test.
    outside_bounds = (keys < first) | (keys >= end)
    visible, visible_in_bounds = (_visible(p, lq, is_causal, int(shift)) for p in (pad, outside_bounds))
    row_starts = range(0, lq, block_m)
    results = attention_h([
        ("key_blocks", r, block_m, block_n, lq, int(is_causal), int(shift), first, end) for r in row_starts
    ])
    for row_start, (begin, stop, full_begin, full_end) in zip(row_starts, (map(int, r) for r in results)):
        rows = slice(row_start, min(row_start + block_m, lq))
        seen = visible_in_bounds[rows]
        key_block = keys // block_n
        visited = (key_block >= begin) & (key_block < stop)
        assert not (visible[rows] & ~visited).any(), "a visible key lies outside the visited blocks"
        for block in range(begin, stop):
            assert seen[:, block * block_n:(block + 1) * block_n].any(), f"block {block} holds no visible key"
        for block in range(max(full_begin, begin), min(full_end, stop)):
            assert seen[:, block * block_n:(block + 1) * block_n].all(), f"interior block {block} needs a mask"
        assert (begin == stop) == (not seen.any())


@pytest.mark.parametrize("lq, lk, causal", [(100, 100, Causal.TOP_LEFT), (70, 200, Causal.BOTTOM_RIGHT),
                                            (200, 70, Causal.BOTTOM_RIGHT), (50, 50, Causal.NONE)])
def test_query_rows_of_a_key_block_start_at_its_first_viewer_and_are_full_past_the_diagonal(attention_h, lq, lk, causal):
    shift = lk - lq if causal == Causal.BOTTOM_RIGHT else 0
    is_causal = causal != Causal.NONE
    visible = _visible(torch.zeros(lk, dtype=torch.bool), lq, is_causal, shift)
    block_n = 32
    starts = range(0, lk, block_n)
    for key_start, (row_begin, row_full) in zip(starts, attention_h([
        ("query_rows", s, block_n, lq, int(is_causal), shift) for s in starts
    ])):
        block = visible[:, key_start:key_start + block_n]
        assert not block[: int(row_begin)].any(), "rows before row_begin see a key of the block"
        assert block[int(row_full):].all(), "rows from row_full on must see the whole block"


@pytest.mark.parametrize("lq, block_q, row_begin, group", [(100, 16, 0, 1), (100, 16, 37, 4), (64, 32, 63, 2),
                                                           (1, 16, 0, 3), (48, 16, 32, 2)])
def test_query_steps_of_a_key_block_visit_each_head_and_query_block_once_in_order(
    attention_h, lq, block_q, row_begin, group
):
    # The dK/dV kernel's query loop (one flat loop, prefetching each next step) against two nested
    # loops: the group's heads, then the query blocks from the first that sees the key block.
    q_first = row_begin // block_q * block_q
    first_head = 2 * group  # kv head 2's group
    expected = [value for head in range(first_head, first_head + group) for q_start in range(q_first, lq, block_q)
                for value in (head, q_start)]
    (steps,) = attention_h([("query_steps", first_head, first_head + group, q_first, block_q, lq)])
    assert list(map(int, steps)) == expected


def test_float_mask_bias_in_base_2_matches_the_triton_kernels(attention_h):
    log2e, lowest = 1.4426950408889634, torch.finfo(torch.float32).min
    values = torch.tensor([float("-inf"), lowest, -1e38, -3.5, 0.0, 1.25, 2e37, 3e38], dtype=torch.float32)
    results = [r[0] for r in attention_h([("mask_bias_log2", repr(v)) for v in values.tolist()])]
    expected = torch.where(values == float("-inf"), values, torch.clamp_min(values * log2e, lowest))
    assert torch.tensor(results, dtype=torch.float32).tolist() == expected.tolist()


@triton.jit
def _philox_reference_kernel(seed, counters_ptr, words_ptr, rand_ptr, N: tl.constexpr):
    # Written out word by word: compiled Triton (on a GPU) takes no generators or enumerate.
    i = tl.arange(0, N)
    c0 = tl.load(counters_ptr + i * 4).to(tl.uint32)
    c1 = tl.load(counters_ptr + i * 4 + 1).to(tl.uint32)
    c2 = tl.load(counters_ptr + i * 4 + 2).to(tl.uint32)
    c3 = tl.load(counters_ptr + i * 4 + 3).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    tl.store(words_ptr + i * 4, r0.to(tl.int64) & 0xFFFFFFFF)
    tl.store(words_ptr + i * 4 + 1, r1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(words_ptr + i * 4 + 2, r2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(words_ptr + i * 4 + 3, r3.to(tl.int64) & 0xFFFFFFFF)
    tl.store(rand_ptr + i, tl.rand(seed, tl.load(counters_ptr + i * 4).to(tl.int32)))


@pytest.mark.parametrize("seed", [0, 1, 1234567, 2**31 - 2])
def test_host_philox_reproduces_triton_philox_and_rand(attention_h, seed):
    from conftest import TRITON_DEVICE

    n = 64
    counters = torch.randint(0, 2**31 - 1, (n, 4), dtype=torch.int64)
    counters[:4] = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [7, 3, 2, 5], [2**31 - 2, 1, 1, 1]])
    words = torch.empty(n, 4, dtype=torch.int64, device=TRITON_DEVICE)
    rand = torch.empty(n, dtype=torch.float32, device=TRITON_DEVICE)
    _philox_reference_kernel[(1,)](seed, counters.to(TRITON_DEVICE), words, rand, N=n)
    host_words = attention_h([("philox", seed, *c) for c in counters.tolist()])
    assert [tuple(map(int, w)) for w in host_words] == [tuple(w) for w in words.cpu().tolist()]
    host_rand = attention_h([("rand", seed, c[0]) for c in counters.tolist()])
    assert torch.tensor([r[0] for r in host_rand], dtype=torch.float32).tolist() == rand.cpu().tolist()


@triton.jit
def _triton_dropout_kernel(dropout_seed_ptr, keep_ptr, head_batch, threshold, key_start,
                           BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    seed, offset = triton_attention_kernels._dropout_seed_and_offset(dropout_seed_ptr, True)
    rows = tl.arange(0, BLOCK_Q)
    keep = triton_attention_kernels._dropout_keep(rows, key_start, head_batch, seed, offset, threshold, BLOCK_Q, BLOCK_K)
    tl.store(keep_ptr + rows[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], keep.to(tl.int8))


@pytest.mark.parametrize("seed, offset, head_batch, key_start, dropout_p", [
    (1234567, 89, 0, 0, 0.1), (5, 2**31 + 17, 3, 40, 0.5), (2**31 - 2, 0, 11, 8, 0.9),
])
def test_host_dropout_keep_mask_is_the_triton_backends(attention_h, seed, offset, head_batch, key_start, dropout_p):
    """The same (seed, offset) pair as the op layer draws it (int64 [2]) keeps the same weights."""
    from conftest import TRITON_DEVICE

    block_q, block_k = 16, 32
    threshold, _ = dropout_threshold(dropout_p)
    keep = torch.empty(block_q, block_k, dtype=torch.int8, device=TRITON_DEVICE)
    pair = torch.tensor([seed, offset], dtype=torch.int64, device=TRITON_DEVICE)
    _triton_dropout_kernel[(1,)](pair, keep, head_batch, threshold, key_start, BLOCK_Q=block_q, BLOCK_K=block_k)
    host = attention_h([
        ("dropout_keep", seed, offset, head_batch, q, key_start + k, threshold)
        for q in range(block_q) for k in range(block_k)
    ])
    assert torch.tensor([int(r[0]) for r in host]).view(block_q, block_k).tolist() == keep.cpu().tolist()
    assert 0 < keep.sum() < keep.numel()
