"""The index arithmetic of the CUDA kernels (``csrc/common/index.h``, ``__host__ __device__``
functions) compiled for the host and checked against the Python definitions it implements: the op
layer's head-split layout, the eager backend's padded windows, the decoding step's window and state.
No GPU and no nvcc needed: the header compiles with the host C++ compiler.
"""

import pathlib
import shutil
import subprocess

import pytest
import torch

import transformer_kernels
from transformer_kernels.backends.eager import glu_conv as eager_glu_conv
from transformer_kernels.backends.eager import qkv as eager_qkv
from transformer_kernels.ops.glu_conv import GluConvArgs
from transformer_kernels.ops.qkv import QkvProjectionArgs

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler")


@pytest.fixture(scope="module")
def index_h(tmp_path_factory):
    """``index_h(queries) -> list of result tuples``, each query ``(function, *ints)``."""
    binary = tmp_path_factory.mktemp("index") / "index_driver"
    subprocess.run(
        [COMPILER, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}", "-o", str(binary),
         str(ROOT / "tests" / "csrc" / "index_driver.cpp")],
        check=True, capture_output=True,
    )

    def run(queries):
        text = "".join(" ".join(map(str, query)) + "\n" for query in queries)
        result = subprocess.run([str(binary)], input=text, capture_output=True, text=True, check=True)
        return [tuple(int(v) for v in line.split()) for line in result.stdout.splitlines()]

    return run


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


@pytest.mark.parametrize("batch, seq_len, num_heads, head_dim, num_proj", [(2, 5, 3, 8, 3), (1, 7, 2, 16, 2), (3, 1, 1, 8, 1)])
def test_head_split_index_is_where_the_op_puts_each_packed_column(index_h, batch, seq_len, num_heads, head_dim, num_proj):
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
