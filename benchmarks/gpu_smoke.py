"""Run every Triton kernel, forward and backward, on small CUDA inputs (the bfloat16 ones twice).

Meant to run under ``compute-sanitizer`` (see gpu_check.sh): odd sizes, every
mask kind and both layouts, so out-of-bounds accesses in edge tiles show up.
In the first pass each kernel variant is launched through Triton
(``kernel[grid]``, which compiles it) on its first use; in the second, on the
same inputs, every launch runs directly on its compiled variant
(``DirectLaunch``), and must give the same bits.  The second pass runs the
bfloat16 cases only: the direct launches of every kernel family, at a third of
a pass's time under the sanitizer (gpu_check's budget run gives this step 80 s).
"""

import torch

import transformer_kernels as tk


def attention_cases(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    # float32 is served up to head dim 64 on the GPU; 16-bit inputs past 64 take the d128 tiles.
    batch, heads, head_dim = 2, 4, 40 if dtype == torch.float32 else 80
    results = []
    for lq, lk in ((1, 37), (70, 33), (130, 130)):
        q = torch.randn(batch, heads, lq, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(batch, heads // 2, lk, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(batch, heads // 2, lk, head_dim, device=device, dtype=dtype, requires_grad=True)
        padding = torch.zeros(batch, lk, dtype=torch.bool, device=device)
        padding[0, lk // 2 :] = True
        padding[1, : lk // 3] = True
        float_mask = torch.randn(lq, lk, device=device, dtype=dtype, requires_grad=True)
        bool_mask = torch.rand(batch, 1, lq, lk, device=device) > 0.3
        for kwargs in (  # each config table: dense, fast (causal, padding), masked (mask, dropout)
            dict(),
            dict(is_causal=True, key_padding_mask=padding),
            dict(attn_mask=torch.nn.attention.bias.causal_lower_right(lq, lk)),
            dict(attn_mask=float_mask, dropout_p=0.1),
            dict(attn_mask=bool_mask, key_padding_mask=padding),
        ):
            out = tk.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="triton", **kwargs)
            inputs = (q, k, v, float_mask) if kwargs.get("attn_mask") is float_mask else (q, k, v)
            results += [out, *torch.autograd.grad(out, inputs, torch.randn_like(out))]
    return results


def qkv_cases(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    results = []
    for embed, heads, tokens in ((4, 2, 7), (520, 8, 33)):
        x = torch.randn(3, tokens, embed, device=device, dtype=dtype, requires_grad=True)
        weight = torch.randn(3 * embed, embed, device=device, dtype=dtype, requires_grad=True)
        bias = torch.randn(3 * embed, device=device, dtype=dtype, requires_grad=True)
        outs = tk.qkv_projection(x, weight, bias, num_heads=heads, backend="triton")
        results += [*outs, *torch.autograd.grad(outs, (x, weight, bias), [torch.randn_like(o) for o in outs])]
    return results


def glu_conv_cases(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    results = []
    for channels, length, kernel_size in ((24, 1, 3), (520, 41, 5), (64, 130, 2)):
        weight = torch.randn(2 * channels, channels, kernel_size, device=device, dtype=dtype, requires_grad=True)
        bias = torch.randn(2 * channels, device=device, dtype=dtype, requires_grad=True)
        channel_last = torch.randn(2, length, channels, device=device, dtype=dtype).transpose(1, 2)
        for x, padding in ((channel_last, "same"), (channel_last.contiguous(), "causal")):
            x = x.detach().requires_grad_()
            out = tk.glu_conv1d(x, weight, bias, padding=padding, pad_value=1.0, residual=x, residual_scale=0.5**0.5,
                                backend="triton")
            results += [out, *torch.autograd.grad(out, (x, weight, bias), torch.randn_like(out))]
    # Decoding steps: the step kernel for one row and a few, the whole-sequence kernels past its rows.
    for batch, channels_in, channels, kernel_size in ((1, 37, 24, 3), (9, 64, 520, 2), (130, 16, 8, 3)):
        weight = torch.randn(2 * channels, channels_in, kernel_size, device=device, dtype=dtype, requires_grad=True)
        x_t = torch.randn(batch, channels_in, device=device, dtype=dtype, requires_grad=True)
        residual = torch.randn(batch, channels, device=device, dtype=dtype)
        out, state = tk.glu_conv1d_step(x_t, None, weight, residual=residual, residual_scale=0.5, backend="triton")
        results += [out, state, *torch.autograd.grad(out, (x_t, weight), torch.randn_like(out))]
        # The same step in place (glu_conv1d_update): a ring of any strides, a position per row.
        ring = torch.randn(batch, kernel_size, channels_in, device=device, dtype=dtype).transpose(1, 2)
        positions = torch.arange(batch, device=device) % 5
        with torch.no_grad():
            results += [tk.glu_conv1d_update(x_t, ring, weight, position=positions, residual=residual,
                                             backend="triton"), ring.clone()]
    return results


def main() -> None:
    device = torch.device("cuda")
    passes = []
    for dtypes in ((torch.float16, torch.bfloat16, torch.float32), (torch.bfloat16,)):  # through Triton, directly
        results = {}
        for dtype in dtypes:
            for cases in (attention_cases, qkv_cases, glu_conv_cases):
                torch.manual_seed(0)  # the same inputs and dropout seeds in both passes
                results[f"{cases.__name__} {dtype}"] = cases(device, dtype)
        passes.append(results)
    torch.cuda.synchronize()
    differ = [name for name, results in passes[1].items()
              if not all(torch.equal(a, b) for a, b in zip(passes[0][name], results))]
    if differ:
        raise SystemExit(f"gpu_smoke: kernels launched directly differ from their launches through Triton: {differ}")
    print("gpu_smoke: every kernel ran, through Triton and then directly, with the same results")


if __name__ == "__main__":
    main()
