"""What each shared block keeps for its backward (models/fused.py, the attention, tensor parallelism's gathers),
in bytes exactly as the activation meter (observe/memory.py) counts them, and that keeping less changes no
number: outputs bit-identical to the composite ops they replace, gradients equal within the stated rounding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetron.models.attention import Documents, sdpa_attention
from tetron.models.blocks import MLP, RMSNorm
from tetron.observe.memory import ActivationMeter

from harness import run_ranks

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


# ----------------------------------------------------------------------------- sequence parallelism's gathers

SP_MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


def _sp_rank(regather: bool) -> dict:
    from tetron.models.llama import Llama, LlamaConfig
    from tetron.parallel.init import materialize_
    from tetron.parallel.layout import local_slice
    from tetron.parallel.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    config = LlamaConfig(**SP_MODEL)
    plain = Llama(config)
    with torch.device("meta"):
        model = Llama(config)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=True, regather=regather)
    materialize_(model, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(local_slice(p, plain.state_dict()[name]))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    meter, marks = ActivationMeter(model.parameters()), []
    layer = model.model.layers["0"]
    layer.register_forward_pre_hook(lambda *_: marks.append(meter.live_bytes))
    layer.register_forward_hook(lambda *_: marks.append(meter.live_bytes))
    with meter:
        out = model(ids)  # [2, 16, vocab/tp]
    out.sum().backward()
    return {"layer_saved": marks[1] - marks[0], "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_sp_blocks_keep_their_input_shard():
    """Under tp2 with sp, each block's column-parallel linears keep the shard of their input (the norm output for
    this rank's tokens) and all-gather it again in the backward (parallel/regather.py): a layer holds 2 x (n -
    n/tp) x h values less than with the gathered input kept, and every gradient is the same within fp32 rounding
    (the weight gradients' matmuls sum in another order: measured 2.2e-7 of each tensor's largest)."""
    kept = run_ranks(2, _sp_rank, False)
    shard = run_ranks(2, _sp_rank, True)
    tokens, h = 2 * 16, SP_MODEL["hidden_size"]
    for whole, mine in zip(kept, shard):
        assert whole["layer_saved"] - mine["layer_saved"] == 2 * (tokens - tokens // 2) * h * F32
        worst = max(((grad - mine["grads"][name]).abs().max() / grad.abs().max()).item()
                    for name, grad in whole["grads"].items())
        assert worst <= 1e-6, worst


# ----------------------------------------------------------------------------- the per-layer formula


@pytest.mark.parametrize("family, dtype, kv_heads", [("llama", "float32", 2), ("llama", "bfloat16", 2),
                                                     ("llama", "float32", 4), ("qwen3", "float32", 2)],
                         ids=["gqa-fp32", "gqa-bf16", "mha-fp32", "qwen3-qk-norm"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_a_layer_saves_the_planners_formula_to_the_byte(family, dtype, kv_heads, mode):
    """docs/memory.md's per-layer formula (plan/activations.py layer_none), term by term, against what the meter
    counts for one decoder layer's forward, exactly: the norms' inputs and 1/rms, their outputs (q/k/v's and
    gate/up's input), q, k and v as the kernel takes them, its output and log-sum-exp, gate and up (and Qwen3's
    per-head norms' inputs and 1/rms); under selective recomputation all that but the kernel's log-sum-exp
    (layer_kept), under full the layer's input."""
    from tetron.config import from_dict
    from tetron.models import family as family_of
    from tetron.models.llama import rope_cos_sin
    from tetron.parallel.recompute import apply_recompute
    from tetron.plan.activations import layer_activations
    from tetron.plan.sizes import Sizes

    model = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
             "num_hidden_layers": 1, "vocab_size": 64, "max_position_embeddings": 16}
    cfg = from_dict({"model": {"model_type": family, **model}, "data": {"seq_len": 16}, "train": {"micro_batch": 2,
                                                                                            "dtype": dtype}})
    torch.manual_seed(0)
    compute = getattr(torch, dtype)
    llama = apply_recompute(family_of(family).model_class(cfg.model).to(compute), mode)
    layer = llama.model.layers["0"]
    x = torch.randn(2, 16, 32, dtype=compute, requires_grad=True)
    cos, sin = rope_cos_sin(cfg.model, torch.arange(16)[None], dtype=compute)
    meter = ActivationMeter(layer.parameters())
    with meter:
        out = layer(x * 1, cos, sin)  # x * 1: the layer's input made inside, as the previous layer's output is
    rope = 2 * 16 * cfg.model.head_dim * compute.itemsize  # cos and sin, which the chunk counts once for all layers
    assert meter.live_bytes - rope == layer_activations(Sizes.of(cfg), mode), out.shape
