"""QK-clip (optim.qk_clip_tau, parallel/qk_clip.py): the largest attention logit per head, computed without the
scores whole, equals the scores' maximum; a run's logged max_attn_logit and its weights after clipped steps equal a
single-process loop written here (materialised scores, Kimi-K2's clip by kv-head group); dp, tp and cp runs equal
the single process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tetron.config import from_dict
from tetron.data.loader import DataLoader, load_tokens, prepare_data
from tetron.errors import ConfigError
from tetron.models.attention import Documents, causal_mask, document_mask, sdpa_attention
from tetron.models.llama import rope_cos_sin
from tetron.observe.evaluate import training_tokens
from tetron.optim import Param, optimizer_class
from tetron.parallel.init import seeded_model
from tetron.parallel.parallelize import param_roles
from tetron.parallel.qk_clip import LogitMax, clip_rows, scale_rows_
from tetron.schedule import lr_at
from tetron.validate import validate

from conftest import WEIGHT_ATOL, check_layout, layout_configs, reference_run, run_parallel, tiny_config

RTOL = 1e-5  # fp32: the logits of the same q and k, summed in another order (blocks, gathered keys)
ONE_RANK = SimpleNamespace(size=lambda axis: 1, local_rank=lambda axis: 0, group=lambda axis: None)


def _reference_max(q, k, docs, window, scale):
    """Each query head's largest logit, the scores materialised: k repeated per query head as SDPA does."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, T, T]
    pos = torch.arange(q.shape[2])
    allowed = document_mask(docs, pos, pos, window) if docs is not None else causal_mask(pos, pos, window)
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("docs, window, block", [(False, None, 1 << 22), (True, 5, 100), (False, 7, 37)],
                         ids=["causal", "documents-window-small-blocks", "window-ragged-blocks"])
def test_logit_max_equals_the_scores(docs, window, block, monkeypatch):
    """GQA (6 query heads over 2 kv heads), a scale of its own: the maximum per head over the allowed pairs,
    computed a block of queries at a time (the blocks' rows not dividing T), equals the whole scores'; the
    attention's output is the wrapped function's; under no_grad (validation) nothing is recorded."""
    monkeypatch.setattr("tetron.parallel.qk_clip.BLOCK", block)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 8, generator=g) * 3 for h in (6, 2, 2))
    ids = torch.randint(0, 3, (2, 24), generator=g).sort(dim=1).values if docs else None
    record = LogitMax(sdpa_attention, ONE_RANK, layout="zigzag")
    documents = Documents(ids) if docs else None
    out = record(q, k, v, documents, window, scale=0.3)
    torch.testing.assert_close(out, sdpa_attention(q, k, v, documents, window, scale=0.3), rtol=0, atol=0)
    expected = _reference_max(q, k, ids, window, 0.3)
    torch.testing.assert_close(record.max, expected, rtol=RTOL, atol=0)
    record(q * 2, k, v, documents, window, scale=0.3)  # a second micro-batch: the maximum over both
    torch.testing.assert_close(record.max, 2 * expected, rtol=RTOL, atol=0)
    with torch.no_grad():
        record(q * 5, k, v, documents, window, scale=0.3)
    torch.testing.assert_close(record.max, 2 * expected, rtol=RTOL, atol=0)


@pytest.mark.parametrize("start, n", [(0, 12), (5, 3), (5, 9), (3, 20), (8, 4)])
def test_scale_rows_of_a_piece(start, n):
    """A flat piece of a [6, 4] matrix (a ZeRO slice's cut anywhere), scaled by its rows' factors."""
    whole = torch.randn(6, 4)
    factor = torch.arange(1.0, 7.0)
    piece = whole.reshape(-1)[start:start + n].clone()
    scale_rows_(piece, start, 4, factor)
    torch.testing.assert_close(piece, (whole * factor[:, None]).reshape(-1)[start:start + n], rtol=0, atol=0)


MIXTRAL = {"model_type": "mixtral", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
MLA = {"model_type": "deepseek_v3", "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
       "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 2}


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q-latent", "q-proj"])
def test_mla_rule_scales_each_heads_logits_by_eta(corpus, cache_dir, tmp_path, q_lora_rank):
    """MLA's qk_clip_rule (Kimi-K2's: q and k nope rows by sqrt(eta), q rotary rows by eta, the shared rotary key
    and the values untouched): after its rows are scaled, every logit of head h is eta_h times what it was; the
    attention's values are untouched."""
    raw = tiny_config(corpus, cache_dir, tmp_path, model={**MLA, "q_lora_rank": q_lora_rank})
    cfg = from_dict(raw)
    model = seeded_model(cfg.model, seed=1, device=torch.device("cpu"))
    attn = model.model.layers["0"].self_attn
    seen = {}

    def recording(q, k, v, docs=None, window=None, **options):
        seen.update(scores=q @ k.transpose(-1, -2), v=v)
        return sdpa_attention(q, k, v, docs, window, **options)

    attn.attn_fn = recording
    x = torch.randn(2, 12, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(cfg.model, torch.arange(12)[None], dtype=x.dtype)
    attn(x, cos, sin)
    before = seen["scores"].detach()
    heads, kv_heads, rules = attn.qk_clip_rule()
    assert heads == kv_heads == 4
    eta = torch.tensor([0.3, 1.0, 0.7, 0.05])
    with torch.no_grad():
        for param, groups, parts in rules:
            group, power = clip_rows(groups, parts)
            param.mul_((eta[group] ** power)[:, None])
    attn(x, cos, sin)
    torch.testing.assert_close(seen["scores"], before * eta[None, :, None, None], rtol=1e-5, atol=1e-6)
    assert before.abs().max() > 1e-3


def _single_process(raw: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run of `raw` (one process, one micro-batch a step) as a loop written here: the scores of every layer
    materialised and their maximum per head kept, the loss, torch's norm clipping, the optimizer on the whole
    parameters, then Kimi-K2's clip: per kv-head group, where its largest logit m > tau, its query and key rows
    times sqrt(tau / m). Returns each step's largest logit and the final weights."""
    cfg = from_dict(raw)
    t, tau = cfg.train, cfg.optim.qk_clip_tau
    model = seeded_model(cfg.model, seed=t.seed, device=torch.device("cpu"))
    model.loss_chunk_tokens = t.loss_chunk_tokens
    attentions = [layer.self_attn for layer in model.model.layers.values()]
    maxima: dict[int, torch.Tensor] = {}

    def recording(i):
        def attention(q, k, v, docs=None, window=None, **options):
            scale = options.get("scale", q.shape[-1] ** -0.5)
            maxima[i] = _reference_max(q.detach(), k.detach(), docs.ids if docs else None, window, scale)
            return sdpa_attention(q, k, v, docs, window, **options)
        return attention

    for i, attn in enumerate(attentions):
        attn.attn_fn = recording(i)
    roles = param_roles([model])
    optimizer = optimizer_class(cfg.optim.name)([Param(p, roles[id(p)], p.shape) for p in model.parameters()], t,
                                                cfg.optim)
    _, path = prepare_data(cfg)
    loader = DataLoader(training_tokens(load_tokens(path), cfg), cfg.data.seq_len, micro_batch=cfg.global_batch,
                        grad_acc=1, dp_size=1, dp_rank=0, seed=t.seed)
    logged = []
    for step in range(t.steps):
        ((inputs, targets, *_),) = loader.next_batch()
        optimizer.set_lr(lr_at(step, t))
        (model(inputs, targets=targets) / targets.numel()).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), t.grad_clip)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        logged.append(float(torch.stack(list(maxima.values())).max()))
        with torch.no_grad():
            for i, attn in enumerate(attentions):
                kv = attn.k_proj.weight.shape[0] // attn.head_dim
                group = maxima[i].view(kv, -1).amax(dim=1)  # [KV]
                root = torch.where(group > tau, tau / group, torch.ones_like(group)).sqrt()
                for proj, rows in ((attn.q_proj, attn.q_proj.weight.shape[0] // kv), (attn.k_proj, attn.head_dim)):
                    proj.weight.mul_(root.repeat_interleave(rows)[:, None])
                    if proj.bias is not None:  # q = W x + b: both scale
                        proj.bias.mul_(root.repeat_interleave(rows))
    return logged, {n: p.detach() for n, p in model.state_dict().items()}


TAU = 0.05  # below this model's largest logits (0.05-0.08 at these steps, unclipped): most steps clip some groups


@pytest.mark.parametrize("optim, family", [("muon", "llama"), ("adamw", "qwen2")])
def test_clipped_run_equals_a_loop_written_here(corpus, cache_dir, tmp_path, optim, family):
    """One process, 4 steps, tau under the logits: max_attn_logit in metrics.jsonl and the final weights (the
    query and key projections clipped at every step) equal _single_process's. With AdamW too: the clip scales
    the weights after whichever optimizer stepped; Qwen2's q and k biases scale with their rows."""
    settings = {"name": optim, "qk_clip_tau": TAU, **({"muon_ns_dtype": "float32"} if optim == "muon" else {})}
    model = {"model_type": family}
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", optim=settings, train={"lr": 3e-2}, model=model)
    logged, weights = _single_process(raw)
    assert sum(m > TAU for m in logged) >= 3  # the clip acted
    (result,), written = run_parallel(raw)
    torch.testing.assert_close(torch.tensor([m["max_attn_logit"] for m in written["metrics"]]),
                               torch.tensor(logged), rtol=RTOL, atol=0)
    for name, value in written["model"].items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    unclipped = run_parallel(tiny_config(corpus, cache_dir, tmp_path / "off", optim={**settings, "qk_clip_tau": None},
                                         train={"lr": 3e-2}, model=model))[1]
    assert "max_attn_logit" not in unclipped["metrics"][0]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (unclipped["model"][name] - weights[name]).abs().max() > 100 * WEIGHT_ATOL  # the clip changed them


CLIP_LAYOUTS = {  # (parallel, data, optim name, train): each equal to the single process, clipping included
    "dp2-zero2-small-buckets-adamw": ({"dp": 2, "zero": 2, "bucket_mb": 0.001}, {}, "adamw", {}),
    "dp2-zero1-muon": ({"dp": 2, "zero": 1}, {}, "muon", {}),
    "tp2-sp-muon": ({"tp": 2, "sp": True}, {}, "muon", {}),
    "cp2-documents-muon": ({"cp": 2}, {"mask_documents": True}, "muon", {}),  # keys gathered, zigzag positions
    "cp2-ulysses-window-muon": ({"cp": 2, "cp_impl": "ulysses"}, {}, "muon", {}),
    "pp2-recompute-muon": ({"pp": 2}, {}, "muon", {"recompute": "full"}),  # each stage its layers; recomputed
    # MLA's own rule (qk_clip_rule), kv_b_proj split by heads; its logits are smaller (MLA_TAU), and at 3e-2 the
    # unclipped tp2 run's lm_head (AdamW) already strays 6e-5 from one process (conftest.LAYOUT_LR's rounding)
    "tp2-mla-muon": ({"tp": 2}, {}, "muon", {"lr": 3e-3}, MLA),
    "dp2-zero3-muon": ({"dp": 2, "zero": 3}, {}, "muon", {}),  # the rows clipped in each rank's flat slice
    "dp2-ep2-mixtral-muon": ({"dp": 2, "ep": 2}, {}, "muon", {}, MIXTRAL),  # attention clipped, experts by ep
}
MLA_TAU = 0.03  # under MLA's largest logits here (0.032-0.039 at every step)


@pytest.mark.parametrize("name", sorted(CLIP_LAYOUTS))
def test_clip_in_layouts(corpus, cache_dir, tmp_path, name):
    """max_attn_logit (the maximum over dp's rows, cp's positions, tp's heads) equals the single process's at
    every step, and so do the losses and the clipped weights (check_layout's tolerances)."""
    parallel, data, optim, train, *family = CLIP_LAYOUTS[name]
    tau = MLA_TAU if "mla" in name else TAU
    settings = {"name": optim, "qk_clip_tau": tau, **({"muon_ns_dtype": "float32"} if optim == "muon" else {})}
    model = {"num_hidden_layers": 2, **({"model_type": "mistral", "sliding_window": 8} if "window" in name else {}),
             **(family[0] if family else {})}
    layout = dict(parallel=parallel, model=model, data=data, optim=settings, train={"lr": 3e-2, **train})
    _, written = check_layout(corpus, cache_dir, tmp_path, **layout)
    _, ref_raw = layout_configs(corpus, cache_dir, tmp_path, **layout)
    ref = [m["max_attn_logit"] for m in reference_run(ref_raw)[1]["metrics"]]
    assert sum(m > tau for m in ref) >= 2  # the clip acted (at 2 of the 3 steps or all)
    torch.testing.assert_close(torch.tensor([m["max_attn_logit"] for m in written["metrics"]]), torch.tensor(ref),
                               rtol=RTOL, atol=0)


@pytest.mark.parametrize("optim, line", [
    ({"qk_clip_tau": 0.0}, "optim.qk_clip_tau=0.0 must be > 0 (Kimi-K2's: 100), or null: off"),
])
def test_bad_tau_is_one_line(corpus, cache_dir, tmp_path, optim, line):
    with pytest.raises(ConfigError) as err:
        validate(from_dict(tiny_config(corpus, cache_dir, tmp_path, optim=optim)))
    assert str(err.value) == line


def test_qk_norm_families_are_refused(corpus, cache_dir, tmp_path):
    raw = tiny_config(corpus, cache_dir, tmp_path, model={"model_type": "qwen3"}, optim={"qk_clip_tau": 50.0})
    with pytest.raises(ConfigError, match=r"^optim.qk_clip_tau=50.0: model_type=qwen3 norms q and k \(QK-norm"):
        validate(from_dict(raw))
