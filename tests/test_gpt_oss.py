"""gpt-oss (models/gpt_oss.py) against transformers' GptOssForCausalLM on the same weights: YaRN's cos/sin, the MoE
block (biased router, transposed interleaved experts with biases, the clamped SwiGLU) forward and backward, the
model's logits and gradients (fp32, 1e-5), its folders in and out (the MXFP4 release refused in one line), step 1's
loss from a transformers-saved folder equal to transformers' own, generation's KV cache with sinks and windows,
and the layouts of issue 35 each equal to the single process."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss

from tetron.checkpoint.load import load_model
from tetron.checkpoint.save import save_model
from tetron.config import from_dict
from tetron.models import config_from_hf
from tetron.models.blocks import ClampedSwiGLU
from tetron.models.gpt_oss import GptOssConfig
from tetron.models.llama import rope_cos_sin
from tetron.models.moe import Experts, MoEBlock
from tetron.models.qwen3_moe import MoeForCausalLM
from tetron.observe.generate import kv_cache
from tetron.parallel.init import seeded_model

from conftest import check_layout, first_batch_loss, run_training, tiny_config

TOL = dict(atol=1e-5, rtol=1e-5)
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, sliding_window=5,
            max_position_embeddings=64)


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights of O(1) effect: norms near 1, everything else (biases, sinks, router bias) N(0, 0.2)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.2)


def _hf(cfg: GptOssConfig) -> transformers.GptOssForCausalLM:
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(hf_cfg).eval()
    _randomize(model)
    return model


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_cos_sin_equal_transformers_bitwise(truncate):
    """YaRN's blended frequencies and its attention factor on cos and sin, as GptOssRotaryEmbedding computes them."""
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    hf_cfg = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2,
                                       rope_parameters=dict(rope))
    rotary = modeling_gpt_oss.GptOssRotaryEmbedding(hf_cfg)
    assert rotary.attention_scaling > 1.3  # the factor is on
    cfg = GptOssConfig(**{**TINY, "hidden_size": 64, "head_dim": 16}, rope_scaling=rope, rope_theta=150000.0)
    pos = torch.arange(0, 9000, 29)[None]  # past the original 4096
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rope_cos_sin(cfg, pos, dtype=dtype)
        want_cos, want_sin = rotary(torch.zeros(1, dtype=dtype), pos)
        assert torch.equal(cos[..., :8], want_cos) and torch.equal(cos[..., 8:], want_cos)  # halves: rotate_half's
        assert torch.equal(sin[..., :8], want_sin)


def _gpt_oss_block():
    """transformers' GptOssMLP and tetron's MoEBlock with gpt-oss's options, the same weights."""
    hf_cfg = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                                       num_experts_per_tok=2, swiglu_limit=0.6)
    hf = modeling_gpt_oss.GptOssMLP(hf_cfg)
    _randomize(hf)
    experts = Experts(4, 32, 16, transposed=True, interleaved=True, bias=True, glu=ClampedSwiGLU(1.702, 0.6))
    ours = MoEBlock(32, 16, 4, 2, experts=experts, router_name="router", bias=True)
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("path", ["loop", "grouped"])
def test_the_block_equals_gpt_oss_mlp(path, monkeypatch):
    """The output, the input's gradient and every weight's (the biases' and the router bias' too) within 1e-5, on
    the loop over experts and on the grouped matmul; a limit the projections reach, so the clamp counts."""
    from tetron.models import experts

    if path == "loop":
        monkeypatch.setattr(experts, "grouped_mm_supported", lambda *a: False)
    elif not experts.grouped_mm_available("cpu"):
        pytest.skip("no grouped matmul on this CPU build")
    hf, ours = _gpt_oss_block()
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_ours = x.detach().clone().requires_grad_()
    expected, got = hf(x)[0], ours(x_ours)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    cotangent = torch.randn_like(got)
    (expected * cotangent).sum().backward()
    (got * cotangent).sum().backward()
    torch.testing.assert_close(x_ours.grad, x.grad, **TOL)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours.get_parameter(name).grad, p.grad, **TOL, msg=name)
    with torch.no_grad():  # the limit changes the output: the comparison above could fail
        ours.experts.glu = ClampedSwiGLU(1.702, 100.0)
        assert (ours(x) - expected).abs().max() > 1e-3


def test_the_aligned_grouped_path_adds_each_experts_biases():
    """CUDA's grouped path (each expert's rows moved to a multiple of 8 in a padded buffer, its biases added by the
    buffer's groups), run here on the CPU's kernel: equal to the loop over experts, output and every gradient; an
    expert with no rows among them."""
    from tetron.models import experts as experts_module

    if not experts_module.grouped_mm_available("cpu"):
        pytest.skip("no grouped matmul on this CPU build")
    torch.manual_seed(5)
    experts = Experts(4, 32, 16, transposed=True, interleaved=True, bias=True, glu=ClampedSwiGLU(1.702, 0.6))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    counts = torch.tensor([5, 0, 11, 3])
    x = torch.randn(int(counts.sum()), 32)
    results = []
    for run in (lambda x: experts.loop(x, counts), lambda x: experts.grouped(x, counts, align=8)):
        x_in = x.clone().requires_grad_()
        out = run(x_in)
        out.backward(torch.ones_like(out) + out.detach())
        results.append([out.detach(), x_in.grad, *(p.grad.clone() for p in experts.parameters())])
        experts.zero_grad()
    for name, got, want in zip(("out", "dx", "gate_up", "down", "gate_up_bias", "down_bias"), *results):
        torch.testing.assert_close(got, want, **TOL, msg=name)


def test_the_model_equals_transformers_forward_and_backward():
    """Logits of sliding (window 5 in 24) and full layers with sinks, biases and YaRN within 1e-5 of transformers'
    eager GptOssForCausalLM; the gradients of every weight too; the same tensor names; the parameter count."""
    cfg = GptOssConfig(**TINY, router_aux_loss_coef=0.0)  # the gradients of the cross entropy alone: transformers
    # adds no balancing loss without output_router_logits (test_moe.py checks tetron's balancing losses)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    hf = _hf(cfg)
    ours = MoeForCausalLM(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    expected, got = hf(ids).logits, ours(ids)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, **TOL)
    targets = torch.randint(0, 64, (2 * 24,), generator=torch.Generator().manual_seed(3))
    for logits in (expected, got):  # the training objective: mean cross entropy
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets).backward()
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours.get_parameter(name).grad, p.grad, **TOL, msg=name)
    with torch.no_grad():  # the windows change the logits
        for layer in ours.model.layers.values():
            layer.self_attn.sliding_window = None
        assert (ours(ids) - expected).abs().max() > 1e-2


def test_folders_in_and_out(tmp_path):
    """transformers' save_pretrained folder is read (config and weights) to equal logits; tetron's folder loads in
    transformers' from_pretrained as GptOssForCausalLM, to equal logits; the hub's MXFP4 folder is refused in one
    line."""
    cfg = GptOssConfig(**TINY)
    hf = _hf(cfg)
    hf.save_pretrained(tmp_path / "hf")
    read = config_from_hf(tmp_path / "hf")
    assert read == cfg, (read, cfg)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
        model = load_model(tmp_path / "hf")
        torch.testing.assert_close(model(ids), expected, **TOL)
    save_model(model, tmp_path / "ours")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(theirs) is transformers.GptOssForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, expected, **TOL)
    hub = json.loads((tmp_path / "hf" / "config.json").read_text())
    hub["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with pytest.raises(ValueError, match=r"^quantization_config: .*MXFP4.*dequantize") as err:
        config_from_hf(hub)
    assert "\n" not in str(err.value)


def test_an_mxfp4_folder_is_one_line_before_any_rank(corpus, cache_dir, tmp_path, capsys):
    """`tetron train --init-from` the hub's MXFP4 release (its config.json's quantization_config): exit 2, one line
    naming the field and what to do, nothing launched."""
    import yaml

    from tetron import cli

    _hf(GptOssConfig(**TINY)).save_pretrained(tmp_path / "hub")
    hub = json.loads((tmp_path / "hub" / "config.json").read_text())
    hub["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "hub" / "config.json").write_text(json.dumps(hub))
    raw = tiny_config(corpus, cache_dir, tmp_path / "run")
    del raw["model"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()  # save_pretrained's progress
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "launch", lambda cfg: pytest.fail("launched"))
        code = cli.main(["train", str(tmp_path / "run.yaml"), "--init-from", str(tmp_path / "hub")])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("tetron: error: "), lines
    assert "quantization_config" in lines[0] and "MXFP4" in lines[0] and "dequantize" in lines[0]


def test_init_as_transformers(tmp_path):
    """GptOssPreTrainedModel._init_weights' choices: router weight and bias drawn, experts' biases zeros, sinks
    drawn, attention biases zeros, norms ones."""
    weights = dict(seeded_model(GptOssConfig(**TINY), seed=1, device=torch.device("cpu")).named_parameters())
    layer = "model.layers.1."
    for name in ("mlp.router.weight", "mlp.router.bias", "self_attn.sinks", "mlp.experts.gate_up_proj",
                 "mlp.experts.down_proj", "self_attn.q_proj.weight"):
        assert 0.01 < weights[layer + name].std() < 0.03, name
    for name in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "self_attn.o_proj.bias"):
        assert not weights[layer + name].any(), name
    assert torch.equal(weights[layer + "input_layernorm.weight"], torch.ones(32))


def test_kv_cache_keeps_sinks_and_windows():
    """Generation (observe/generate.py, `tetron generate` and the end-of-run sample): token by token through the
    KV cache, each new token's logits equal the whole sequence's forward pass (windows of 3 in 10, sinks)."""
    model = MoeForCausalLM(GptOssConfig(**{**TINY, "sliding_window": 3})).eval()
    _randomize(model)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids)[0]
        with kv_cache(model):
            steps = [model(ids[:, :3])[0, -1]]
            steps += [model(ids[:, t:t + 1], torch.tensor([t]))[0, -1] for t in range(3, 10)]
    torch.testing.assert_close(torch.stack(steps), full[2:], **TOL)


def test_step_one_loss_from_a_transformers_folder(corpus, cache_dir, tmp_path):
    """`--init-from` a folder written by transformers' save_pretrained: step 1's loss is transformers' own cross
    entropy on the same batch (pp2: a sliding and a full layer on each stage)."""
    cfg = GptOssConfig(**{**TINY, "vocab_size": 256, "num_hidden_layers": 4})
    hf = _hf(cfg)
    hf.save_pretrained(tmp_path / "hf")
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 1, "micro_batch": 1, "grad_acc": 2},
                      parallel={"pp": 2}, checkpoint={"init_from": str(tmp_path / "hf")})
    del raw["model"]  # the model comes from the folder
    assert type(from_dict(raw).model) is GptOssConfig
    (loss,) = run_training(raw)
    expected = first_batch_loss(raw, hf)
    assert abs(loss - float(expected)) <= 1e-5 * abs(float(expected))


# ----------------------------------------------------------------------------- every layout of issue 35

# 4 layers, sliding (window 5 in sequences of 32) and full alternating, 4 experts top-2 of width 32, the
# balancing loss and z-loss on; global batches of 4 sequences in every layout, so one single-process reference
MODEL = {"model_type": "gpt_oss", "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
         "head_dim": 8, "sliding_window": 5, "router_aux_loss_coef": 0.01, "router_z_loss_coef": 1e-3}
LAYOUTS = {  # (parallel, micro_batch)
    "dp2": ({"dp": 2}, 1),
    "tp2-sp": ({"tp": 2, "sp": True}, 2),
    "pp2-zbv": ({"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}, 2),
    "cp2-ring": ({"cp": 2}, 2),
    "cp2-ulysses": ({"cp": 2, "cp_impl": "ulysses"}, 2),
    "dp2-ep2-zero3": ({"dp": 2, "ep": 2, "zero": 3}, 1),
    "tp2-cp2-ep2": ({"tp": 2, "cp": 2, "ep": 2}, 2),
    # beyond issue 35's list: tp without sp, the 1f1b pipeline, contiguous ring shards under full recomputation,
    # and packed documents masked in Ulysses' attention (windows and sinks within each document)
    "tp2": ({"tp": 2}, 2),
    "pp2-1f1b": ({"pp": 2}, 2),
    "cp2-ring-contiguous-recompute": ({"cp": 2, "cp_layout": "contiguous"}, 2, {"recompute": "full"}),
    "cp2-ulysses-documents": ({"cp": 2, "cp_impl": "ulysses"}, 2, {}, {"mask_documents": True}),
}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A .jsonl of documents of 3 to 60 characters (a 32-byte window packs several) and a token cache for it."""
    from test_documents import write_documents

    folder = tmp_path_factory.mktemp("gpt_oss_documents")
    write_documents(folder / "docs.jsonl", count=1500)
    return folder / "docs.jsonl", folder / "cache"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(corpus, cache_dir, tmp_path, name, request):
    parallel, micro_batch, train, data = (*LAYOUTS[name], {}, {})[:4]
    if data.get("mask_documents"):
        corpus, cache_dir = request.getfixturevalue("short_documents")
    _, written = check_layout(corpus, cache_dir, tmp_path, model=MODEL, micro_batch=micro_batch, train=train,
                              data=data, parallel={**parallel, "bucket_mb": 0.01})
    state = written["model"]
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 64)  # [E, H, 2I], transformers'
    for key in ("self_attn.sinks", "mlp.router.bias", "mlp.experts.gate_up_proj_bias", "self_attn.o_proj.bias"):
        assert state[f"model.layers.1.{key}"].abs().max() > 1e-4, key  # trained (the biases start at 0)


def test_dp2_ep2_zero3_checkpoint_resumes_in_one_process(corpus, cache_dir, tmp_path):
    """dp2 ep2 ZeRO-3's checkpoint of step 2 (the experts and their biases written from their ep shards, the rest
    from ZeRO's pieces) resumed by the single process: its remaining losses and final weights are the single
    process's own."""
    from conftest import LOSS_RTOL, WEIGHT_ATOL, layout_configs, reference_run, run_parallel

    layout = dict(model=MODEL, micro_batch=1, parallel={"dp": 2, "ep": 2, "zero": 3, "bucket_mb": 0.01})
    check_layout(corpus, cache_dir, tmp_path, checkpoint={"save_every": 2}, **layout)
    ref_raw = layout_configs(corpus, cache_dir, tmp_path, **layout)[1]
    ref, ref_written = reference_run(ref_raw)
    resumed = {**ref_raw, "out": str(tmp_path / "resumed"),
               "checkpoint": {"resume": str(tmp_path / "run" / "checkpoints" / "step_2")}}
    (got,), written = run_parallel(resumed)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][2:]), rtol=LOSS_RTOL, atol=0)
    for name, value in written["model"].items():
        torch.testing.assert_close(value, ref_written["model"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_dp2_ep2_in_bf16_tracks_the_fp32_single_process(corpus, cache_dir, tmp_path):
    """dp2 ep2 in bf16 (sinks on the CPU's fused kernel, the experts' biases and clamped SwiGLU in bf16) against
    the fp32 single process: within 1% a step, as test_moe.py's bf16 ep layout."""
    from conftest import layout_configs, reference_run, run_parallel

    layout = dict(model=MODEL, micro_batch=1, parallel={"dp": 2, "ep": 2, "bucket_mb": 0.01})
    fp32, _ = reference_run(layout_configs(corpus, cache_dir, tmp_path, **layout)[1])
    results, _ = run_parallel(layout_configs(corpus, cache_dir, tmp_path, **layout, train={"dtype": "bfloat16"})[0])
    for result in results:
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(fp32["losses"]), rtol=0.01, atol=0)
        assert not torch.equal(losses, torch.tensor(fp32["losses"]))  # bf16 really ran


def test_resuming_checks_the_experts_activation_and_the_windows(tmp_path):
    """The clamped SwiGLU's alpha and limit, and which layers are windowed and how wide, give gpt-oss's weights
    their meaning as rope_theta does: another value in the run is one line naming the field."""
    from tetron.checkpoint.check import compare_models
    from tetron.errors import CheckpointError

    saved = GptOssConfig(**TINY)
    for field, value in (("swiglu_alpha", 1.5), ("swiglu_limit", 5.0), ("sliding_window", 7),
                         ("layer_types", ["full_attention"] * saved.num_hidden_layers)):
        other = dataclasses.replace(saved, **{field: value})
        with pytest.raises(CheckpointError, match=f"model.{field}=.* there, but this run has model.{field}="):
            compare_models(saved, other, tmp_path)
        compare_models(saved, other, tmp_path, settings=False)
