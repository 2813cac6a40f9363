"""The shared attention's options (models/attention.py's AttentionOptions) against transformers' own attention
where it has one (GptOss's sinks, Gemma 2's soft-capping and query_pre_attn_scalar, Olmo3's whole-projection
q/k norm) or plain math in fp64, fp32 within 1e-5; every fused path beside the math path it stands for (a v
of another width padded for the CPU kernel); and a toy family, defined and registered only here, with every
option that meets an axis (q/k wider than v, sinks, whole-projection q/k norm, alternating sliding and full
layers) trained in each layout equal to one process."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gpt_oss import modeling_gpt_oss

from tetron.mesh import Mesh
from tetron.models.attention import (
    AttentionOptions,
    Documents,
    document_mask,
    layer_windows,
    scored_attention,
    sdpa_attention,
)
from tetron.models.llama import LLAMA, Attention, LlamaConfig, rope_cos_sin
from tetron.models.spec import FAMILIES, ModelSpec, ParallelPlan, register
from tetron.parallel.block_attention import block_attention, block_attention_backward
from tetron.parallel.context_parallel import ring_attention, shard_indices
from tetron.parallel.ulysses import ulysses_attention

from conftest import check_layout
from harness import run_ranks

TOL = dict(atol=1e-5, rtol=1e-5)
B, H, KVH, T = 2, 4, 2, 16


def _qkv(d: int = 8, dv: int = 8, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, KVH, T, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, KVH, T, dv, generator=g, dtype=torch.float64).to(dtype))


def _reference(q, k, v, *, window=None, ids=None, scale=None, softcap=None, sinks=None):
    """Attention in fp64 by the definitions: scores, cap, mask, softmax with a sink column dropped after."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q.shape[2])
    allowed = pos[:, None] >= pos[None, :]
    if window is not None:
        allowed = allowed & (pos[:, None] - pos[None, :] < window)
    if ids is not None:
        allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = scores.softmax(-1)
    return probs[..., :v.shape[2]] @ v


IDS = torch.tensor([[0] * 9 + [1] * 7, [0] * 3 + [1] * 13])


# ----------------------------------------------------------------------------- 1. q/k and v widths


@pytest.mark.parametrize("dv", [4, 12])  # v narrower than q/k (DeepSeek-V3's MLA) and wider
@pytest.mark.parametrize("masked", ["none", "window", "docs"])
def test_value_width_of_its_own(dv, masked):
    """SDPA (no mask) takes v of another width as it is; the CPU flash kernel (a window or documents) gets the
    narrower side padded with zeros and its output cut back: both equal the fp64 definition, grads too."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(8, dv))
    window, docs = (5 if masked == "window" else None), (Documents(IDS) if masked == "docs" else None)
    out = sdpa_attention(q, k, v, docs, window)
    assert out.shape == (B, H, T, dv)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*ref_in, window=window, ids=IDS if docs else None)
    torch.testing.assert_close(out.double(), ref, **TOL)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    ref.backward(dout.double())
    for name, got, want in zip("qkv", (q, k, v), ref_in):
        torch.testing.assert_close(got.grad.double(), want.grad, **TOL, msg=f"d{name}")


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("dv", [4, 12])
def test_block_kernels_with_a_value_width_of_its_own(dv, scale):
    """A block on the CPU flash kernel (padded: q and k padded where v is wider, their scale kept) and on the math
    path: the same out, lse and gradients."""
    q, k, v = _qkv(8, dv)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = document_mask(IDS, torch.arange(T), torch.arange(T))
    dout = torch.randn(B, H, T, dv, generator=torch.Generator().manual_seed(2))
    results = []
    for kernel in ("cpu_flash", "math"):
        out, lse = block_attention(q, k, v, True, kernel=kernel, mask=mask, scale=scale)
        grads = block_attention_backward(dout, q, k, v, out, lse, True, kernel=kernel, mask=mask, scale=scale)
        results.append((out, lse, *grads))
    assert results[0][0].shape == (B, H, T, dv) and results[0][2].shape == q.shape and results[0][4].shape == v.shape
    ref = _reference(q, k, v, ids=IDS, scale=scale)
    torch.testing.assert_close(results[1][0].double(), ref, **TOL)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, **TOL, msg=name)


# ----------------------------------------------------------------------------- 2. per-layer kinds


def test_layer_types_give_each_layer_its_window():
    assert layer_windows(["sliding_attention", "full_attention"], 5, 2) == [5, None]
    assert layer_windows(None, 5, 3) == [None, None, None]
    for bad, words in ((["full_attention"], "per layer (2)"), (["full_attention", "local"], "per layer"),
                       (["chunked_attention", "full_attention"], "'chunked_attention' is not implemented")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            layer_windows(bad, 5, 2)
    with pytest.raises(ValueError, match="sliding_window is null"):
        layer_windows(["sliding_attention", "full_attention"], None, 2)


def test_attention_module_follows_each_layers_options():
    """Mistral's window in every layer and Qwen's per layer_types come through attention_options unchanged."""
    from tetron.models import family
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    mistral = family("mistral").config_class(**base, sliding_window=5)
    qwen = family("qwen3").config_class(**base, use_sliding_window=True, sliding_window=5,
                                        layer_types=["full_attention", "sliding_attention", "full_attention"])
    assert [Attention(mistral, i).sliding_window for i in range(3)] == [5, 5, 5]
    assert [Attention(qwen, i).sliding_window for i in range(3)] == [None, 5, None]
    assert Attention(qwen, 0).qk_norm == "head"


# ----------------------------------------------------------------------------- 5. scale, 4. soft-capping, 3. sinks


def _causal_additive(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


def test_scale_and_softcap_match_gemma2():
    """query_pre_attn_scalar**-0.5 and attn_logit_softcapping as transformers' Gemma 2 eager attention; the
    block math path (ring attention's) with the same options too, forward and backward."""
    q, k, v = _qkv()
    scale, cap = 24 ** -0.5, 1.5  # a cap the scores reach: tanh bends them
    module = SimpleNamespace(num_key_value_groups=H // KVH, training=False, head_dim=8)
    want, _ = modeling_gemma2.eager_attention_forward(module, q, k, v, _causal_additive(T), scaling=scale,
                                                      softcap=cap)
    got = sdpa_attention(q, k, v, scale=scale, softcap=cap)
    torch.testing.assert_close(got, want.transpose(1, 2), **TOL)
    assert (sdpa_attention(q, k, v, scale=scale) - got).abs().max() > 1e-2  # the cap changes the output
    torch.testing.assert_close(sdpa_attention(q, k, v, scale=scale), _reference(q, k, v, scale=scale).float(),
                               **TOL)  # the scale alone stays on the fused kernel
    # the block path: math, with the final lse its backward needs
    qr, kr, vr = (t.requires_grad_(True) for t in (q.clone(), k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    out, lse = block_attention(qr, kr, vr, True, scale=scale, softcap=cap)
    torch.testing.assert_close(out, want.transpose(1, 2), **TOL)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = block_attention_backward(dout, qr, kr, vr, out, lse, True, scale=scale, softcap=cap)
    ref = sdpa_attention(qr, kr, vr, scale=scale, softcap=cap)
    for name, got_grad, want_grad in zip("qkv", grads, torch.autograd.grad(ref, (qr, kr, vr), dout)):
        torch.testing.assert_close(got_grad, want_grad, **TOL, msg=f"d{name}")


@pytest.mark.parametrize("dv", [8, 4])
@pytest.mark.parametrize("masked", ["none", "window", "docs"])
def test_sinks_match_gpt_oss(masked, dv):
    """One learned logit per head in the denominator, as transformers' GptOss eager attention adds it: on the
    CPU's fused kernel (the sinks added to its log-sum-exp) and on the math path (scored_attention, CUDA's),
    with the same gradients of q, k, v and the sinks."""
    q, k, v = _qkv(8, dv)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(4))
    window, docs = (5 if masked == "window" else None), (Documents(IDS) if masked == "docs" else None)
    pos = torch.arange(T)
    allowed = document_mask(IDS, pos, pos, window) if docs else (pos[:, None] - pos[None, :] < (window or T)) & (
        pos[:, None] >= pos[None, :])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).expand(B, 1, T, T)
    module = SimpleNamespace(num_key_value_groups=H // KVH, training=False, sinks=sinks)
    want, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=8 ** -0.5)
    dout = torch.randn(B, H, T, dv, generator=torch.Generator().manual_seed(5))
    grads = []
    for path in ("fused", "math"):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        if path == "fused":
            got = sdpa_attention(*inputs[:3], docs, window, sinks=inputs[3])
        else:
            rep = [t.repeat_interleave(H // KVH, 1) for t in inputs[1:3]]
            got = scored_attention(inputs[0], *rep, docs, window, sinks=inputs[3])
        torch.testing.assert_close(got, want.transpose(1, 2), **TOL, msg=path)
        got.backward(dout)
        grads.append([t.grad for t in inputs])
    for name, fused, math in zip(("dq", "dk", "dv", "dsinks"), *grads):
        torch.testing.assert_close(fused, math, **TOL, msg=name)
    assert (sdpa_attention(q, k, v, docs, window) - want.transpose(1, 2)).abs().max() > 1e-3  # sinks matter


def _options_rank(impl: str, dv: int) -> dict:
    """cp ranks: ring or Ulysses attention with sinks, a scale, soft-capping and v of its own width,
    against one process's sdpa_attention on the whole sequence: outputs and gradients of q, k, v and sinks."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(cp=cp)
    q, k, v = _qkv(8, dv, seed=5)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(6))
    options = {"scale": 0.3, "softcap": 2.0, "sinks": sinks}
    dout = torch.randn(B, H, T, dv, generator=torch.Generator().manual_seed(7))
    idx = shard_indices(T, cp, rank)
    local = [t[:, :, idx].clone().requires_grad_(True) for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_(True)
    if impl == "ring":
        out = ring_attention(*local, Documents(IDS), 5, mesh=mesh, **{**options, "sinks": local_sinks})
    else:
        shards = lambda n, c, r: shard_indices(n, c, r)  # noqa: E731
        out = ulysses_attention(*local, Documents(IDS), 5, mesh=mesh, shards=shards,
                                **{**options, "sinks": local_sinks})
    out.backward(dout[:, :, idx])
    dist.all_reduce(local_sinks.grad)  # every rank's share of the sinks' gradient (dp*cp's sum does this)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    full_sinks = sinks.clone().requires_grad_(True)
    ref = sdpa_attention(*full, Documents(IDS), 5, **{**options, "sinks": full_sinks})
    ref.backward(dout)
    return {"got": [out.detach(), *(t.grad for t in local), local_sinks.grad],
            "want": [ref.detach()[:, :, idx], *(t.grad[:, :, idx] for t in full), full_sinks.grad]}


@pytest.mark.parametrize("impl, dv", [("ring", 4), ("ulysses", 12)])
def test_cp_attention_with_options_equals_one_process(impl, dv):
    for r in run_ranks(2, _options_rank, impl, dv):
        for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), r["got"], r["want"]):
            torch.testing.assert_close(got, want, **TOL, msg=name)


# ----------------------------------------------------------------------------- 6. QK-norm over the whole projection


def test_projection_qk_norm_matches_olmo3():
    """Olmo3Attention (q_norm over all query heads' width, k_norm over all key heads') on the same weights."""
    cfg = _ToyConfig(**_TOY_MODEL, sinks=False, v_head_dim=8, layer_types=["full_attention"] * 2,
                     query_pre_attn_scalar=None, attn_logit_softcapping=None)
    ours = Attention(cfg, 0).eval()
    hf_cfg = transformers.Olmo3Config(hidden_size=32, num_attention_heads=H, num_key_value_heads=KVH,
                                      intermediate_size=64, num_hidden_layers=2, rms_norm_eps=cfg.rms_norm_eps)
    hf_cfg._attn_implementation = "eager"
    theirs = transformers.models.olmo3.modeling_olmo3.Olmo3Attention(hf_cfg, 0).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(8))
    cos, sin = rope_cos_sin(cfg, torch.arange(T)[None], dtype=torch.float32)
    with torch.no_grad():
        want, _ = theirs(x, (cos, sin), _causal_additive(T))
        got = ours(x, cos, sin)
    torch.testing.assert_close(got, want, **TOL)


# ----------------------------------------------------------------------------- the toy family, in every layout


@dataclass
class _ToyConfig(LlamaConfig):
    """A family only this file knows: q/k heads wider than v heads, sinks, whole-projection q/k norms, sliding
    layers between full ones, Gemma's scale, and soft-capping in the full layers (which so run ring attention's
    math blocks, while the sliding ones run its fused kernel with v padded)."""

    model_type: str = "toy_attention"
    v_head_dim: int = 4  # narrower than head_dim (hidden 32 / 4 heads = 8)
    sinks: bool = True
    sliding_window: int | None = 5
    layer_types: list[str] | None = field(default=None)
    query_pre_attn_scalar: float | None = 12.0  # scale = query_pre_attn_scalar**-0.5
    attn_logit_softcapping: float | None = 3.0

    hf_architecture: ClassVar[str] = "ToyAttentionForCausalLM"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)

    def attention_options(self, index: int) -> AttentionOptions:
        window = layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)[index]
        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5
        return AttentionOptions(head_dim=self.head_dim, v_head_dim=self.v_head_dim, window=window, sinks=self.sinks,
                                qk_norm="projection", scale=scale,
                                softcap=None if window else self.attn_logit_softcapping)


_TOY_MODEL = dict(hidden_size=32, num_attention_heads=H, num_key_value_heads=KVH, num_hidden_layers=2)
_TOY_PLAN = ParallelPlan(blocks=LLAMA.plan.blocks, residual_norms=LLAMA.plan.residual_norms,
                         head_params=("self_attn.sinks",), projection_norms=("self_attn.q_norm", "self_attn.k_norm"))


@pytest.fixture
def toy_family():
    """The toy registered for one test (forked ranks inherit it), then removed."""
    assert "toy_attention" not in FAMILIES
    register(ModelSpec(name="toy_attention", model_types=("toy_attention",), config_class=_ToyConfig,
                       model_class=LLAMA.model_class,
                       plan=_TOY_PLAN))
    yield
    del FAMILIES["toy_attention"]


TOY_LAYOUTS = {
    "dp2": {"dp": 2},
    "tp2-sp": {"tp": 2, "sp": True},
    "pp2-1f1b": {"pp": 2},
    "pp2-zbv": {"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2},
    "cp2-ring": {"cp": 2},
    "cp2-ulysses": {"cp": 2, "cp_impl": "ulysses"},
}


@pytest.mark.parametrize("name", sorted(TOY_LAYOUTS))
def test_toy_family_layout_matches_single_process(toy_family, corpus, cache_dir, tmp_path, name):
    # Four layers: with two, one element of layer 0's q_proj has a gradient near AdamW's eps (1e-8), where
    # rounding alone moves its first update by 2% (cp2-ring: 1.0e-5 after step 1, over WEIGHT_ATOL)
    _, written = check_layout(corpus, cache_dir, tmp_path, parallel={**TOY_LAYOUTS[name], "bucket_mb": 0.01},
                              model={"model_type": "toy_attention", "num_hidden_layers": 4})
    state = written["model"]
    assert state["model.layers.0.self_attn.v_proj.weight"].shape == (KVH * 4, 32)
    assert state["model.layers.0.self_attn.sinks"].shape == (H,)
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (H * 8,)
    assert (state["model.layers.0.self_attn.q_norm.weight"] - 1).abs().max() > 1e-4  # the norm trained


def test_toy_counts_its_parameters_and_flops():
    """num_params counts v's own width, the sinks and the projection norms; flops_per_token the scores over
    head_dim and the weighted values over v_head_dim, over the keys each layer reaches (its window where
    shorter than the sequence)."""
    cfg = _ToyConfig(**_TOY_MODEL, vocab_size=64, intermediate_size=64)
    assert cfg.num_params() == sum(p.numel() for p in LLAMA.model_class(cfg).parameters())
    n = cfg.num_params(include_embedding=False) + 64 * 32
    # fwd + 2x bwd: 6 FLOPs a score and weighted value, a sliding layer's 5 keys and the full layer's 16
    assert cfg.sliding_window == 5 and cfg.flops_per_token(16) == 6 * n + 6 * H * (8 + 4) * (5 + 16)
    assert cfg.flops_per_token(4) == 6 * n + 6 * H * (8 + 4) * (4 + 4)  # a window longer than the sequence


@pytest.mark.parametrize("parallel", [{}, {"tp": 2, "sp": True}, {"cp": 2}, {"cp": 2, "cp_impl": "ulysses"}],
                         ids=["one", "tp2-sp", "cp2-ring", "cp2-ulysses"])
def test_planner_measures_the_toy_family(toy_family, parallel):
    """The planner knows the toy without a line of its own in tetron/plan/: what its layer saves is measured from the
    toy's own code (plan/probe.py), the same on fake tensors as on real ones, and the memory model reads that."""
    from tetron.config import from_dict
    from tetron.plan import probe
    from tetron.plan.activations import layer_kept, layer_none
    from tetron.plan.memory import predict
    from tetron.plan.sizes import Sizes

    cfg = from_dict({"model": {"model_type": "toy_attention", **_TOY_MODEL, "vocab_size": 64, "intermediate_size": 64},
                     "parallel": parallel, "data": {"seq_len": 16}, "train": {"micro_batch": 2}})
    p = probe.probe_of(cfg, False)
    fake = probe._measure(p)
    assert fake == probe._measure(p, fake=False)
    s = Sizes.of(cfg)
    assert layer_none(s) == fake["none"] and layer_kept(s, "selective") == fake["selective"]
    assert 0 < fake["full"] < fake["selective"] <= fake["none"]
    assert predict(cfg).activations >= cfg.model.num_hidden_layers * fake["none"]


def test_kv_cache_takes_the_toy_familys_options():
    """Generation's KV cache (observe/generate.py) with v of its own width, sinks, a scale, soft-capping and
    alternating windows: each new token's logits equal the whole sequence's forward pass."""
    from tetron.observe.generate import kv_cache

    cfg = _ToyConfig(**_TOY_MODEL, vocab_size=64, intermediate_size=64, sliding_window=3)
    torch.manual_seed(0)
    model = LLAMA.model_class(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # sinks start at 0: make them count
            if name.endswith("sinks"):
                param.normal_()
        ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
        full = model(ids)[0]  # [10, vocab]
        with kv_cache(model):
            steps = [model(ids[:, :3])[0, -1]]  # the prompt, then one token at a time
            steps += [model(ids[:, t:t + 1], torch.tensor([t]))[0, -1] for t in range(3, 10)]
    torch.testing.assert_close(torch.stack(steps), full[2:], atol=1e-5, rtol=1e-5)


def test_the_toy_familys_norms_start_at_one_and_its_sinks_drawn(toy_family):
    """The family's init (ModelSpec.init, by module type): the whole-projection q/k norms start at ones, as
    Olmo3's do; the sinks are drawn, as GptOss's _init_weights draws them."""
    from tetron.parallel.init import seeded_model

    cfg = _ToyConfig(**_TOY_MODEL, vocab_size=64, intermediate_size=64)
    weights = dict(seeded_model(cfg, seed=1, device=torch.device("cpu")).named_parameters())
    assert torch.equal(weights["model.layers.0.self_attn.q_norm.weight"], torch.ones(H * 8))
    assert torch.equal(weights["model.layers.1.self_attn.k_norm.weight"], torch.ones(KVH * 8))
    assert weights["model.layers.0.self_attn.sinks"].std() > 0
