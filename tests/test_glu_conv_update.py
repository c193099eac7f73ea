"""transformer_kernels.glu_conv1d_update (the decoding step on a ring, in place) against the causal
convolution it steps through, on every backend that serves it."""

import pytest
import torch
from _helpers import backend_params, device_for, skip_unless_backend

import transformer_kernels as tk
import transformer_kernels.nn as tknn
from transformer_kernels.reference.glu_conv import glu_conv1d as reference_glu_conv1d

requires_triton = skip_unless_backend("triton", "glu_conv_update")


def _tolerance(dtype: torch.dtype) -> dict:
    return {torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}.get(
        dtype, dict(atol=1e-5, rtol=1e-5))


def _causal(x, weight, bias, residual, pad_value, residual_scale):
    """The whole sequence's causal convolution in float64: what the steps must give."""
    return reference_glu_conv1d(
        x.double(), weight.double(), None if bias is None else bias.double(), padding="causal", pad_value=pad_value,
        residual=None if residual is None else residual.double(), residual_scale=residual_scale,
    )


# (B, C_in, C, k, bias, residual): k from 1 (a ring of one slot, no past input) to 5; C_in * k past
# the kernel's 128- and 512-wide K slices; 130 rows: past one grid row of the multi-row configuration.
CASES = [
    (1, 37, 16, 3, True, True),
    (3, 5, 4, 1, False, False),
    (2, 7, 6, 2, True, False),
    (4, 130, 8, 5, False, True),
    (130, 9, 8, 3, True, True),
]


@pytest.mark.parametrize("batch,channels_in,channels,kernel_size,with_bias,with_residual", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", backend_params("glu_conv_update"))
def test_steps_give_the_causal_convolution(backend, dtype, batch, channels_in, channels, kernel_size, with_bias,
                                           with_residual):
    if backend == "eager" and dtype == torch.float16:
        dtype = torch.float64  # eager's own precision
    if backend == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16  # the extension serves the half types only
    if backend == "cuda" and channels_in * kernel_size % 8 != 0:
        pytest.skip("the cuda kernel needs C_in * k a multiple of 8")
    device, length, pad_value, scale = device_for(backend), 7, 0.5, 0.7
    x = torch.randn(batch, channels_in, length, device=device, dtype=dtype)
    weight = (torch.randn(2 * channels, channels_in, kernel_size, device=device) / channels_in**0.5).to(dtype)
    bias = torch.randn(2 * channels, device=device, dtype=dtype) if with_bias else None
    residual = torch.randn(batch, channels, length, device=device, dtype=dtype) if with_residual else None
    conv_state = torch.full((batch, channels_in, kernel_size), pad_value, device=device, dtype=dtype)
    outputs = []
    with torch.no_grad():
        for t in range(length):
            outputs.append(tk.glu_conv1d_update(
                x[:, :, t], conv_state, weight, bias, position=torch.tensor(t, device=device),
                residual=None if residual is None else residual[:, :, t], residual_scale=scale, backend=backend,
            ))
    expected = _causal(x, weight, bias, residual, pad_value, scale)
    torch.testing.assert_close(torch.stack(outputs, 2).double(), expected, **_tolerance(dtype))
    slots = [(length - kernel_size + i) % kernel_size for i in range(kernel_size)]  # the ring's last inputs
    torch.testing.assert_close(conv_state[:, :, slots], x[:, :, length - kernel_size:], rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params("glu_conv_update"))
def test_rows_at_their_own_positions_in_a_strided_ring(backend):
    """A position per row (rows that started at different times), a ring that is a channel-last view
    of a larger buffer (contiguous on the cuda backend, whose kernel takes no other), and x_t and
    residual read in place from strided tensors."""
    device, dtype, kernel_size = device_for(backend), torch.float16 if backend == "cuda" else torch.float32, 3
    batch, channels_in, channels, length = 3, 8, 4, 9
    starts = torch.tensor([0, 2, 5])
    x = torch.randn(batch, channels_in, length, device=device, dtype=dtype)
    weight, bias = (torch.randn(2 * channels, channels_in, kernel_size, device=device) / 3).to(dtype), None
    residual = torch.randn(batch, length, 2 * channels, device=device, dtype=dtype)[:, :, ::2].transpose(1, 2)
    buffer = torch.full((batch, kernel_size + 1, 2 * channels_in), 1.0, device=device, dtype=dtype)
    conv_state = buffer[:, 1:, ::2].transpose(1, 2)  # [B, C_in, k], no stride is 1
    if backend == "cuda":
        conv_state = conv_state.contiguous()
    outputs = torch.zeros(batch, channels, length, device=device, dtype=dtype)
    with torch.no_grad():
        for step in range(length):
            positions = torch.arange(batch, device=device) * 0 + step - starts.to(device)
            live = positions >= 0  # rows that have started: the others keep their ring
            rows = live.nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            ring = conv_state[rows].clone()
            out = tk.glu_conv1d_update(x[rows, :, step - starts[rows]].contiguous(), ring, weight, bias,
                                       position=positions[rows], residual=residual[rows, :, step], backend=backend)
            conv_state[rows] = ring
            outputs[rows, :, step] = out
    for row in range(batch):
        sequence = x[row:row + 1, :, : length - starts[row]]
        expected = _causal(sequence, weight, bias, residual[row:row + 1, :, starts[row]:], 1.0, 1.0)
        torch.testing.assert_close(outputs[row:row + 1, :, starts[row]:].double(), expected, **_tolerance(dtype))


@pytest.mark.parametrize("backend", backend_params("glu_conv_update"))
def test_the_module_decodes_as_its_forward(backend):
    dtype = torch.float16 if backend == "cuda" else torch.float32
    conv = tknn.GLUConv1d(8, 4, 3, padding="causal", pad_value=1.0, backend=backend).to(device_for(backend), dtype)
    x = torch.randn(2, 8, 5, device=device_for(backend), dtype=dtype)
    ring = conv.initial_conv_state(2)
    assert ring.shape == (2, 8, 3) and bool((ring == 1.0).all())
    with torch.no_grad():
        steps = [conv.update(x[:, :, t], ring, torch.tensor(t, device=x.device)) for t in range(5)]
        torch.testing.assert_close(torch.stack(steps, 2), conv(x), **_tolerance(dtype))
    same = tknn.GLUConv1d(6, 4, 3)
    with pytest.raises(RuntimeError, match="needs padding='causal'"):
        same.initial_conv_state(2)


def test_argument_errors():
    x_t, weight, ring, position = torch.randn(2, 6), torch.randn(8, 6, 3), torch.zeros(2, 6, 3), torch.tensor(0)

    def update(**changes):
        arguments = dict(x_t=x_t, conv_state=ring, weight=weight, position=position) | changes
        with torch.no_grad():
            return tk.glu_conv1d_update(**arguments)

    with pytest.raises(ValueError, match=r"conv_state must have shape \[B, C_in, k\] = \[2, 6, 3\]"):
        update(conv_state=torch.zeros(2, 6, 2))
    with pytest.raises(TypeError, match="conv_state must have the same dtype as x_t"):
        update(conv_state=ring.double())
    with pytest.raises(TypeError, match="position must have dtype in"):
        update(position=torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"position must have shape \[\] or \[B\] = \[2\]"):
        update(position=torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="position must be a torch.Tensor"):
        update(position=0)
    with pytest.raises(ValueError, match="conv_state must be on the same device as x_t"):
        update(conv_state=ring.to("meta"))
    with pytest.raises(ValueError, match=r"residual must have the output's shape \[2, 4\]"):
        update(residual=torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="glu_conv1d_update is not differentiable"):
        tk.glu_conv1d_update(x_t, ring, weight.requires_grad_(), position=position)
    assert ring.eq(0).all()  # refused calls write nothing


@pytest.mark.parametrize("backend", backend_params("glu_conv_update"))
def test_opcheck(backend):
    device, dtype = device_for(backend), torch.float16 if backend == "cuda" else torch.float32
    x_t, weight = torch.randn(3, 8, device=device, dtype=dtype), torch.randn(8, 8, 3, device=device, dtype=dtype)
    bias, residual = torch.randn(8, device=device, dtype=dtype), torch.randn(3, 4, device=device, dtype=dtype)
    ring, position = torch.randn(3, 8, 3, device=device, dtype=dtype), torch.tensor([0, 4, 7], device=device)
    op = torch.ops.transformer_kernels.glu_conv1d_update.default
    torch.library.opcheck(op, (x_t, ring, position, weight, bias, residual, 0.5, backend))
    torch.library.opcheck(op, (x_t, ring, position[1], weight, None, None, 1.0, backend))


def test_compiled_decoding_loop_updates_the_ring():
    """Under torch.compile(fullgraph=True) the in-place update is functionalized and written back."""
    x, weight = torch.randn(2, 4, 5), torch.randn(6, 4, 2)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x_t, ring, position):
        return tk.glu_conv1d_update(x_t, ring, weight, position=position, backend="eager")

    ring = torch.zeros(2, 4, 2)
    with torch.no_grad():
        steps = [step(x[:, :, t], ring, torch.tensor(t)) for t in range(5)]
    torch.testing.assert_close(torch.stack(steps, 2), _causal(x, weight, None, None, 0.0, 1.0).float())
    torch.testing.assert_close(ring[:, :, [1, 0]], x[:, :, 3:])


@pytest.mark.parametrize("backend", backend_params("glu_conv_update"))
def test_positions_past_32_bits_take_their_slot(backend):
    """An int64 position is taken modulo k in its own width (Triton narrowed it first: past 2**31 the
    window and the slot written were another position's)."""
    device, dtype = device_for(backend), torch.float16 if backend == "cuda" else torch.float32
    x_t, weight = torch.randn(3, 8, device=device, dtype=dtype), torch.randn(8, 8, 3, device=device, dtype=dtype)
    rings = torch.randn(3, 8, 3, device=device, dtype=dtype)
    positions = torch.tensor([2**31, 2**32 + 1, 2**40 + 5], device=device)
    expected_ring = rings.cpu().double()
    with torch.no_grad():
        out = tk.glu_conv1d_update(x_t, rings, weight, position=positions, backend=backend)
        expected = tk.glu_conv1d_update(x_t.cpu().double(), expected_ring, weight.cpu().double(),
                                        position=(positions % 3).cpu(), backend="eager")
    torch.testing.assert_close(out.double().cpu(), expected, **_tolerance(dtype))
    torch.testing.assert_close(rings.double().cpu(), expected_ring, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params("glu_conv_update"))
def test_a_backward_that_saved_the_ring_before_its_update_refuses(backend):
    """The kernel's write is counted on conv_state's version, as a torch in-place op's: a gradient
    computed from the ring's earlier values raises instead of reading the new ones."""
    device, dtype = device_for(backend), torch.float16 if backend == "cuda" else torch.float32
    ring = torch.randn(2, 8, 3, device=device, dtype=dtype)
    factor = torch.randn(2, 8, 3, device=device, dtype=dtype, requires_grad=True)
    saved = (ring * factor).sum()  # saves ring for factor's gradient
    with torch.no_grad():
        tk.glu_conv1d_update(torch.randn(2, 8, device=device, dtype=dtype), ring,
                             torch.randn(8, 8, 3, device=device, dtype=dtype), position=torch.tensor(1, device=device),
                             backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_vmap_needs_the_ring_vmapped_wherever_the_inputs_are():
    """Each index of a vmapped x_t would write the one ring that is not vmapped over: refused, as torch
    refuses a batched in-place write into an unbatched tensor; a ring per index works."""
    x, weight = torch.randn(4, 2, 6), torch.randn(8, 6, 3)

    def update(x_t, ring):
        return tk.glu_conv1d_update(x_t, ring, weight, position=torch.tensor(0))

    with torch.no_grad():
        with pytest.raises(RuntimeError, match="writes conv_state in place, which is not vmapped over"):
            torch.func.vmap(update, in_dims=(0, None))(x, torch.zeros(2, 6, 3))
        rings = torch.zeros(4, 2, 6, 3)
        out = torch.func.vmap(update)(x, rings)
    torch.testing.assert_close(rings[:, :, :, 0], x, rtol=0, atol=0)
    torch.testing.assert_close(out, torch.stack([update(x[i], torch.zeros(2, 6, 3)) for i in range(4)]))


def test_an_expanded_ring_is_refused():
    x_t, weight = torch.randn(3, 6), torch.randn(8, 6, 3)
    with torch.no_grad(), pytest.raises(RuntimeError, match="conv_state is expanded"):
        tk.glu_conv1d_update(x_t, torch.zeros(1, 6, 3).expand(3, 6, 3), weight, position=torch.tensor(0))
