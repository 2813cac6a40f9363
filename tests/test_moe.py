"""The mixture-of-experts layer (models/moe.py) and its families (models/qwen3_moe.py, models/mixtral.py): each
block equal to transformers' on the same weights and inputs, each family's model equal to transformers' class
(fp32 logits within 1e-5), its folders loaded by transformers, capacity dropping counted, and data-parallel
training equal to the single process, balancing figures included."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tetron.checkpoint.check import verify_tensors
from tetron.checkpoint.load import load_model
from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.device import compile_problem
from tetron.errors import ConfigError
from tetron.models.blocks import ACTIVATIONS
from tetron.models.mixtral import MixtralConfig
from tetron.models.moe import Experts, MoEBlock, Router, sequence_balance_losses
from tetron.models.qwen3_moe import MoeConfig, MoeForCausalLM
from tetron.parallel import compile as compile_module
from tetron.parallel.init import seeded_model
from tetron.parallel.moe_balance import FIGURES, finish_moe_step
from tetron.validate import validate

from conftest import (
    LOSS_RTOL,
    STEPS,
    WEIGHT_ATOL,
    check_layout,
    layout_configs,
    reference_run,
    run_parallel,
    tiny_config,
    train_rank,
)
from harness import run_ranks

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _hf_block(kind: str, act: str = "silu"):
    """transformers' block of `kind` and the keyword arguments of tetron's MoEBlock with its routing rules."""
    common = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=16, num_experts_per_tok=2,
                  hidden_act=act)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=False)
        return transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg), dict(
            num_experts=8, norm_topk_prob=False)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=4)
        return transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg), dict(num_experts=4)
    cfg = transformers.DeepseekV3Config(**common, n_routed_experts=8, n_shared_experts=2, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, norm_topk_prob=True)
    return transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg), dict(
        num_experts=8, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, scoring="sigmoid",
        bias_update_rate=0.01)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_the_block_equals_transformers(kind, act):
    """Same weights, same input: the output, and the gradients of the input and every weight, within 1e-5
    (DeepSeek-V3's with a nonzero routing bias that changes which experts win); the experts' (and the shared
    experts') activation the config's hidden_act, as transformers' experts read it."""
    torch.manual_seed(0)
    hf, kwargs = _hf_block(kind, act)
    ours = MoEBlock(32, 16, kwargs.pop("num_experts"), 2, act=act, **kwargs)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        if kind == "deepseek_v3":
            hf.gate.e_score_correction_bias.normal_(0, 0.3)
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 24, 32, requires_grad=True)
    x_ours = x.detach().clone().requires_grad_()
    expected, got = hf(x), ours(x_ours)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    cotangent = torch.randn_like(got)
    (expected * cotangent).sum().backward()
    (got * cotangent).sum().backward()
    torch.testing.assert_close(x_ours.grad, x.grad, rtol=1e-5, atol=1e-5)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("config_class, hf_class", [(MoeConfig, "Qwen3MoeForCausalLM"),
                                                    (MixtralConfig, "MixtralForCausalLM")])
def test_the_family_equals_transformers(config_class, hf_class, tmp_path):
    """Logits within 1e-5 on the same weights, the same state_dict keys, transformers' from_pretrained reads
    tetron's folder, and transformers' own auxiliary loss equals tetron's batch-wise one. Qwen3-MoE with its
    q/k norms, Mixtral with a sliding window of 5 in sequences of 16 (Llama's shared attention options)."""
    from tetron.checkpoint.check import inspect_checkpoint
    from tetron.checkpoint.load import TensorReader, load_model
    from tetron.checkpoint.save import save_model
    from tetron.models.spec import read_as_of

    cfg = config_class(**TINY, moe_aux_loss="batch", **({"moe_intermediate_size": 16} if config_class is MoeConfig
                                                        else {"sliding_window": 5}))
    model = seeded_model(cfg, seed=0, device=torch.device("cpu"))
    save_model(model, tmp_path / "folder")
    hf = getattr(transformers, hf_class).from_pretrained(tmp_path / "folder").eval()
    assert set(hf.state_dict()) == set(model.state_dict())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out = hf(ids, output_router_logits=True)
    logits = model(ids)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-5)
    figures = finish_moe_step([model], None, sequences=2)
    torch.testing.assert_close(figures[0], out.aux_loss.float(), rtol=1e-5, atol=0)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    # transformers writes the hub's layout, experts one by one (Mixtral's as w1/w3/w2, its router renamed):
    # the pre-start check, the slice reader (--init-from) and load_model assemble tetron's tensors from it
    fresh = getattr(transformers, hf_class)(hf.config)  # (one loaded from a fused folder writes it back fused)
    fresh.load_state_dict(hf.state_dict())
    fresh.save_pretrained(tmp_path / "hub")
    with TensorReader(tmp_path / "hub") as reader:
        assert not any(".experts.gate_up_proj" in name for name in reader.names())
    inspect_checkpoint(tmp_path / "hub", require_state=False)
    with TensorReader(tmp_path / "hub", read_as=read_as_of(cfg)) as reader:
        for name, value in model.state_dict().items():
            assert torch.equal(reader.read(name), value), name
        assert torch.equal(reader.read("model.layers.1.mlp.experts.down_proj", 0, 1, 3),
                           model.state_dict()["model.layers.1.mlp.experts.down_proj"][1:3])
    torch.testing.assert_close(load_model(tmp_path / "hub")(ids), logits, rtol=0, atol=1e-6)


def test_the_balancing_losses_reach_the_gradients_with_their_weights():
    """The block injects d(loss_scale * (aux_coef * aux + z_coef * z)) in the backward pass: the gradients equal
    those of the output plus the explicitly added losses (sequence_balance_losses over the same routing)."""
    torch.manual_seed(2)
    block = MoEBlock(8, 8, 4, 2, aux_loss_coef=0.3, z_loss_coef=0.2)
    block.loss_scale = 0.25
    for p in block.parameters():
        p.data.normal_()
    x = torch.randn(3, 5, 8)
    block(x).sum().backward()
    injected = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    plain = MoEBlock(8, 8, 4, 2)  # no coefficients: nothing injected
    plain.load_state_dict(block.state_dict())
    plain(x).sum().backward()
    without = plain.gate.weight.grad.clone()
    plain.zero_grad()
    aux, z = sequence_balance_losses(plain.gate(x.view(-1, 8)), 3, 4)
    (plain(x).sum() + 0.25 * (0.3 * aux + 0.2 * z)).backward()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(injected[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert (injected["gate.weight"] - without).abs().max() > 1e-3  # the losses do move the router


def test_the_grouped_matmul_path_equals_the_loop_over_experts():
    """Experts.grouped, CUDA's way (each expert's rows moved to an aligned start, the buffer's size known without
    a host read) and the CPU's (rows where they are), equals the per-expert loop, forward and backward (a summed
    output's expanded gradient included), with empty experts first, in the middle and last, and none at all."""
    torch.manual_seed(0)
    experts = Experts(5, 16, 8)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    for counts in ([3, 0, 9, 1, 8], [0, 0, 0, 0, 4], [8, 8, 0, 0, 0], [0, 0, 0, 0, 0]):
        counts = torch.tensor(counts)
        x = torch.randn(int(counts.sum()), 16)
        grads = []
        for run in (experts.loop, experts.grouped, functools.partial(experts.grouped, align=1)):
            inp = x.clone().requires_grad_()
            out = run(inp, counts)
            out.sum().backward()
            grads.append([out, inp.grad, *(p.grad for p in experts.parameters())])
            experts.zero_grad(set_to_none=True)
        for got in grads[1:]:
            for a, b in zip(got, grads[0]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _experts_by_definition(experts: Experts, x: torch.Tensor, counts: torch.Tensor, act) -> torch.Tensor:
    """Each row through its expert, down(act(gate x) * up x), one row at a time in fp64."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    rows = []
    for row, e in zip(x.double(), expert.tolist()):
        gate, up = (experts.gate_up_proj[e].double() @ row).chunk(2)
        rows.append(experts.down_proj[e].double() @ (act(gate) * up))
    return torch.stack(rows)


def test_experts_take_the_configs_activation():
    """GELU experts (loop, CPU grouped, CUDA's aligned grouped) equal the definition computed here within 1e-5,
    forward and backward; silu experts give the bits of the SwiGLU written out; a MoE family's config hands its
    hidden_act to its experts and its shared experts."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 6, 2])
    x = torch.randn(int(counts.sum()), 16)
    gelu = Experts(4, 16, 8, act="gelu_pytorch_tanh")
    with torch.no_grad():
        for p in gelu.parameters():
            p.normal_(0, 0.5)
    want = _experts_by_definition(gelu, x, counts, lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    assert (want - _experts_by_definition(gelu, x, counts, torch.nn.functional.silu)).abs().max() > 1e-2
    cotangent = torch.randn(want.shape)
    want_grads = torch.autograd.grad((want * cotangent.double()).sum(), list(gelu.parameters()))
    for run in (gelu.loop, gelu.grouped, functools.partial(gelu.grouped, align=1)):
        got = run(x, counts)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        for got_grad, want_grad in zip(torch.autograd.grad((got * cotangent).sum(), list(gelu.parameters())),
                                       want_grads):
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5)
    silu = Experts(4, 16, 8)
    silu.load_state_dict(gelu.state_dict())
    swiglu = []
    for e, (start, n) in enumerate(zip((counts.cumsum(0) - counts).tolist(), counts.tolist())):
        gate, up = torch.nn.functional.linear(x[start:start + n], silu.gate_up_proj[e]).chunk(2, dim=-1)
        swiglu.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, silu.down_proj[e]))
    assert torch.equal(silu.loop(x, counts), torch.cat(swiglu))
    block = MoeForCausalLM(MoeConfig(**{**TINY, "hidden_act": "gelu_pytorch_tanh", "n_shared_experts": 1})).model
    assert block.layers["0"].mlp.experts.act_fn is block.layers["0"].mlp.shared_experts.act_fn is ACTIVATIONS[
        "gelu_pytorch_tanh"]


def test_selective_recompute_keeps_the_grouped_experts_and_replays_the_rest(monkeypatch):
    """Under recompute=selective an MoE layer's backward equals the plain one's, in a process that has not yet
    asked whether the CPU runs the grouped path (the question's own forward and backward,
    asked inside a recorded layer, once broke its replay)."""
    from tetron.parallel.recompute import apply_recompute
    from tetron.torch_private import grouped as grouped_module

    grouped_module._cpu_works.cache_clear()
    cfg = MoeConfig(**{**TINY, "moe_intermediate_size": 32})
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("selective", "none"):  # selective first: its forward the process's first with experts
        model = seeded_model(cfg, seed=0, device=torch.device("cpu"))
        apply_recompute(model, mode)
        model(ids, targets=ids).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_capacity_drops_the_assignments_beyond_it_and_counts_them():
    """capacity = factor * tokens * k / E; each expert keeps its first tokens, the output of a dropped
    assignment is left out of its token's sum, and the step reports the fraction dropped."""
    torch.manual_seed(1)
    block = MoEBlock(8, 8, 4, 2, capacity_factor=0.5, bias_update_rate=0.1)  # capacity: ceil(0.5*16*2/4) = 4
    dropless = MoEBlock(8, 8, 4, 2, bias_update_rate=0.1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    dropless.load_state_dict(block.state_dict())
    x = torch.randn(1, 16, 8)
    route = block.gate(x.view(-1, 8))
    counts = torch.bincount(route.experts.flatten(), minlength=4)
    assert counts.max() > 4  # the test routes more than capacity to some expert
    expected = dropless(x).detach().view(-1, 8)
    kept = torch.zeros(16, 2, dtype=torch.bool)
    for e in range(4):
        tokens, slots = (route.experts == e).nonzero(as_tuple=True)  # row-major: token order
        kept[tokens[:4], slots[:4]] = True
    out = block(x).detach().view(-1, 8)
    for t in range(16):  # a token with a dropped choice gets only its kept expert's share
        if kept[t].all():
            torch.testing.assert_close(out[t], expected[t])
    partial = ~kept.all(1)
    assert (out[partial] - expected[partial]).abs().amax(1).min() > 1e-4
    figures = dict(zip(FIGURES, finish_moe_step([block], None, sequences=1).tolist()))
    dropped = (counts - counts.clamp(max=4)).sum().item()
    assert figures["moe_dropped_frac"] == pytest.approx(dropped / 32)
    assert figures["moe_load_imbalance"] == pytest.approx(counts.max().item() / counts.float().mean().item())
    # aux-loss-free balancing: the routing bias rises for the experts chosen less than the mean, falls for the others
    loads = counts.float()
    torch.testing.assert_close(block.gate.e_score_correction_bias, 0.1 * torch.sign(loads.mean() - loads))


def test_dp2_zero3_trains_like_one_process(corpus, cache_dir, tmp_path):
    """Losses, final weights (the routing biases included), and the balancing figures of every step (auxiliary
    loss, z-loss, load) equal to the single process, with the aux-loss-free routing bias moving (the same on
    both ranks: the losses would part otherwise); under ZeRO-3 and full recomputation (whose replayed forwards
    inject the balancing gradients again but must not count their figures twice). dp2 with ZeRO 0, 1, 2 and
    selective recomputation, pp2 with 1f1b, interleaved, zbh1 and zbv, and dp2 pp2 interleaved ZeRO-3
    passed the same check when written (4 ranks cost the suite 4 s more)."""
    model = {**MOE, "router_z_loss_coef": 1e-3, "moe_bias_update_rate": 1e-2, "router_aux_loss_coef": 0.01}
    layout = dict(model=model, train={"recompute": "full"}, parallel={"dp": 2, "zero": 3})
    _, written = check_layout(corpus, cache_dir, tmp_path, **layout)
    # the reference check_layout compared with (trained once per session: its folder may be another test's)
    ref = reference_run(layout_configs(corpus, cache_dir, tmp_path, **layout)[1])[1]["metrics"]
    for name in FIGURES:
        torch.testing.assert_close(torch.tensor([m[name] for m in written["metrics"]]),
                                   torch.tensor([m[name] for m in ref]), rtol=1e-5, atol=1e-7, msg=name)
    assert ref[0]["moe_aux_loss"] > 0 and ref[0]["moe_load_imbalance"] >= 1
    biases = [v for k, v in written["model"].items() if k.endswith("gate.e_score_correction_bias")]
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases)  # saved, moved, equal to the reference's


@pytest.mark.parametrize("parallel, split", [({"tp": 2, "sp": True}, "sp=true (tp=2)"), ({"cp": 2}, "cp=2")])
def test_the_batch_auxiliary_loss_is_refused_where_sequences_are_split(corpus, cache_dir, tmp_path, parallel, split):
    cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path, model={**MOE, "moe_aux_loss": "batch"},
                                parallel=parallel))
    with pytest.raises(ConfigError, match="^" + re.escape(f"model.moe_aux_loss=batch with parallel.{split}: ")):
        validate(cfg)


def _exchange_on_rank() -> None:
    """On rank r of dp2 ep2: the exchange with r's 2 of 4 experts equals all 4 experts in one place, output and
    input gradient, where a rank sends nothing, receives nothing, or nobody sends anything."""
    from tetron.mesh import Mesh
    from tetron.parallel.expert_parallel import ExpertExchange

    mesh = Mesh(dp=2, ep=2)
    r = mesh.local_rank("ep")
    torch.manual_seed(0)
    whole, mine = Experts(4, 8, 6), Experts(2, 8, 6)
    with torch.no_grad():
        for p, q in zip(whole.parameters(), mine.parameters()):
            q.copy_(p.normal_()[2 * r:2 * r + 2])
    for counts in ([3, 2, 0, 0], [0, 0, 0, 0], [0, 0, 1, 4], [0, 5, 0, 0]):
        counts = torch.tensor(counts if r == 0 else counts[::-1])
        x = torch.randn(int(counts.sum()), 8, requires_grad=True)
        got, expected = ExpertExchange(mine, mesh.group("ep"), 2)(x, counts), whole(x, counts)
        torch.testing.assert_close(got, expected)
        cotangent = torch.randn_like(got)
        torch.testing.assert_close(torch.autograd.grad(got, x, cotangent)[0],
                                   torch.autograd.grad(expected, x, cotangent)[0])


def test_the_expert_exchange_equals_the_experts_in_one_place():
    run_ranks(2, _exchange_on_rank)


# --- MoE models under tp (with and without sp), cp (ring, Ulysses) and compile ---


def test_the_shares_of_a_split_sequence_add_up_to_its_balancing_losses():
    """Sequences cut into 4 pieces of scattered positions (as cp's zigzag and sp cut them), each piece's counts
    summed over the pieces as the all-reduce does: the pieces' shares of the auxiliary and z losses, and their
    gradients, add up to the whole sequences' (which equal E * sum_e f_e * P_e and the mean logsumexp^2)."""
    torch.manual_seed(0)
    B, T, E, k, pieces = 3, 16, 4, 2, 4
    router = Router(8, E, k)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(B, T, 8)
    route = router(x.view(-1, 8))
    aux, z = sequence_balance_losses(route, B, E)
    f = torch.stack([torch.bincount(e.flatten(), minlength=E) for e in route.experts.view(B, -1)]) / T
    P = route.probs.view(B, T, E).mean(1)
    torch.testing.assert_close(aux, E * (f * P).sum())
    torch.testing.assert_close(z, route.logits.logsumexp(-1).square().view(B, T).mean(1).sum())
    whole_grad = torch.autograd.grad(aux + z, router.weight)[0]
    cuts = torch.randperm(T).view(pieces, T // pieces)
    routes = [router(x[:, cut].reshape(-1, 8)) for cut in cuts]
    counts = [torch.zeros(B, E).scatter_add_(1, r.experts.view(B, -1), torch.ones(B, T // pieces * k)) for r in routes]
    shares = [sequence_balance_losses(r, B, E, pieces=pieces, sum_pieces=lambda c: sum(counts)) for r in routes]
    torch.testing.assert_close(sum(a for a, _ in shares), aux)
    torch.testing.assert_close(sum(s for _, s in shares), z)
    share_grad = torch.autograd.grad(sum(a + s for a, s in shares), router.weight)[0]
    torch.testing.assert_close(share_grad, whole_grad)


def _check_moe_layout(corpus, cache_dir, tmp_path, *, compiled: bool = False, **layout) -> dict:
    """check_layout's comparison with the single process (losses of every rank and of metrics.jsonl, final
    weights, the routing biases included and moved), and the MoE figures and gradient norm of every step;
    `compiled`: the layout
    with train.compile, the single process eager. Returns rank 0's result."""
    raw, ref_raw = layout_configs(corpus, cache_dir, tmp_path, **layout)
    raw["train"]["compile"] = compiled
    ref, ref_written = reference_run(ref_raw)
    validate(from_dict(raw))
    prepare_data(from_dict(raw))
    results = run_ranks(from_dict(raw).world_size, _train_counting_graphs, raw, timeout=600)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    state = load_file(tmp_path / "run" / "model" / "model.safetensors")
    for losses in [*(r["losses"] for r in results), [m["loss"] for m in metrics]]:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    assert state.keys() == ref_written["model"].keys()
    for name, value in state.items():
        torch.testing.assert_close(value, ref_written["model"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    for name in (*FIGURES, "grad_norm"):  # the norm: the mlp's gradients summed over tp under sp, counted once
        torch.testing.assert_close(torch.tensor([m[name] for m in metrics]),
                                   torch.tensor([m[name] for m in ref_written["metrics"]]), rtol=1e-5, atol=1e-7,
                                   msg=name)
    assert metrics[0]["moe_aux_loss"] > 0 and metrics[0]["moe_z_loss"] > 0
    biases = [v for k, v in state.items() if k.endswith("gate.e_score_correction_bias")]
    assert biases and any(b.abs().max() > 0 for b in biases)  # moved (a layer's may come back to 0 by chance)
    return results[0]


def _train_counting_graphs(raw: dict) -> dict:
    from torch._dynamo.utils import counters

    return {**train_rank(raw), "graphs": counters["stats"]["unique_graphs"]}


def test_cp2_tp2_sp_ep2_trains_like_one_process(corpus, cache_dir, tmp_path):
    """cp2 tp2 with sp, ep2 (4 ranks): attention split over tp, each MoE layer whole on both tp ranks, which route
    their own pieces of the sequence (each sequence's counts summed over the cp x tp ranks, the mlp's gradients
    summed over tp), its experts split over the ep group of each tp coordinate; the auxiliary loss, z-loss and
    the aux-loss-free bias on, Qwen3-MoE's q/k norms (summed over tp always) too. dp2 tp2 sp ep2 passed the same
    check when written."""
    _check_moe_layout(corpus, cache_dir, tmp_path, model=EP_MODEL,
                      parallel={"cp": 2, "tp": 2, "sp": True, "ep": 2})


def test_dp2_cp2_ep4_mixtral_trains_like_one_process(corpus, cache_dir, tmp_path):
    """Mixtral, dp2 cp2 with ring attention (zigzag), each layer's 4 experts one per rank over all 4 ranks: every
    rank routes its pieces of 1 sequence, counts summed over cp, shares scaled by cp (moe_balance.py says why);
    under full recomputation, whose replayed forwards sum the counts over cp again."""
    _check_moe_layout(corpus, cache_dir, tmp_path, model={**EP_MODEL, "model_type": "mixtral"},
                      parallel={"dp": 2, "cp": 2, "ep": 4}, train={"recompute": "full"})


def test_cp2_ep2_ulysses_trains_like_one_process(corpus, cache_dir, tmp_path):
    """cp2 with Ulysses' all-to-all attention, the experts over the same 2 ranks (ep2 out of cp2)."""
    _check_moe_layout(corpus, cache_dir, tmp_path, model=EP_MODEL,
                      parallel={"cp": 2, "ep": 2, "cp_impl": "ulysses"})


@pytest.mark.skipif(compile_problem("cpu") is not None, reason=str(compile_problem("cpu")))
def test_tp2_compiled_trains_like_the_eager_single_process(corpus, cache_dir, tmp_path, monkeypatch):
    """tp2 without sp, every decoder layer compiled: each tp rank runs the whole MoE layer on the same tokens, the
    dispatch (host reads of the counts) eager between compiled pieces; against the eager single process."""
    # Dynamo's tracing, the graph breaks around the dispatch and AOT autograd are what an MoE layer adds;
    # Inductor's kernels for the same matmuls and norms are test_compile.py's (C++ for each graph: 15-20 s here)
    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    results = _check_moe_layout(corpus, cache_dir, tmp_path, model=EP_MODEL, compiled=True,
                                parallel={"tp": 2}, train={"steps": 4})
    assert results["graphs"] >= 1  # Dynamo really compiled


EP_REFUSED = [  # (model, parallel, the start of the one-line error)
    ({}, {"dp": 2, "ep": 2}, "parallel.ep=2 splits the experts of an MoE model, and model_type=llama has none"),
    (MOE, {"dp": 3, "ep": 2}, "parallel.ep=2 must divide dp*cp = 3*1 = 3"),
    ({**MOE, "num_experts": 6}, {"dp": 4, "ep": 4}, "parallel.ep=4 must divide model.num_experts=6"),
    (MOE, {"dp": 4, "ep": 4, "zero": 1, "dp_shard": 2}, "parallel.dp_shard=2 with ep=4: ep must divide dp_shard"),
]


@pytest.mark.parametrize("model, parallel, error", EP_REFUSED)
def test_expert_parallel_layouts_not_supported_are_refused(corpus, cache_dir, tmp_path, model, parallel, error):
    cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path, model=model, parallel=parallel))
    with pytest.raises(ConfigError, match="^" + re.escape(error)):
        validate(cfg)


EP_MODEL = {**MOE, "router_z_loss_coef": 1e-3, "moe_bias_update_rate": 1e-2, "router_aux_loss_coef": 0.01}


def test_ep2_trains_like_one_process_and_resumes_in_one(corpus, cache_dir, tmp_path):
    """dp2 ep2 (each rank holds 2 of the 4 experts; tokens exchanged by all-to-all): losses, weights (the routing
    biases, moved by the aux-loss-free balancing, included) equal to the single process; its checkpoint of step 3
    (expert tensors saved whole) resumes in one process with the losses and weights of the single process. dp4 ep4
    and dp2 pp2 ep2 with 1f1b and afab passed the same check when written (each 4 ranks, 2-3 s more)."""
    layout = dict(model=EP_MODEL, train={"recompute": "full"}, parallel={"dp": 2, "ep": 2})
    _, written = check_layout(corpus, cache_dir, tmp_path, checkpoint={"save_every": 3}, logging={"timers": True},
                              **layout)
    assert all(m["time_ep_s"] > 0 for m in written["metrics"])  # the all-to-all's waits, timed as their own axis
    _assert_resumes_in_one_process(layout_configs(corpus, cache_dir, tmp_path, **layout)[1], tmp_path, step=3)


def _assert_resumes_in_one_process(ref_raw: dict, tmp_path, *, step: int) -> None:
    """The layout's checkpoint of `step` (tmp_path/run), resumed by the single process `ref_raw`, trains the
    reference's remaining steps: the same losses and final weights."""
    ref, ref_written = reference_run(ref_raw)
    resumed = {**ref_raw, "out": str(tmp_path / "resumed"),
               "checkpoint": {"resume": str(tmp_path / "run" / "checkpoints" / f"step_{step}")}}
    (got,), written = run_parallel(resumed)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][step:]), rtol=LOSS_RTOL,
                               atol=0)
    for name, value in written["model"].items():
        torch.testing.assert_close(value, ref_written["model"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_ep2_in_bf16_tracks_the_fp32_single_process(corpus, cache_dir, tmp_path):
    """dp2 ep2 in bf16 (the experts by the CPU's bf16 grouped matmul, the tokens exchanged in bf16, the router's
    softmax in fp32) against the fp32 single process: within 1% a step, as test_mixed_precision.py's dense
    layouts (bf16 rounds each parameter by up to 2^-9 relative; the fp32 masters keep the updates)."""
    layout = dict(model=EP_MODEL, train={"recompute": "full"}, parallel={"dp": 2, "ep": 2})
    fp32, _ = reference_run(layout_configs(corpus, cache_dir, tmp_path, **layout)[1])  # test_ep2_trains_...'s
    bf16 = {**layout, "train": {**layout["train"], "dtype": "bfloat16"}}
    results, _ = run_parallel(layout_configs(corpus, cache_dir, tmp_path, **bf16)[0])
    for result in results:
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(fp32["losses"]), rtol=0.01, atol=0)
        assert not torch.equal(losses, torch.tensor(fp32["losses"]))  # bf16 really ran


def test_ep2_zero1_on_4_ranks_trains_like_one_process(corpus, cache_dir, tmp_path):
    """dp4 ep2 ZeRO-1: the expert shards' gradients averaged (and their optimizer state sharded) over the 2 ranks
    holding the same experts, the others' over all 4; the global norm clipping counts each element once. Its last
    step's checkpoint, written in the background by all 4 ranks (each expert tensor's ZeRO pieces sent within
    their edp group to the writer's ep group, gathered over ep on the checkpoint's own groups), holds the weights
    of OUT/model exactly, with the checksums it lists."""
    _, written = check_layout(corpus, cache_dir, tmp_path, model=EP_MODEL, parallel={"dp": 4, "ep": 2, "zero": 1},
                              train={"recompute": "full"}, checkpoint={"save_every": STEPS, "async_save": True})
    assert all(m["grad_norm"] > 1.0 for m in written["metrics"])  # so train.grad_clip=1 clips every step
    folder = tmp_path / "run" / "checkpoints" / f"step_{STEPS}"
    assert verify_tensors(folder) == []
    saved = load_model(folder).state_dict()  # both folders as tetron's tensors (their files hold experts one by one)
    for name, value in load_model(tmp_path / "run" / "model").state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)


def test_ep2_pp2_interleaved_trains_like_one_process(corpus, cache_dir, tmp_path):
    """Each pipeline stage's MoE layers exchange tokens within the stage's ep group, in the schedule's order."""
    check_layout(corpus, cache_dir, tmp_path, model=EP_MODEL, train={"recompute": "full"},
                 parallel={"dp": 2, "pp": 2, "ep": 2, "pp_schedule": "interleaved", "pp_virtual": 2})


EP_STEPS = STEPS  # the composed layouts below: enough steps to show each equal to the single process


def _ep_layout(**layout) -> dict:
    """check_layout's keywords for a composed ep layout: EP_MODEL unless `model`, EP_STEPS steps, full recomputation
    unless `train` says otherwise; global batches of 8 sequences (dp * micro_batch * grad_acc), so that the layouts
    of the same model share one single-process reference."""
    return {"model": EP_MODEL, **layout, "train": {"steps": EP_STEPS, "recompute": "full", **layout.get("train", {})}}


def _check_ep_layout(corpus, cache_dir, tmp_path, **layout) -> dict:
    """check_layout of _ep_layout(`layout`), and its MoE figures of every step equal to the single process's.
    Returns what it wrote."""
    layout = _ep_layout(**layout)
    extra = {key: layout.pop(key) for key in ("checkpoint", "logging") if key in layout}
    _, written = check_layout(corpus, cache_dir, tmp_path, **layout, **extra)
    ref = reference_run(layout_configs(corpus, cache_dir, tmp_path, **layout)[1])[1]["metrics"]
    for name in FIGURES:
        torch.testing.assert_close(torch.tensor([m[name] for m in written["metrics"]]),
                                   torch.tensor([m[name] for m in ref]), rtol=1e-5, atol=1e-7, msg=name)
    assert ref[0]["moe_aux_loss"] > 0
    return written


def test_ep2_zero3_on_4_ranks_trains_like_one_process_and_resumes_in_one(corpus, cache_dir, tmp_path):
    """dp4 ep2 ZeRO-3 (full recomputation, 2 micro-batches): the expert shards' parameters, gradients and AdamW
    state sharded over the 2 ranks holding the same experts (gathered there per unit, reduce-scattered there
    every micro-batch), the rest over all 4; its checkpoint of step 2, written from those pieces, resumes in one
    process with the single process's losses and weights."""
    layout = dict(parallel={"dp": 4, "ep": 2, "zero": 3})
    _check_ep_layout(corpus, cache_dir, tmp_path, checkpoint={"save_every": 2}, **layout)
    _assert_resumes_in_one_process(layout_configs(corpus, cache_dir, tmp_path, **_ep_layout(**layout))[1], tmp_path,
                                   step=2)


def test_ep2_zero2_hsdp_trains_like_one_process(corpus, cache_dir, tmp_path):
    """dp8 ep2 ZeRO-2 with HSDP dp_shard=4: each shard group of 4 holds two ep groups; the expert shards are
    sharded over the 2 ranks of it holding the same experts, the rest over all 4, and both averaged across the 2
    replicas; clipping (summed over the shard group) is active on every step. Its last checkpoint, written in the
    background (expert pieces from the writer's shard group), holds the weights of OUT/model exactly. dp4 ep2
    dp_shard=2 (expert shards on one rank of their shard group: left whole, reduced once a step) and dp8 ep2
    dp_shard=4 with ZeRO-3 passed the same check when written."""
    written = _check_ep_layout(corpus, cache_dir, tmp_path, parallel={"dp": 8, "ep": 2, "zero": 2, "dp_shard": 4},
                               grad_acc=1, checkpoint={"save_every": EP_STEPS, "async_save": True})
    assert all(m["grad_norm"] > 1.0 for m in written["metrics"])  # so train.grad_clip=1 clips every step
    folder = tmp_path / "run" / "checkpoints" / f"step_{EP_STEPS}"
    assert verify_tensors(folder) == []
    saved = load_model(folder).state_dict()  # both folders as tetron's tensors (their files hold experts one by one)
    for name, value in load_model(tmp_path / "run" / "model").state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("schedule", [{"pp_schedule": "zbv", "pp_virtual": 2, "zero": 3},
                                      {"pp_schedule": "1f1b", "zero": 2}])
def test_ep2_pp2_zero_bubble_trains_like_one_process(corpus, cache_dir, tmp_path, schedule):
    """dp2 pp2 ep2: under zbv the all-to-alls' backward runs in B (they lie on the input's path) and the expert
    weights' gradients in W, divided by ep once as they are reduced; ZeRO-3 frees the expert units after B too.
    1f1b with ZeRO-2 alongside (edp is one rank: the expert buckets stay whole through the per-micro-batch
    reduce-scatters of the rest). zbh1 passed the same check when written."""
    _check_ep_layout(corpus, cache_dir, tmp_path, parallel={"dp": 2, "pp": 2, "ep": 2, **schedule}, micro_batch=2)


def test_ep4_qwen3_moe_shape_trains_like_one_process(corpus, cache_dir, tmp_path):
    """dp4 ep4 with ZeRO-2 accumulating whole buffers: 8 experts, 2 a rank, top-4 with renormalized weights and
    the auxiliary loss (Qwen3-MoE's routing); each rank alone holds its experts, so they are not sharded."""
    model = {**MOE, "num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
             "router_aux_loss_coef": 0.01}
    _check_ep_layout(corpus, cache_dir, tmp_path, model=model, train={"recompute": "none"},
                     parallel={"dp": 4, "ep": 4, "zero": 2, "zero_accumulate": "full"})
