"""Multi-token prediction (models/mtp.py, issue 34): the MTP objective and its gradients against a plain computation
written here (with and without packed documents), the logged mtp_loss, layouts equal to the single process, and
the config's errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tetron.config import from_dict
from tetron.data.batch import mtp_shifted
from tetron.errors import ConfigError
from tetron.models.attention import Documents
from tetron.models.deepseek_v3 import DeepseekV3Config
from tetron.models.llama.rope import rope_cos_sin
from tetron.models.mtp import take_mtp_sum
from tetron.parallel.init import seeded_model
from tetron.validate import validate

from conftest import check_layout, layout_configs, reference_run, run_training, tiny_config

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, n_group=2, topk_group=2, max_position_embeddings=64)
MODEL = {"model_type": "deepseek_v3", **{k: v for k, v in TINY.items() if k != "vocab_size"},
         "num_key_value_heads": 4, "num_nextn_predict_layers": 1}


def _reference(model, ids, targets, docs, *, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss sum, MTP objective part (w/D) sum_k sum CE_k) written plainly: shift by slicing, whole logits."""
    cfg, T = model.config, ids.shape[1]
    pos = torch.arange(T)[None]
    h = model.model(ids, pos, docs)
    main = F.cross_entropy(model.lm_head(h).flatten(0, 1), targets.flatten(), reduction="sum")
    total = torch.zeros(())
    for k, module in enumerate(model.mtp.values(), start=1):
        nxt = torch.zeros_like(ids)
        nxt[:, :T - k] = ids[:, k:]
        e = model.model.embed_tokens(nxt)
        x = module.eh_proj(torch.cat([module.enorm(e), module.hnorm(h)], -1))
        cos, sin = rope_cos_sin(cfg, pos, dtype=x.dtype, layer=cfg.num_hidden_layers + k - 1)
        h = module(x, cos, sin, Documents(docs) if docs is not None else None)
        logits = model.lm_head(module.shared_head.norm(h))[:, :T - k]  # [B, T-k, V]: p + k inside the window
        keep = torch.ones(ids.shape[0], T - k, dtype=torch.bool) if docs is None else docs[:, k:] == docs[:, :T - k]
        total = total + F.cross_entropy(logits[keep], targets[:, k:][keep], reduction="sum")
    return main, weight * total / len(model.mtp)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_objective_and_gradients_equal_a_plain_computation(documents, depth):
    cfg = DeepseekV3Config(**{**TINY, "num_nextn_predict_layers": depth})
    torch.manual_seed(0)
    B, T, w = 2, 12, 0.3
    ids, targets = torch.randint(0, 64, (B, T)), torch.randint(0, 64, (B, T))
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3]) if documents else None
    model = seeded_model(cfg, seed=3, device=torch.device("cpu"))
    model.loss_chunk_tokens, model.mtp_loss_weight = 5, w  # chunked head, last chunk ragged
    names = [n for n, _ in model.named_parameters()]
    assert "mtp.0.eh_proj.weight" in names and "mtp.0.mlp.experts.gate_up_proj" in names  # an MoE layer

    main, extra = _reference(model, ids, targets, docs, weight=w)
    ((main + extra) / (B * T)).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    take_mtp_sum([model], torch.device("cpu"))

    out = model(ids, None, docs, targets=targets, mtp=mtp_shifted(ids, targets, docs, depth))
    torch.testing.assert_close(out, main, atol=1e-5, rtol=1e-5)  # the value stays the main loss
    (out / (B * T)).backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)
    assert want["mtp.0.eh_proj.weight"].abs().max() > 0
    logged = take_mtp_sum([model], torch.device("cpu"))
    torch.testing.assert_close(logged * w, extra.detach(), atol=1e-5, rtol=1e-5)


def test_training_logs_mtp_loss_apart(corpus, cache_dir, tmp_path):
    """metrics.jsonl has mtp_loss; the logged loss is the main loss: equal to a run with weight 0 on step 1."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "a", model=MODEL, train={"steps": 2})
    run_training(raw)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mtp_loss"] > 0 for r in records)
    off = tiny_config(corpus, cache_dir, tmp_path / "b", model={**MODEL, "num_nextn_predict_layers": 0},
                      train={"steps": 2})
    run_training(off)
    other = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(other[0]["loss"], rel=1e-6)
    assert "mtp_loss" not in other[0]


def test_config_errors(corpus, cache_dir, tmp_path):
    def fails(match, **sections):
        with pytest.raises(ConfigError, match=match):
            validate(from_dict(tiny_config(corpus, cache_dir, tmp_path, **sections)))

    fails("num_nextn_predict_layers", model={"num_nextn_predict_layers": 1})  # a Llama has no MTP
    fails("mtp_loss_weight", model=MODEL, train={"mtp_loss_weight": -1.0})
    fails("num_nextn_predict_layers", model={**MODEL, "num_nextn_predict_layers": -1})


def test_folder_round_trip_at_deepseeks_names(tmp_path):
    """Saved as the layer past the last (DeepSeek's layout), read back equal; transformers loads the folder."""
    import transformers
    from safetensors import safe_open

    from tetron.checkpoint.load import load_model
    from tetron.checkpoint.save import save_model

    cfg = DeepseekV3Config(**{**TINY, "num_nextn_predict_layers": 1})
    model = seeded_model(cfg, seed=5, device=torch.device("cpu"))
    save_model(model, tmp_path / "m")
    names = set()
    for f in (tmp_path / "m").glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            names |= set(st.keys())
    assert "model.layers.2.eh_proj.weight" in names and "model.layers.2.shared_head.norm.weight" in names
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in names and not any(n.startswith("mtp.") for n in names)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = load_model(tmp_path / "m")
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert hf.config.num_nextn_predict_layers == 1
    # DeepSeek's own folders also hold the embedding and the head again in the MTP layer: left unread
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "m" / "model.safetensors")
    state["model.layers.2.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    again = load_model(tmp_path / "m")
    assert again.state_dict().keys() == model.state_dict().keys()
    state["model.layers.2.stray.weight"] = torch.zeros(1)  # anything else there is still refused
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor model.layers.2.stray.weight"):
        load_model(tmp_path / "m")


LAYOUT_MODEL = {**MODEL, "num_hidden_layers": 2, "rope_scaling": None, "router_aux_loss_coef": 0.01,
                "moe_bias_update_rate": 1e-3}
LAYOUTS = {  # (parallel, micro_batch, data, train, model fields): issue 34's layouts with MTP on
    "dp2": ({"dp": 2}, 1, {}),
    "tp2-sp": ({"tp": 2, "sp": True}, 2, {}),
    "tp2": ({"tp": 2}, 2, {"mask_documents": True}),
    "cp2-ring-documents": ({"cp": 2}, 2, {"mask_documents": True}),
    "cp2-ulysses": ({"cp": 2, "cp_impl": "ulysses"}, 2, {}),
    "cp2-contiguous-documents": ({"cp": 2, "cp_layout": "contiguous"}, 2, {"mask_documents": True}),
    "ep2": ({"dp": 2, "ep": 2}, 1, {}),
    "pp2-1f1b": ({"pp": 2}, 2, {}),
    "pp2-tp2-sp": ({"pp": 2, "tp": 2, "sp": True}, 2, {}),
    # tied: the last stage's MTP modules and head read one embedding copy, its gradient summed with the first's
    "pp2-tied": ({"pp": 2}, 2, {}, {}, {"tie_word_embeddings": True}),
    "pp2-full-recompute": ({"pp": 2}, 2, {}, {"recompute": "full"}),
    "tp2-selective": ({"tp": 2, "sp": True}, 2, {}, {"recompute": "selective"}),
    "pp2-zbv": ({"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}, 2, {}, {}, {"num_hidden_layers": 4}),
    "pp2-dualpipev": ({"pp": 2, "pp_schedule": "dualpipev", "pp_virtual": 2}, 1, {}, {"grad_acc": 4},
                      {"num_hidden_layers": 4}),
    "dp2-ep2-zero3": ({"dp": 2, "ep": 2, "zero": 3}, 1, {}),
    "ep4": ({"dp": 4, "ep": 4}, 1, {}),  # one expert a rank
    "tp2-cp2-ep2": ({"tp": 2, "cp": 2, "ep": 2}, 2, {}),  # ep carved out of cp
    "dp2-pp2-ep2-dualpipev": ({"dp": 2, "pp": 2, "ep": 2, "pp_schedule": "dualpipev", "pp_virtual": 2}, 1, {},
                              {"grad_acc": 4}, {"num_hidden_layers": 4}),
}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    from test_documents import write_documents

    folder = tmp_path_factory.mktemp("mtp_documents")
    write_documents(folder / "docs.jsonl", count=1500)
    return folder / "docs.jsonl", folder / "cache"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_the_single_process(corpus, cache_dir, tmp_path, request, name):
    parallel, micro_batch, data, train, fields = (*LAYOUTS[name], {}, {})[:5]
    model = {**LAYOUT_MODEL, **fields}
    if data.get("mask_documents"):
        corpus, cache_dir = request.getfixturevalue("short_documents")
    _, written = check_layout(corpus, cache_dir, tmp_path, model=model, micro_batch=micro_batch, data=data,
                              train=train, parallel={**parallel, "bucket_mb": 0.01})
    ref_written = reference_run(layout_configs(corpus, cache_dir, tmp_path, model=model, micro_batch=micro_batch,
                                               data=data, train=train, parallel={**parallel, "bucket_mb": 0.01})[1])[1]
    got, want = ([m["mtp_loss"] for m in w["metrics"]] for w in (written, ref_written))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)  # reduced over the ranks
    assert min(want) > 0 and f"model.layers.{model['num_hidden_layers']}.eh_proj.weight" in written["model"]


def test_checkpoint_from_pp2_resumes_in_one_process(corpus, cache_dir, tmp_path):
    """Saved under pp2 (the MTP module and the embedding's copy on the last stage), resumed in one process: the
    later steps' losses equal the uninterrupted single process's."""
    from conftest import LOSS_RTOL, run_parallel

    layout = dict(model=LAYOUT_MODEL, micro_batch=2, parallel={"pp": 2, "bucket_mb": 0.01})
    check_layout(corpus, cache_dir, tmp_path, checkpoint={"save_every": 2}, **layout)
    ref_raw = layout_configs(corpus, cache_dir, tmp_path, **layout)[1]
    ref, _ = reference_run(ref_raw)
    resumed = {**ref_raw, "out": str(tmp_path / "resumed"),
               "checkpoint": {"resume": str(tmp_path / "run" / "checkpoints" / "step_2")}}
    (got,), written = run_parallel(resumed)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][2:]), rtol=LOSS_RTOL, atol=0)


def test_bf16_tracks_the_fp32_single_process(corpus, cache_dir, tmp_path):
    """dp2 ep2 with MTP in bf16 against the fp32 single process: the loss and mtp_loss within 1% a step (the bound
    of test_deepseek_v3.py's bf16 layout without MTP)."""
    from conftest import run_parallel

    layout = dict(model=LAYOUT_MODEL, micro_batch=1, parallel={"dp": 2, "ep": 2, "bucket_mb": 0.01})
    _, fp32 = reference_run(layout_configs(corpus, cache_dir, tmp_path, **layout)[1])
    _, bf16 = run_parallel(layout_configs(corpus, cache_dir, tmp_path, **layout, train={"dtype": "bfloat16"})[0])
    for key in ("loss", "mtp_loss"):
        got, want = (torch.tensor([m[key] for m in w["metrics"]]) for w in (bf16, fp32))
        torch.testing.assert_close(got, want, rtol=0.01, atol=0, msg=key)
        assert not torch.equal(got, want)  # bf16 really ran
