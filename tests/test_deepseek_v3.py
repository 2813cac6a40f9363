"""DeepSeek-V3 (models/deepseek_v3.py) against transformers' DeepseekV3ForCausalLM on the same weights: multi-head
latent attention with and without the query latent, interleaved and halves RoPE, YaRN with its mscale on the
scores, dense first layers then MoE with DeepSeek's routing (sigmoid, correction bias, groups, shared experts); fp32
logits and gradients within 1e-5; folders in and out (step-1 loss from a transformers-saved folder equal to
transformers' own); and issue 34's layouts each equal to the single process (q/k heads 24 wide, v heads 16)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tetron.checkpoint.load import load_model
from tetron.checkpoint.save import save_model
from tetron.config import from_dict
from tetron.models import config_from_hf
from tetron.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from tetron.observe.generate import kv_cache

from conftest import check_layout, first_batch_loss, run_training, tiny_config

TOL = dict(atol=1e-5, rtol=1e-5)
YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, n_group=4, topk_group=2, max_position_embeddings=64)
CASES = {
    "q-latent-interleaved": {},
    "q-proj-halves": {"q_lora_rank": None, "rope_interleave": False},
    "yarn-mscale": {"rope_scaling": YARN},
}


def _config(case: str, **fields) -> DeepseekV3Config:
    return DeepseekV3Config(**{**TINY, **CASES[case], **fields})


def _hf(cfg: DeepseekV3Config) -> transformers.DeepseekV3ForCausalLM:
    """transformers' class from our config's to_hf, weights of O(1) effect (norm gains in [0.5, 1.5], the routing
    correction bias drawn too, so it changes the choice), eval mode."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_the_model_equals_transformers_forward_and_backward(case):
    """Logits within 1e-5 of transformers' eager DeepseekV3ForCausalLM, every weight's gradient of the mean cross
    entropy too; the same tensor names; the parameter count; config.json out and back in."""
    cfg = _config(case)
    assert config_from_hf(cfg.to_hf()) == cfg
    hf = _hf(cfg)
    ours = DeepseekV3ForCausalLM(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    expected, got = hf(ids).logits, ours(ids)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, **TOL)
    targets = torch.randint(0, 64, (2 * 24,), generator=torch.Generator().manual_seed(3))
    for logits in (expected, got):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets).backward()
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours.get_parameter(name).grad, p.grad, **TOL, msg=name)


def test_the_options_change_the_logits():
    """The comparisons above could fail: the interleave, YaRN's mscale on the scores and the correction bias each
    change the logits."""
    cfg = _config("yarn-mscale")
    model = DeepseekV3ForCausalLM(cfg).eval()
    model.load_state_dict(_hf(cfg).state_dict())
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = model(ids)
        other = DeepseekV3ForCausalLM(_config("yarn-mscale", rope_interleave=False)).eval()
        other.load_state_dict(model.state_dict())
        assert (other(ids) - base).abs().max() > 1e-2
        assert cfg.attention_scale() > 1.3 * (16 + 8) ** -0.5
        other = DeepseekV3ForCausalLM(_config("q-latent-interleaved")).eval()  # the same weights, no YaRN
        other.load_state_dict(model.state_dict())
        assert (other(ids) - base).abs().max() > 1e-2
        for layer in list(model.model.layers.values())[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert (model(ids) - base).abs().max() > 1e-2


def test_refusals_are_one_line():
    for fields, match in (({"num_key_value_heads": 2}, "^num_key_value_heads=2: MLA"),
                          ({"scoring_func": "softmax"}, "^scoring_func='softmax'"),
                          ({"qk_rope_head_dim": 7}, "^qk_rope_head_dim=7 must be even"),
                          ({"mlp_only_layers": [0]}, "^mlp_only_layers")):
        with pytest.raises(ValueError, match=match) as err:
            DeepseekV3Config(**{**TINY, **fields})
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^quantization_config: .*FP8.*dequantize"):
        config_from_hf({**_config("q-latent-interleaved").to_hf(), "quantization_config": {"quant_method": "fp8"}})


def test_folders_in_and_out(tmp_path):
    """transformers' save_pretrained folder (its experts one by one) is read to equal logits, the routing bias
    included; tetron's folder loads in transformers' from_pretrained as DeepseekV3ForCausalLM, to equal logits."""
    cfg = _config("q-latent-interleaved")
    hf = _hf(cfg)
    hf.save_pretrained(tmp_path / "hf")
    assert config_from_hf(tmp_path / "hf") == cfg
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
        model = load_model(tmp_path / "hf")
        assert type(model) is DeepseekV3ForCausalLM
        torch.testing.assert_close(model(ids), expected, **TOL)
    save_model(model, tmp_path / "ours")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(theirs) is transformers.DeepseekV3ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, expected, **TOL)


def test_kv_cache_generation_equals_the_whole_forward():
    """Generation (observe/generate.py) token by token through the KV cache: each new token's logits equal the
    whole sequence's forward (the shared rotary key at each token's own position)."""
    cfg = _config("yarn-mscale")
    model = DeepseekV3ForCausalLM(cfg).eval()
    model.load_state_dict(_hf(cfg).state_dict())
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids)[0]
        with kv_cache(model):
            steps = [model(ids[:, :3])[0, -1]]
            steps += [model(ids[:, t:t + 1], torch.tensor([t]))[0, -1] for t in range(3, 10)]
    torch.testing.assert_close(torch.stack(steps), full[2:], **TOL)


def test_step_one_loss_from_a_transformers_folder(corpus, cache_dir, tmp_path):
    """`--init-from` a folder written by transformers' save_pretrained: step 1's loss is transformers' own cross
    entropy on the same batch (tp2: the latent projections whole, the up-projections split by heads)."""
    cfg = _config("yarn-mscale", vocab_size=256, num_hidden_layers=2)
    hf = _hf(cfg)
    hf.save_pretrained(tmp_path / "hf")
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 1, "micro_batch": 1, "grad_acc": 2},
                      parallel={"tp": 2}, checkpoint={"init_from": str(tmp_path / "hf")})
    del raw["model"]  # the model comes from the folder
    assert type(from_dict(raw).model) is DeepseekV3Config
    (loss,) = run_training(raw)
    expected = first_batch_loss(raw, hf)
    assert abs(loss - float(expected)) <= 1e-5 * abs(float(expected))


# ----------------------------------------------------------------------------- issue 34's layouts

# 4 layers (the first dense, then MoE: 4 experts top-2 in 2 groups, one shared expert, the routing bias moved by
# load), MLA with the query latent, q/k heads of 16 + 8 = 24 and v heads of 16, YaRN with mscale; sequences of 32.
# (With kv_lora_rank 12 one o_proj weight's gradient nears zero in a step, and AdamW's m / sqrt(v) turns the
# layouts' rounding there into a 1e-5 step: conftest.LAYOUT_LR says why; 16 keeps every weight well inside.)
MODEL = {"model_type": "deepseek_v3", "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
         "n_group": 2, "topk_group": 2, "router_aux_loss_coef": 0.01, "moe_bias_update_rate": 1e-3,
         "rope_scaling": YARN}
LAYOUTS = {  # (parallel, micro_batch, model fields beyond MODEL)
    "dp2": ({"dp": 2}, 1),
    "tp2-sp": ({"tp": 2, "sp": True}, 2),
    "tp2-q-proj": ({"tp": 2}, 2, {"q_lora_rank": None}),  # q_proj column-parallel where there is no q latent
    "pp2-1f1b": ({"pp": 2}, 2),
    "pp2-zbv": ({"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}, 2),
    "cp2-ring": ({"cp": 2}, 2),
    "cp2-ulysses": ({"cp": 2, "cp_impl": "ulysses"}, 2),
    "ep2": ({"dp": 2, "ep": 2}, 1),
    "dp2-ep2-zero3": ({"dp": 2, "ep": 2, "zero": 3}, 1),
    "tp2-cp2-ep2": ({"tp": 2, "cp": 2, "ep": 2}, 2),
    # beyond issue 34's list: packed documents masked in ring attention's blocks (q/k and v of their own widths)
    # and in Ulysses' local attention
    "cp2-ring-documents": ({"cp": 2}, 2, {}, {"mask_documents": True}),
    "cp2-ulysses-documents": ({"cp": 2, "cp_impl": "ulysses"}, 2, {}, {"mask_documents": True}),
    # DualPipeV (its 2*pp micro-batches), alone and with dp and ep
    "pp2-dualpipev": ({"pp": 2, "pp_schedule": "dualpipev", "pp_virtual": 2}, 1, {}, {}, {"grad_acc": 4}),
    "dp2-pp2-ep2-dualpipev": ({"dp": 2, "pp": 2, "ep": 2, "pp_schedule": "dualpipev", "pp_virtual": 2}, 1, {}, {},
                              {"grad_acc": 4}),
}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A .jsonl of documents of 3 to 60 characters (a 32-byte window packs several) and a token cache for it."""
    from test_documents import write_documents

    folder = tmp_path_factory.mktemp("deepseek_documents")
    write_documents(folder / "docs.jsonl", count=1500)
    return folder / "docs.jsonl", folder / "cache"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(corpus, cache_dir, tmp_path, name, request):
    parallel, micro_batch, fields, data, train = (*LAYOUTS[name], {}, {}, {})[:5]
    if data.get("mask_documents"):
        corpus, cache_dir = request.getfixturevalue("short_documents")
    _, written = check_layout(corpus, cache_dir, tmp_path, model={**MODEL, **fields}, micro_batch=micro_batch,
                              data=data, train=train, parallel={**parallel, "bucket_mb": 0.01})
    state = written["model"]
    assert state["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (32, 16)  # one by one, as the hub
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0  # moved by load
    assert state["model.layers.0.self_attn.kv_b_proj.weight"].shape == (4 * (16 + 16), 16)


def test_dp2_ep2_zero3_checkpoint_resumes_in_one_process(corpus, cache_dir, tmp_path):
    """dp2 ep2 ZeRO-3's checkpoint of step 2 (experts from their ep shards, the routing bias as moved by load, the
    rest from ZeRO's pieces) resumed by the single process: its remaining losses and final weights are the single
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
    """dp2 ep2 in bf16 (MLA's q/k and v of their own widths padded for the CPU's fused kernel) against the fp32
    single process: within 1% a step, as test_moe.py's bf16 ep layout."""
    from conftest import layout_configs, reference_run, run_parallel

    layout = dict(model=MODEL, micro_batch=1, parallel={"dp": 2, "ep": 2, "bucket_mb": 0.01})
    fp32, _ = reference_run(layout_configs(corpus, cache_dir, tmp_path, **layout)[1])
    results, _ = run_parallel(layout_configs(corpus, cache_dir, tmp_path, **layout, train={"dtype": "bfloat16"})[0])
    for result in results:
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(fp32["losses"]), rtol=0.01, atol=0)
        assert not torch.equal(losses, torch.tensor(fp32["losses"]))  # bf16 really ran


# ----------------------------------------------------------------------------- the published shapes and the planner

@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_configs_fit_their_nodes_on_every_kind_of_rank(name):
    """Each config's layout on its 32 x 8 H100 fits by the memory model on every kind of pipeline rank (the busiest
    of DeepSeek-V3's is the last, with the MTP module; Kimi-K2's the second, two MoE layers), and tetron plan prints
    DeepSeek-V3's MTP parameters apart."""
    from tetron.config import CONFIGS_DIR, load_config
    from tetron.plan.hardware import gpu
    from tetron.plan.memory import heaviest_ranks, predict
    from tetron.plan.report import mtp_params
    from tetron.plan.search import memory_limit
    from tetron.validate import validate

    cfg = load_config(CONFIGS_DIR / f"{name}.yaml")
    validate(cfg, world_size=256)
    assert len(heaviest_ranks(cfg)) > 2  # the middle ranks weighed too
    assert predict(cfg, ranks=heaviest_ranks(cfg)).total <= memory_limit(gpu("H100"), 8)
    assert mtp_params(cfg.model) == (11_610_067_968 if name == "deepseek-v3" else 0)


def test_configs_count_the_published_parameters():
    """configs/deepseek-v3.yaml: 671B total (the published figure, which leaves out the MTP layer) and 37.55B active
    (published: 37B); configs/kimi-k2.yaml: 1.026T, 32.9B active (published: 1.04T, 32.6B): the family's count on
    the meta model, equal to num_params."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent / "configs"
    for name, total, active in (("deepseek-v3", 671_026_404_352, 37_552_282_624),
                                ("kimi-k2", 1_026_408_209_408, 32_861_477_888)):
        cfg = DeepseekV3Config(**yaml.safe_load((root / f"{name}.yaml").read_text())["model"])
        mtp = cfg.num_nextn_predict_layers
        cfg.num_nextn_predict_layers = 0  # the published count leaves the MTP module out; num_params counts without
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params() == total, name
        if mtp:  # DeepSeek-V3's one MTP module: an MoE layer and its own projection and norms (11.6B; 685B in all)
            cfg.num_nextn_predict_layers = mtp
            with torch.device("meta"):
                model = DeepseekV3ForCausalLM(cfg)
            extra = sum(p.numel() for p in model.mtp.parameters())
            assert 11e9 < extra < 12e9 and sum(p.numel() for p in model.parameters()) == total + extra
        assert cfg.num_params(active=True) == active, name


@pytest.mark.parametrize("tp", [1, 2])
def test_the_planner_reads_mla_layers(corpus, cache_dir, tmp_path, tp):
    """The planner's per-layer parameters (plan/state.py, from the family's module on the meta device) are a dense
    layer's and an MoE layer's, split as the plan says (latents whole, up-projections by heads); its attention
    width is q/k's (nope + rope), not the RoPE tables' head_dim."""
    from tetron.plan.sizes import Sizes
    from tetron.plan.state import layer_numels

    raw = tiny_config(corpus, cache_dir, tmp_path, model={**MODEL, "num_hidden_layers": 2},
                      parallel={"tp": tp, "dp": 2, "ep": 2})
    cfg = from_dict(raw)
    model = DeepseekV3ForCausalLM(cfg.model)
    layers = [layer for layer in model.model.layers.values()]
    split = {"q_b_proj", "kv_b_proj", "o_proj"}

    def on_rank(layer, experts: int = 1) -> int:
        return sum(p.numel() // (tp if name.split(".")[1] in split else 1) // (experts if ".experts." in name else 1)
                   for name, p in layer.named_parameters())

    assert sum(layer_numels(cfg)) == on_rank(layers[0])
    assert sum(layer_numels(cfg, moe=True)) == on_rank(layers[1], experts=2)
    assert Sizes.of(cfg).hd == 16 + 8 and Sizes.of(cfg).hq == 4 // tp * 24
