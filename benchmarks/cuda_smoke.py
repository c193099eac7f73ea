"""Run every kernel of the CUDA extension once, forward and backward, on one small case each.

Meant to run under ``compute-sanitizer`` memcheck and racecheck (see gpu_check.sh): sizes that leave
partial tiles in every dimension, both GLU paddings and layouts, a decoding step, and attention with
its masks, dropout and padded head dims.  Each family prints a line once it ran, the largest first,
so that a run that dies on one has already checked the ones before it.  Exits non-zero when the
extension is not built.
"""

import sys

import torch

import transformer_kernels as tk
from transformer_kernels.backends.cuda import extension


def attention(device: torch.device, dtype: torch.dtype) -> None:
    """Key padding holes, bottom-right causal with Lq > Lk, GQA, partial blocks; a float mask (its
    gradient too) with dropout and head dims padded up (40, 24); head dim 256 (over 48 KiB of shared
    memory; dK and dV in a pass each) with a float mask."""
    q = torch.randn(2, 4, 150, 128, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(2, 2, 100, 128, device=device, dtype=dtype, requires_grad=True)
    pad = torch.arange(100, device=device) % 7 == 3
    out = tk.scaled_dot_product_attention(q, kv, kv, torch.nn.attention.bias.causal_lower_right(150, 100),
                                          enable_gqa=True, key_padding_mask=pad, backend="cuda")
    out.backward(torch.randn_like(out))
    q, k, v = (torch.randn(2, 3, 70, dim, device=device, dtype=dtype, requires_grad=True) for dim in (40, 40, 24))
    mask = torch.randn(1, 3, 70, 70, device=device, dtype=dtype, requires_grad=True)
    out = tk.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.2, backend="cuda")
    out.backward(torch.randn_like(out))
    q = torch.randn(1, 2, 70, 256, device=device, dtype=dtype, requires_grad=True)
    mask = torch.randn(1, 2, 70, 70, device=device, dtype=dtype, requires_grad=True)
    out = tk.scaled_dot_product_attention(q, q, q, mask, is_causal=False, backend="cuda")
    out.backward(torch.randn_like(out))


def qkv(device: torch.device, dtype: torch.dtype) -> None:
    """Forward, grad_input, grad_weight + grad_bias; 150 tokens, n*E = 144 (partial 128-tiles)."""
    x = torch.randn(2, 75, 48, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(144, 48, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(144, device=device, dtype=dtype, requires_grad=True)
    outs = tk.qkv_projection(x, weight, bias, num_heads=6, backend="cuda")
    sum((o * torch.randn_like(o)).sum() for o in outs).backward()


def glu_conv(device: torch.device, dtype: torch.dtype) -> None:
    """Forward, grad_z, grad_x, grad_weight + grad_bias, both paddings and layouts; then a decoding
    step, forward and backward, and the same step in place on a ring."""
    weight = torch.randn(136, 24, 3, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(136, device=device, dtype=dtype, requires_grad=True)
    channel_last = torch.randn(2, 70, 24, device=device, dtype=dtype).transpose(1, 2)
    residual = torch.randn(2, 68, 70, device=device, dtype=dtype)
    for x, padding in ((channel_last, "same"), (channel_last.contiguous(), "causal")):
        x = x.detach().requires_grad_()
        out = tk.glu_conv1d(x, weight, bias, padding=padding, pad_value=1.0, residual=residual, residual_scale=0.7,
                            backend="cuda")
        out.backward(torch.randn_like(out))
    x_t = torch.randn(3, 24, device=device, dtype=dtype, requires_grad=True)
    out_t, _ = tk.glu_conv1d_step(x_t, None, weight, bias, pad_value=1.0, backend="cuda")
    out_t.sum().backward()
    ring = torch.randn(3, 24, 3, device=device, dtype=dtype)
    with torch.no_grad():
        tk.glu_conv1d_update(x_t, ring, weight, bias, position=torch.arange(3, device=device), backend="cuda")


def main() -> int:
    if extension() is None:
        print("cuda_smoke: the CUDA extension transformer_kernels._C is not built", file=sys.stderr)
        return 1
    device, dtype = torch.device("cuda"), torch.float16
    for family in (attention, qkv, glu_conv):
        family(device, dtype)
        torch.cuda.synchronize()
        print(f"cuda_smoke: {family.__name__} ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
