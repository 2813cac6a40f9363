"""Muon (tetron/optim/muon.py): in one process equal to torch.optim.Muon on the hidden matrices (each expert's on its
own) plus torch's AdamW on the rest; its settings checked before start; in every layout equal to one process."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tetron.checkpoint.check import inspect_checkpoint, verify_tensors
from tetron.config import OptimConfig, from_dict
from tetron.errors import ConfigError
from tetron.mesh import Mesh
from tetron.models.qwen3_moe import MoeConfig
from tetron.models.spec import spec_of
from tetron.optim import Muon, Param
from tetron.parallel.data_parallel import owners
from tetron.parallel.parallelize import build_optimizer, parallelize, param_roles
from tetron.plan.dry_run import simulate_rank
from tetron.validate import validate

from conftest import LAYOUT_LR, LOSS_RTOL, WEIGHT_ATOL, check_layout, run_training, tiny_config
from harness import run_ranks

MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
GPT_OSS = {"model_type": "gpt_oss", "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16, "head_dim": 8}
STEPS = 4
RTOL = 1e-6  # relative, fp32: the same ops in the same order as torch's, so in practice bit-equal


def _moe_model() -> torch.nn.Module:
    cfg = MoeConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, num_experts=3, num_experts_per_tok=2,
                    moe_intermediate_size=24, max_position_embeddings=32)
    torch.manual_seed(0)
    model = spec_of(cfg).model_class(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("settings", [
    OptimConfig(name="muon"),
    OptimConfig(name="muon", muon_nesterov=False, muon_adjust_lr="original", muon_momentum=0.9, muon_ns_steps=3,
                muon_ns_coefficients=[3.0, -3.2, 1.2], muon_eps=1e-6),
], ids=["defaults", "other-settings"])
def test_muon_equals_torch_in_one_process(corpus, cache_dir, tmp_path, settings):
    """An MoE model's parameters, roles from its plan: several steps (lr changing between them) of tetron's Muon
    against torch.optim.Muon on each 2-D matrix and each expert's matrix of the fused [E, rows, cols] tensors, and
    torch.optim.AdamW (the same lr, betas, eps; weight decay on the embedding, head and router, not on vectors)."""
    train = from_dict(tiny_config(corpus, cache_dir, tmp_path, train={"lr": 3e-2, "weight_decay": 0.1})).train
    model = _moe_model()
    roles = param_roles([model])
    named = dict(model.named_parameters())
    kinds = {n: roles[id(p)] for n, p in named.items()}
    assert kinds["model.layers.0.mlp.gate.weight"] == "router"
    assert kinds["model.layers.0.mlp.experts.gate_up_proj"] == kinds["model.layers.0.self_attn.q_proj.weight"] \
        == "matrix"
    assert kinds["model.embed_tokens.weight"] == "embedding" and kinds["lm_head.weight"] == "head"
    ours = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named.items()}
    muon = Muon([Param(ours[n], kinds[n], p.shape) for n, p in named.items()], train, settings)

    # the reference: one torch parameter per 2-D matrix (an expert tensor's E matrices apart)
    ref = {(n, e): torch.nn.Parameter(m.detach().clone())
           for n, p in named.items() if kinds[n] == "matrix" for e, m in enumerate(p.reshape(-1, *p.shape[-2:]))}
    rest = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named.items() if kinds[n] != "matrix"}
    torch_muon = torch.optim.Muon(list(ref.values()), lr=train.lr, weight_decay=train.weight_decay,
                                  momentum=settings.muon_momentum, nesterov=settings.muon_nesterov,
                                  ns_coefficients=tuple(settings.muon_ns_coefficients), eps=settings.muon_eps,
                                  ns_steps=settings.muon_ns_steps, adjust_lr_fn=settings.muon_adjust_lr)
    torch_adamw = torch.optim.AdamW(
        [{"params": [p for n, p in rest.items() if kinds[n] != "vector"], "weight_decay": train.weight_decay},
         {"params": [p for n, p in rest.items() if kinds[n] == "vector"], "weight_decay": 0.0}],
        lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, fused=True)  # as tetron's AdamW
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        lr = train.lr * (1 - step / STEPS)
        muon.set_lr(lr)
        for group in (*torch_muon.param_groups, *torch_adamw.param_groups):
            group["lr"] = lr
        for n, p in ours.items():
            p.grad = torch.randn(p.shape, generator=gen)
            if kinds[n] == "matrix":
                for e, g in enumerate(p.grad.reshape(-1, *p.shape[-2:])):
                    ref[(n, e)].grad = g.clone()
            else:
                rest[n].grad = p.grad.clone()
        if step == 2:  # a step whose gradients are not finite, skipped on the device's word: nothing changes
            before = {n: (p.detach().clone(), *(muon.state_tensor(p, k).clone() for k in muon.state_names(kinds[n])))
                      for n, p in ours.items()}
            grads = {n: p.grad for n, p in ours.items()}
            for p in ours.values():
                p.grad = torch.full_like(p, float("nan"))
            muon.step(torch.ones(()))
            for n, p in ours.items():
                after = (p.detach(), *(muon.state_tensor(p, k) for k in muon.state_names(kinds[n])))
                assert all(torch.equal(a, b) for a, b in zip(after, before[n])), n
                p.grad = grads[n]
        muon.step(torch.zeros(()) if step % 2 else None)  # the loop's path (found_inf on the device) and torch's
        torch_muon.step()
        torch_adamw.step()
    for n, p in ours.items():
        expected = (torch.stack([ref[(n, e)].detach() for e in range(p.reshape(-1, *p.shape[-2:]).shape[0])])
                    .view_as(p) if kinds[n] == "matrix" else rest[n].detach())
        torch.testing.assert_close(p.detach(), expected, rtol=RTOL, atol=0, msg=n)
        assert not torch.equal(p.detach(), named[n].detach()), n  # it moved
    for n, p in ours.items():
        if kinds[n] == "matrix":
            buf = muon.state_tensor(p, "momentum_buffer")
            want = torch.stack([torch_muon.state[ref[(n, e)]]["momentum_buffer"]
                                for e in range(buf.reshape(-1, *p.shape[-2:]).shape[0])]).view_as(p)
            torch.testing.assert_close(buf, want, rtol=RTOL, atol=0, msg=n)


@pytest.mark.parametrize("optim, line", [
    ({"muon_momentum": 1.0}, "optim.muon_momentum=1.0 must be in [0, 1) (Muon's default: 0.95)"),
    ({"muon_ns_steps": 0}, "optim.muon_ns_steps=0 must be 1 to 99 (Muon's default: 5)"),
    ({"muon_ns_coefficients": [1.0, 2.0]}, "optim.muon_ns_coefficients=[1.0, 2.0] must be three finite numbers a, b, "
                                           "c (default: [3.4445, -4.775, 2.0315])"),
    ({"muon_eps": 0.0}, "optim.muon_eps=0.0 must be > 0 (default: 1e-7)"),
])
def test_bad_muon_settings_are_one_line(corpus, cache_dir, tmp_path, optim, line):
    raw = tiny_config(corpus, cache_dir, tmp_path, optim={"name": "muon", **optim})
    with pytest.raises(ConfigError) as err:
        validate(from_dict(raw))
    assert str(err.value) == line


def test_adjust_lr_is_one_of_two(corpus, cache_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^optim.muon_adjust_lr='rms': use "):
        from_dict(tiny_config(corpus, cache_dir, tmp_path, optim={"name": "muon", "muon_adjust_lr": "rms"}))


# Layouts reduce gradients in other orders (fp32 rounding); bf16's rounding of the iteration turns those into
# differences of ~5e-5 in the weights after 4 steps (dp2 ZeRO-1, measured), fp32's keep them under 1e-8.
FP32_NS = {"name": "muon", "muon_ns_dtype": "float32"}
SMALL = {"num_hidden_layers": 2}  # hidden 32, 2 layers (check_layout's GQA model otherwise)
LAYOUTS = {  # (parallel, model, train): weights after the steps equal one process, fp32
    "dp2-zero1": ({"dp": 2, "zero": 1}, SMALL, {}),
    "dp2-zero2-small-buckets": ({"dp": 2, "zero": 2, "bucket_mb": 0.01}, SMALL, {}),  # AdamW's pieces straddle
    "dp2-zero3": ({"dp": 2, "zero": 3}, SMALL, {}),
    "dp4-zero2-hsdp2": ({"dp": 4, "zero": 2, "dp_shard": 2}, SMALL, {}),
    "tp2-sp": ({"tp": 2, "sp": True}, SMALL, {}),
    "pp2-zbv": ({"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}, {"num_hidden_layers": 4}, {}),
    "cp2-recompute": ({"cp": 2}, SMALL, {"recompute": "full"}),
    "dp2-ep2-zero1": ({"dp": 2, "ep": 2, "zero": 1}, {**MOE, **SMALL}, {}),
    # experts with [E, D] biases: AdamW's vectors, one per expert (as one [E, D] matrix, ep cut what NS orthogonalised)
    "dp2-ep2-gpt-oss": ({"dp": 2, "ep": 2}, {**GPT_OSS, **SMALL}, {}),
    "dp2-tp2-pp2-zero1": ({"dp": 2, "tp": 2, "pp": 2, "zero": 1}, SMALL, {}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_muon_in_every_layout(corpus, cache_dir, tmp_path, name):
    """Muon's matrices whole in every layout: on an owner rank under ZeRO and HSDP, gathered over tp where tensor
    parallelism cuts them (column- and row-parallel), on the rank holding each expert; per-step losses and the
    final weights equal the single process (check_layout's tolerances: 1e-5)."""
    parallel, model, train = LAYOUTS[name]
    check_layout(corpus, cache_dir, tmp_path, parallel=parallel, model=model, train=train, optim=FP32_NS)


@pytest.mark.parametrize("saved, loaded", [({"dp": 2, "tp": 2, "zero": 1}, {"dp": 2, "ep": 2, "zero": 3})],
                         ids=["dp2-tp2-zero1 -> dp2-ep2-zero3"])
def test_muon_checkpoint_resumes_in_another_layout(corpus, cache_dir, tmp_path, saved, loaded):
    """An MoE model's Muon state saved under its own names (momentum_buffer of each matrix, tp's parts put
    together; exp_avg and exp_avg_sq of the embedding, head, norms and routers), `tetron check` reads it, and a
    run resumed from it in another layout continues the single process's losses and weights."""
    model = {**MOE, "num_hidden_layers": 2}

    def cfg(out, parallel, **extra):
        dp = parallel.get("dp", 1)
        train = {"steps": 6, "micro_batch": 1, "grad_acc": 4 // dp, "lr": LAYOUT_LR}
        return tiny_config(corpus, cache_dir, tmp_path / out, model=model, train=train, parallel=parallel,
                           optim=FP32_NS, **extra)

    reference = run_training(cfg("ref", {}))
    run_training(cfg("a", saved, checkpoint={"save_every": 3}))
    step3 = tmp_path / "a" / "checkpoints" / "step_3"
    state = inspect_checkpoint(step3)
    assert (state["optimizer"]["name"], state["optimizer"]["state"]) == ("muon", ["momentum_buffer", "exp_avg",
                                                                              "exp_avg_sq"])
    assert verify_tensors(step3) == []
    stored = json.loads((step3 / "optimizer.safetensors.index.json").read_text())["weight_map"]
    kinds = {name.rsplit(".", 1)[1] for name in stored if name.startswith("model.layers.0.self_attn.q_proj")}
    assert kinds == {"momentum_buffer"}
    assert {name.rsplit(".", 1)[1] for name in stored if name.startswith("model.layers.0.mlp.gate.")} == {
        "exp_avg", "exp_avg_sq"}  # the router: AdamW's
    assert "model.layers.0.mlp.experts.down_proj.momentum_buffer" in stored
    with pytest.raises(ConfigError, match=r"^optim.name=adamw: .*step_3 holds the state of optim.name=muon; use "
                                          r"optim.name=muon to continue it, or --checkpoint.new_optimizer"):
        validate(from_dict({**cfg("c", loaded, checkpoint={"resume": str(step3)}), "optim": {"name": "adamw"}}))
    after = run_training(cfg("b", loaded, checkpoint={"resume": str(step3)}))
    torch.testing.assert_close(torch.tensor(after), torch.tensor(reference[3:]), rtol=LOSS_RTOL, atol=0)
    final, ref_final = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("b", "ref"))
    for name, value in final.items():
        torch.testing.assert_close(value, ref_final[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_bf16_parameters_keep_fp32_momentum(corpus, cache_dir, tmp_path):
    """bf16 parameters under dp2 ZeRO-1: Muon updates the fp32 masters, its momentum is fp32 (in the checkpoint
    too), and the losses track the fp32 run's (test_mixed_precision's 1%)."""
    def raw(out, parallel, dtype):
        train = {"steps": 6, "micro_batch": 1, "grad_acc": 4 // parallel.get("dp", 1), "lr": 3e-3, "dtype": dtype}
        return tiny_config(corpus, cache_dir, tmp_path / out, model=SMALL, parallel=parallel, train=train,
                           optim=FP32_NS)

    fp32 = torch.tensor(run_training(raw("fp32", {}, "float32")))
    bf16 = torch.tensor(run_training(raw("bf16", {"dp": 2, "zero": 1}, "bfloat16")))
    torch.testing.assert_close(bf16, fp32, rtol=0.01, atol=0)
    assert not torch.equal(bf16, fp32) and fp32[-1] < fp32[0] - 0.3  # bf16 ran, and there was a curve to track
    with open(tmp_path / "bf16" / "checkpoints" / "step_6" / "optimizer.safetensors.index.json") as f:
        stored = json.load(f)["weight_map"]
    name = "model.layers.1.mlp.down_proj.weight.momentum_buffer"
    tensors = load_file(tmp_path / "bf16" / "checkpoints" / "step_6" / stored[name])
    assert tensors[name].dtype == torch.float32 and tensors[name].abs().sum() > 0


def _buckets(raw: dict) -> list[tuple[set[str], int, int, int]]:
    """(roles, elements, padded size, the most pieces of one parameter) of each data-parallel bucket."""
    cfg = from_dict(raw)
    mesh = Mesh(dp=2)
    model = parallelize(cfg, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg, mesh)
    roles = param_roles(model.chunks)
    return [({roles[id(p)] for p in b.params}, sum(p.numel() for p in b.params), b.padded,
             max(len(optimizer.piece_ranges(p)) for p in b.params)) for b in optimizer.buckets]


def test_one_matrix_buckets_go_round_the_owners():
    """Buckets of one whole matrix each (a big model's, or small buckets) are owned in turn, by size: each rank
    orthogonalises its share (the tie went to rank 0 every time: it ran every Newton-Schulz), and a bucket of
    several still balances its own slices first."""
    loads = [0, 0]
    assert [owners([n], 2, loads)[0] for n in (100, 100, 60, 60, 40)] == [0, 1, 0, 1, 0]
    assert loads == [200, 160]
    assert owners([50, 30, 20], 2, loads) == [1, 0, 0]  # its slices 50 and 50; the first to the one owning less
    assert loads == [250, 210]


def test_zero_keeps_only_the_matrices_whole(corpus, cache_dir, tmp_path):
    """Under ZeRO, Muon's matrices lie whole on one rank, in buckets of their own; AdamW's parameters are cut
    where the slices fall, as under optim.name=adamw (padding under one element per slice), so the embedding does
    not pad every slice to its size (bench/optimizer.py: dp8 ZeRO-1 on the 135M shape moves 1.02x AdamW's bytes,
    where keeping every parameter whole moved 2.47x)."""
    raw = tiny_config(corpus, cache_dir, tmp_path, optim=FP32_NS, parallel={"dp": 2, "zero": 1})
    buckets = run_ranks(2, _buckets, raw)[0]
    assert sorted(roles for roles, *_ in buckets) == [{"embedding", "head", "vector"}, {"matrix"}]
    for roles, numel, padded, pieces in buckets:
        if roles == {"matrix"}:
            assert pieces == 1 and padded >= numel  # whole, on one rank each, the slices padded to the fullest
        else:
            assert padded - numel < 2 and pieces == 2  # cut anywhere: the parameter at the cut on both ranks


def test_dry_run_steps_muon_on_fake_tensors(monkeypatch):
    """The dry run (plan/dry_run.py) takes Muon's step on fake tensors, tp's gathers included, with the same peak
    memory, FLOPs and collective bytes as the same step on real ones (test_dry_run.py's reference): its skip of a
    non-finite step never reads a value on the host."""
    cfg = from_dict({"model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
                     "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": 32},
                     "train": {"steps": 2, "micro_batch": 2, "grad_acc": 2, "seed": 1}, "optim": {"name": "muon"},
                     "parallel": {"dp": 2, "tp": 2, "pp": 2, "zero": 1}, "out": "unused"})
    fake, real = simulate_rank(cfg, 0), simulate_rank(cfg, 0, fake=False)
    assert fake.peak_bytes == real.peak_bytes > 0
    assert fake.flops == real.flops > 0
    assert fake.collective_bytes == real.collective_bytes
