"""What each shared block keeps for its backward (models/fused.py, the attention, tensor parallelism's gathers),
in bytes exactly as the activation meter (observe/memory.py) counts them, and that keeping less changes no
number: outputs bit-identical to the composite ops they replace, gradients equal within the stated rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tetron.models.attention import Documents, sdpa_attention
from tetron.models.blocks import MLP, RMSNorm
from tetron.observe.memory import ActivationMeter

H, INTER, B, T = 32, 48, 2, 12
F32 = 4


def _x(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def _held(module: torch.nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(module's output, the bytes autograd holds for its backward, parameters left out)."""
    meter = ActivationMeter(module.parameters())
    with meter:
        out = module(*inputs)
    return out, meter.live_bytes


def _composite_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm as written out before fused.rms_norm (transformers' LlamaRMSNorm and Gemma3RMSNorm, F.rms_norm in
    fp32): the reference."""
    if norm.unit_offset:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps)
        return (y * (1.0 + norm.weight.float())).type_as(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
    y = x.float()
    return norm.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(B, T, H), (B, T, 4, 8)], ids=["hidden", "per-head"])
def test_norm_keeps_its_input_and_one_fp32_statistic_per_row(dtype, unit_offset, shape):
    norm = RMSNorm(shape[-1], 1e-6, unit_offset=unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=torch.Generator().manual_seed(1)))
    x = _x(*shape, dtype=dtype)
    out, held = _held(norm, x)
    rows = x.numel() // shape[-1]
    assert held == x.numel() * x.element_size() + rows * F32  # before: an fp32 copy of x and xhat besides
    ref = _composite_norm(norm, x)
    assert out.dtype == ref.dtype and torch.equal(out, ref)  # the same ops in the same order
    # gradients against fp64: fused.py computes them in fp32 from x, the composite rounded in the compute dtype
    # between ops; in fp32 both are within 1e-6 of fp64 (measured: 6e-8 apart), in bf16 within one bf16
    # rounding of the fp64 value (2**-8 relative; measured: the fused ones are the closer)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = torch.autograd.grad(out, (x, norm.weight), dy)
    norm64 = RMSNorm(shape[-1], 1e-6, unit_offset=unit_offset).double()
    with torch.no_grad():
        norm64.weight.copy_(norm.weight.double())
    x64 = x.detach().double().requires_grad_()
    want = torch.autograd.grad(_composite_norm(norm64, x64), (x64, norm64.weight), dy.double())
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    for got, ref64 in zip(grads, want):
        assert got.dtype == dtype
        assert ((got.double() - ref64).abs().max() / ref64.abs().max()).item() <= tol


@pytest.mark.parametrize("act, limit, bias", [("silu", None, False), ("gelu_pytorch_tanh", None, True),
                                              ("silu", 7.0, False)], ids=["swiglu", "geglu-bias", "clamped"])
def test_gated_mlp_keeps_gate_and_up_only(act, limit, bias):
    mlp = MLP(H, INTER, act=act, bias=bias, limit=limit)
    x = _x(B, T, H)
    out, held = _held(mlp, x)
    # x (gate_proj's and up_proj's input, one storage), gate and up; before: act(gate) and the product too
    assert held == B * T * F32 * (H + 2 * INTER)

    def composite(x):
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    ref = composite(x)
    assert torch.equal(out, ref)
    dy = torch.randn(B, T, H, generator=torch.Generator().manual_seed(2))
    inputs = (x, *mlp.parameters())
    # the product recomputed by the same ops, differentiated by autograd as before: equal (measured: bitwise)
    for got, want in zip(torch.autograd.grad(out, inputs, dy), torch.autograd.grad(ref, inputs, dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- grouped-query attention

HEADS, KV_HEADS, HD = 4, 2, 8


@pytest.mark.parametrize("path", ["causal", "window", "documents", "sinks"])
def test_attention_keeps_grouped_kv_heads(path):
    """k and v reach the CPU's fused kernel, and its saved tensors, as the kv heads they are (no copy per query
    head); the output equals attention on repeated heads exactly, the gradients within fp32 rounding (the
    kernel sums a group's key gradients in another order: measured 4e-7)."""
    q, k, v = _x(B, HEADS, T, HD, seed=3), _x(B, KV_HEADS, T, HD, seed=4), _x(B, KV_HEADS, T, HD, seed=5)
    sinks = torch.nn.Parameter(torch.randn(HEADS, generator=torch.Generator().manual_seed(6)))
    docs = Documents(torch.tensor([[0] * 5 + [1] * (T - 5)] * B)) if path == "documents" else None
    kwargs = {"window": 4 if path == "window" else None, "sinks": sinks if path == "sinks" else None}
    meter = ActivationMeter([sinks])
    with meter:
        out = sdpa_attention(q, k, v, docs, **kwargs)
    mask = 0 if path in ("causal", "sinks") else (B if docs else 1) * T * T * F32  # the additive mask, saved
    # q, out, k, v, and the fp32 log-sum-exp per query head and position
    assert meter.live_bytes == F32 * (2 * q.numel() + 2 * k.numel() + B * HEADS * T) + mask
    k_rep, v_rep = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    ref = sdpa_attention(q, k_rep, v_rep, docs, **kwargs)
    assert torch.equal(out, ref)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    inputs = (q, k, v, sinks) if path == "sinks" else (q, k, v)
    for got, want in zip(torch.autograd.grad(out, inputs, dy), torch.autograd.grad(ref, inputs, dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
