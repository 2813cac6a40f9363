"""docs/support.md, generated from the validator's own rules (`make docs`; tests/test_docs.py fails when stale).

Each feature is set on a tiny base config, alone and with each parallel axis, and `tetron.validate.validate` says
whether that runs: accepted, or refused with the one-line message a user sees. Every pair of features is tried
the same way; the pairs refused together though each runs alone are the rules between features. Nothing here
is written by hand but the features' names, how each is switched on, and the tests that train a combination
against the single process (each checked to exist by tests/test_docs.py); the suite's fuzzer draws (tests/
test_fuzz.py) are matched to the cells they cover by validating them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
SUPPORT_MD = ROOT / "docs" / "support.md"
for _path in (ROOT, ROOT / "tests"):  # tetron, and the fuzzer's draws (tests/fuzz/draw.py)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tetron.config import Config, from_dict  # noqa: E402
from tetron.errors import ConfigError  # noqa: E402
from tetron.models import FAMILIES  # noqa: E402
from tetron.optim import OPTIMIZERS  # noqa: E402
from tetron.parallel.pipeline_schedules import SCHEDULES  # noqa: E402
from tetron.validate import validate  # noqa: E402

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# a family's fields beyond BASE's (and MOE's) where its own rules need them: MLA has as many key/value heads as query
# heads, DeepSeek-V3's default 8 expert groups need more experts than MOE's, its default latents are the 671B's
FAMILY_FIELDS = {"deepseek_v3": {"num_key_value_heads": 8, "n_group": 1, "topk_group": 1, "q_lora_rank": 16,
                                 "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}}
BASE = {  # 8 layers (every schedule's stages at pp 4), 8 query heads over 4 kv heads (tp 4, Ulysses at cp 4), 32 tokens
    "model": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64},
    "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": 32},
    "train": {"steps": 2, "micro_batch": 1, "grad_acc": 4},
    "parallel": {"device": "cpu"},
}
# The parallel axes: each doubles one size of the feature's config; ep carves its ranks out of dp, in an MoE model
# (Qwen3-MoE unless the feature is a family of its own).
AXES: dict[str, dict] = {"one process": {}, "dp": {"parallel": {"dp": 2}}, "tp": {"parallel": {"tp": 2}},
                         "pp": {"parallel": {"pp": 2}}, "cp": {"parallel": {"cp": 2}},
                         "ep": {"parallel": {"ep": 2, "dp": 2}, "model": {"model_type": "qwen3_moe", **MOE}}}
SUITE_SEED, SUITE_COUNT, SUITE_MAX_WORLD = 2026, 12, 4  # tests/test_fuzz.py's draws


@dataclasses.dataclass(frozen=True)
class Feature:
    group: str
    name: str
    sections: dict  # what switches it on (with the sizes it needs)
    on: Callable[[Config], bool]  # whether a config has it (to match the fuzzer's draws to the cells)


def features() -> list[Feature]:
    """Every feature of the matrix, from tetron's registries where there is one (families, schedules, optimizers)."""
    out = []
    for name in sorted(FAMILIES):
        model = {"model_type": name, **(MOE if _is_moe(name) else {}), **FAMILY_FIELDS.get(name, {})}
        out.append(Feature("family", name, {"model": model},
                           lambda c, n=name: c.model.model_type == n))
    for stage in (1, 2, 3):
        out.append(Feature("ZeRO", f"zero={stage}", {"parallel": {"zero": stage}},
                           lambda c, s=stage: c.parallel.zero == s))
    out.append(Feature("ZeRO", "HSDP (zero=2, dp=4, dp_shard=2)", {"parallel": {"zero": 2, "dp": 4, "dp_shard": 2}},
                       lambda c: c.parallel.dp_shard not in (None, c.parallel.dp * c.parallel.cp)))
    out.append(Feature("data parallel", "dp_impl=naive", {"parallel": {"dp_impl": "naive"}},
                       lambda c: c.parallel.dp_impl == "naive"))
    out.append(Feature("data parallel", "reduce_dtype=bfloat16", {"parallel": {"reduce_dtype": "bfloat16"}},
                       lambda c: c.parallel.reduce_dtype == "bfloat16"))
    for name, spec in sorted(SCHEDULES.items()):
        virtual = spec.virtual if spec.virtual is not None else 2
        pp = max(2, spec.min_pp)
        out.append(Feature("pipeline schedule", f"{name} (pp={pp}, pp_virtual={virtual})",
                           {"parallel": {"pp": pp, "pp_schedule": name, "pp_virtual": virtual}},
                           lambda c, n=name: c.parallel.pp > 1 and c.parallel.pp_schedule == n))
    out.append(Feature("pipeline schedule", "uneven stages (7 layers, pp=2)",
                       {"parallel": {"pp": 2}, "model": {"num_hidden_layers": 7}},
                       lambda c: c.model.num_hidden_layers % (c.parallel.pp * c.parallel.pp_virtual) != 0))
    for impl in ("ring", "ulysses"):
        out.append(Feature("context parallel", f"cp_impl={impl} (cp=2)", {"parallel": {"cp": 2, "cp_impl": impl}},
                           lambda c, i=impl: c.parallel.cp > 1 and c.parallel.cp_impl == i))
    out.append(Feature("context parallel", "cp_layout=contiguous (cp=2)",
                       {"parallel": {"cp": 2, "cp_layout": "contiguous"}},
                       lambda c: c.parallel.cp > 1 and c.parallel.cp_layout == "contiguous"))
    out.append(Feature("tensor parallel", "sp (tp=2)", {"parallel": {"tp": 2, "sp": True}},
                       lambda c: c.parallel.tp > 1 and c.parallel.sp))
    out.append(Feature("tensor parallel", "vocabulary not divisible by tp (257)", {"model": {"vocab_size": 257}},
                       lambda c: c.parallel.tp > 1 and c.model.vocab_size % c.parallel.tp != 0))
    out.append(Feature("experts", "ep=2 (qwen3_moe, dp=2)",
                       {"model": {"model_type": "qwen3_moe", **MOE}, "parallel": {"ep": 2, "dp": 2}},
                       lambda c: c.parallel.ep > 1))
    for mode in ("selective", "full"):
        out.append(Feature("memory", f"recompute={mode}", {"train": {"recompute": mode}},
                           lambda c, m=mode: c.train.recompute == m))
    out.append(Feature("memory", "chunked loss (loss_chunk_tokens=16)", {"train": {"loss_chunk_tokens": 16}},
                       lambda c: 0 < c.train.loss_chunk_tokens < c.train.micro_batch * c.data.seq_len))
    out.append(Feature("model", "tied embeddings", {"model": {"tie_word_embeddings": True}},
                       lambda c: c.model.tie_word_embeddings))
    out.append(Feature("data", "mask_documents", {"data": {"mask_documents": True}}, lambda c: c.data.mask_documents))
    out.append(Feature("data", "reset_positions", {"data": {"reset_positions": True}},
                       lambda c: c.data.reset_positions))
    out.append(Feature("precision", "bf16 (train.dtype)", {"train": {"dtype": "bfloat16"}},
                       lambda c: c.train.dtype == "bfloat16"))
    out.append(Feature("speed", "compile", {"train": {"compile": True}}, lambda c: c.train.compile))
    for name in sorted(OPTIMIZERS):
        out.append(Feature("optimizer", f"optim.name={name}", {"optim": {"name": name}},
                           lambda c, n=name: c.optim.name == n))
    out.append(Feature("optimizer", "QK-clip (optim.qk_clip_tau=50)", {"optim": {"qk_clip_tau": 50.0}},
                       lambda c: c.optim.qk_clip_tau is not None))
    out.append(Feature("checkpoint", "async_save", {"checkpoint": {"async_save": True, "save_every": 1}},
                       lambda c: c.checkpoint.async_save))
    return out


# The tests that train a feature in a layout and compare it with the single process (or, where marked, with a
# reference of its own): feature name -> axis -> test ids. tests/test_docs.py checks that each exists.
TESTED: dict[str, dict[str, list[str]]] = {
    # test_clip_in_layouts: dp2 ZeRO-1/2/3, tp2 sp, tp2 MLA, cp2 ring and Ulysses, pp2, dp2 ep2 (Mixtral)
    "QK-clip (optim.qk_clip_tau=50)": {
        "one process": ["test_qk_clip.py::test_clipped_run_equals_a_loop_written_here"],
        **{axis: ["test_qk_clip.py::test_clip_in_layouts"] for axis in ("dp", "tp", "pp", "cp")}},
    "zero=1": {"dp": ["test_zero.py::test_zero_matches_single_process"]},
    "zero=2": {"dp": ["test_zero.py::test_zero_matches_single_process"]},
    "zero=3": {"dp": ["test_zero.py::test_zero_matches_single_process"],
               "ep": ["test_moe.py::test_ep2_zero3_on_4_ranks_trains_like_one_process_and_resumes_in_one"]},
    "HSDP (zero=2, dp=4, dp_shard=2)": {"ep": ["test_moe.py::test_ep2_zero2_hsdp_trains_like_one_process"]},
    "interleaved (pp=2, pp_virtual=2)": {
        "one process": ["test_pipeline_parallel.py::test_pipeline_matches_single_process"],
        "cp": ["test_layouts.py::test_three_dimensions_on_8_ranks"],
        "ep": ["test_moe.py::test_ep2_pp2_interleaved_trains_like_one_process"]},
    "1f1b (pp=2, pp_virtual=1)": {"one process": ["test_pipeline_parallel.py::test_pipeline_matches_single_process"],
                                  "dp": ["test_pipeline_parallel.py::test_dp_and_pp"],
                                  "tp": ["test_pipeline_parallel.py::test_tp_and_pp"],
                                  "ep": ["test_moe.py::test_ep2_pp2_zero_bubble_trains_like_one_process"]},
    "afab (pp=2, pp_virtual=1)": {"one process": ["test_pipeline_parallel.py::test_pipeline_matches_single_process"],
                                  "cp": ["test_layouts.py::test_three_dimensions_on_8_ranks"]},
    "zbh1 (pp=2, pp_virtual=1)": {"one process": ["test_zero_bubble.py::test_zero_bubble_matches_single_process"]},
    "zbv (pp=2, pp_virtual=2)": {"one process": ["test_zero_bubble.py::test_zero_bubble_matches_single_process"],
                                 "ep": ["test_moe.py::test_ep2_pp2_zero_bubble_trains_like_one_process"]},
    "uneven stages (7 layers, pp=2)": {"one process": ["test_pipeline_parallel.py::test_uneven_split"]},
    "cp_impl=ring (cp=2)": {"one process": ["test_layouts.py::test_cp_matches_single_process"],
                            "dp": ["test_layouts.py::test_dp2_cp2"],
                            "ep": ["test_moe.py::test_dp2_cp2_ep4_mixtral_trains_like_one_process"]},
    "cp_impl=ulysses (cp=2)": {"one process": ["test_ulysses.py::test_ulysses_training_matches_single_process"],
                               "ep": ["test_moe.py::test_cp2_ep2_ulysses_trains_like_one_process"]},
    "cp_layout=contiguous (cp=2)": {"one process": ["test_layouts.py::test_cp_matches_single_process"]},
    "sp (tp=2)": {"one process": ["test_tensor_parallel.py::test_tp_matches_single_process"],
                  "dp": ["test_tensor_parallel.py::test_dp2_tp2_with_grad_accumulation"],
                  "pp": ["test_pipeline_parallel.py::test_tp_and_pp"],
                  "ep": ["test_moe.py::test_cp2_tp2_sp_ep2_trains_like_one_process"]},
    "ep=2 (qwen3_moe, dp=2)": {"one process": ["test_moe.py::test_ep2_trains_like_one_process_and_resumes_in_one"]},
    "recompute=selective": {"one process": ["test_recompute.py::test_single_process_matches_none"],
                            "dp": ["test_recompute.py::test_parallel_layouts_match_none"]},
    "recompute=full": {"one process": ["test_recompute.py::test_single_process_matches_none"],
                       "dp": ["test_recompute.py::test_parallel_layouts_match_none"],
                       "ep": ["test_moe.py::test_ep2_trains_like_one_process_and_resumes_in_one"]},
    "chunked loss (loss_chunk_tokens=16)": {
        "one process": ["test_loss.py::test_chunked_linear_cross_entropy_equals_unchunked"]},
    "tied embeddings": {"pp": ["test_pipeline_parallel.py::test_tied_embeddings"],
                        "tp": ["test_tensor_parallel.py::test_dp2_tp2_with_grad_accumulation"]},
    "mask_documents": {"cp": ["test_documents.py::test_masked_training_matches_single_process"],
                       "dp": ["test_documents.py::test_masked_training_matches_single_process"],
                       "ep": ["test_documents.py::test_masked_training_matches_single_process"]},
    "reset_positions": {"cp": ["test_documents.py::test_masked_training_matches_single_process"]},
    "bf16 (train.dtype)": {"one process": ["test_mixed_precision.py::test_bf16_tracks_fp32"],
                           "dp": ["test_mixed_precision.py::test_bf16_tracks_fp32"],
                           "tp": ["test_mixed_precision.py::test_bf16_tracks_fp32"],
                           "pp": ["test_mixed_precision.py::test_bf16_tracks_fp32"],
                           "cp": ["test_mixed_precision.py::test_bf16_tracks_fp32"],
                           "ep": ["test_moe.py::test_ep2_in_bf16_tracks_the_fp32_single_process"]},
    "compile": {"one process": ["test_compile.py::test_compiled_layers_train_like_eager"],
                "tp": ["test_moe.py::test_tp2_compiled_trains_like_the_eager_single_process"]},
    "async_save": {"ep": ["test_moe.py::test_ep2_zero1_on_4_ranks_trains_like_one_process"]},
    "qwen2": {"tp": ["test_families.py::test_family_layout_matches_single_process"],
              "cp": ["test_families.py::test_family_layout_matches_single_process"]},
    "qwen3": {"dp": ["test_families.py::test_family_layout_matches_single_process"],
              "tp": ["test_families.py::test_family_layout_matches_single_process"]},
    "mixtral": {"ep": ["test_moe.py::test_dp2_cp2_ep4_mixtral_trains_like_one_process"]},
    "deepseek_v3": {axis: ["test_deepseek_v3.py::test_layout_matches_single_process"]
                    for axis in ("dp", "tp", "pp", "cp", "ep")},
    "qwen3_moe": {"ep": ["test_moe.py::test_ep2_trains_like_one_process_and_resumes_in_one"],
                  "dp": ["test_moe.py::test_dp2_zero3_trains_like_one_process"]},
    "llama": {axis: ["test_layouts.py::test_three_dimensions_on_8_ranks"] for axis in ("dp", "tp", "pp", "cp")},
}


# Options set where they do nothing: each probe's note is what `tetron train` prints at start (validate.idle_options).
IDLE_PROBES: list[dict] = [
    {"parallel": {"sp": True}}, {"parallel": {"cp_impl": "ulysses"}}, {"parallel": {"cp_layout": "contiguous"}},
    {"parallel": {"pp_schedule": "afab"}}, {"parallel": {"zero": 1}}, {"parallel": {"dp": 2, "zero": 1, "dp_shard": 1}},
    {"parallel": {"dp": 2, "zero": 1, "zero_accumulate": "full"}}, {"parallel": {"dp": 2, "zero": 2, "dp_shard": 2}},
    {"parallel": {"reduce_dtype": "bfloat16"}}, {"data": {"mask_documents": True, "reset_positions": True}},
    {"train": {"eval_batches": 2}},
]


def idle_notes(out: str) -> list[tuple[str, str]]:
    """(the probe's settings, the note it gets) for each of IDLE_PROBES."""
    from tetron.validate import idle_options

    found = []
    for probe in IDLE_PROBES:
        raw = {**copy.deepcopy(_merge(BASE, probe)), "out": out}
        given = {f"{section}.{key}" for section, values in probe.items() for key in values}
        settings = ", ".join(f"{section}.{key}={json.dumps(v)}" for section, values in probe.items()
                             for key, v in values.items())
        found += [(settings, note) for note in idle_options(from_dict(raw), given)]
    return found


def _merge(*parts: dict) -> dict:
    """Sections merged key by key; the parallel sizes of later parts multiply the earlier ones'."""
    out: dict[str, Any] = {}
    for part in parts:
        for section, values in part.items():
            merged = dict(out.get(section, {}))
            for key, value in values.items():
                if section == "parallel" and key in ("dp", "tp", "pp", "cp", "ep") and key in merged:
                    value = merged[key] * value
                merged[key] = value
            out[section] = merged
    return out


def _is_moe(family: str) -> bool:
    return "num_experts" in {f.name for f in dataclasses.fields(FAMILIES[family].config_class)}


def verdict(*parts: dict, out: str) -> str | None:
    """None when validate accepts BASE with `parts` merged in, else its one-line refusal."""
    raw = {**copy.deepcopy(_merge(BASE, *parts)), "out": out}
    if not _is_moe(raw["model"].get("model_type", "llama")):  # a dense family's row in the ep column: no experts
        raw["model"] = {k: v for k, v in raw["model"].items() if k not in MOE}
    try:
        with mock.patch("tetron.validate.compile_problem", lambda device: None):  # a C++ compiler: the machine's
            validate(from_dict(raw))
    except ConfigError as err:
        return str(err)
    return None


def suite_draw_cells(feats: list[Feature], out: str) -> dict[tuple[str, str], list[int]]:
    """(feature, axis) -> the indices of tests/test_fuzz.py's draws that validate accepts and that have both."""
    from fuzz.draw import draw

    cells: dict[tuple[str, str], list[int]] = {}
    for index in range(SUITE_COUNT):
        sections = draw(random.Random(f"tetron-fuzz:{SUITE_SEED}:{index}"), max_world=SUITE_MAX_WORLD)
        raw = {**copy.deepcopy(sections), "out": out,
               "data": {**sections["data"], "path": "stdlib", "tokenizer": "bytes"}}
        try:
            cfg = from_dict(raw)
            validate(cfg)
        except ConfigError:
            continue
        p = cfg.parallel
        axes = [a for a in AXES if a != "one process" and getattr(p, a) > 1] or ["one process"]
        for f in feats:
            if f.on(cfg):
                for axis in axes:
                    cells.setdefault((f.name, axis), []).append(index)
    return cells


def support_markdown() -> str:
    """The text of docs/support.md."""
    feats = features()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "run")
        grid = {(f.name, axis): verdict(axis_sections, f.sections, out=out)
                for f in feats for axis, axis_sections in AXES.items()}
        alone = {f.name: verdict(f.sections, out=out) for f in feats}
        pairs = []
        for i, a in enumerate(feats):
            for b in feats[i + 1:]:
                if a.group == "family" and b.group == "family" or alone[a.name] or alone[b.name]:
                    continue
                message = verdict(a.sections, b.sections, out=out)
                if message:
                    pairs.append((a.name, b.name, message))
        fuzzed = suite_draw_cells(feats, out)
        idle = idle_notes(out)
    messages: list[str] = []

    def cell(name: str, axis: str) -> str:
        message = grid[(name, axis)]
        if message:
            if message not in messages:
                messages.append(message)
            return f"refused [R{messages.index(message) + 1}](#r{messages.index(message) + 1})"
        tests = [t.split("::")[1] for t in TESTED.get(name, {}).get(axis, [])]
        draws = fuzzed.get((name, axis), [])
        said = [f"`{t}`" for t in tests] + ([f"`test_fuzz` ({', '.join(map(str, draws))})"] if draws else [])
        return "runs; " + ", ".join(said) if said else "runs (`make fuzz`)"

    lines = [
        "# What runs where: the support matrix",
        "",
        "<!-- generated by docs/support.py (make docs) from the validator's rules; tests/test_docs.py fails when "
        "it is stale -->",
        "",
        "Each feature below is switched on in a tiny config (Llama, 8 layers, 8 query and 4 kv heads, 32 tokens) and "
        "validated alone and with each parallel axis at 2 (`ep` carves its 2 ranks out of dp=2 of a Qwen3-MoE "
        "model, unless the row is another family). A cell says "
        "**runs** when `tetron train` accepts it, with the tests that train that combination and compare it with "
        "the single process (losses within 1e-5 relative, weights within 1e-5; bf16 within 1% of fp32), and the "
        "suite's fuzzer draws that cover it (`test_fuzz`, tests/test_fuzz.py, seed "
        f"{SUITE_SEED}: draw numbers); **runs (`make fuzz`)** is accepted and covered only by the fuzzer's longer "
        "runs (`make fuzz SEED=N COUNT=K`: random configurations of every family, axis, schedule and option, each "
        "against the single process). **refused** links to the one-line message a user sees, before any rank "
        "starts.",
        "",
        "| feature | " + " | ".join(AXES) + " |",
        "|---" * (len(AXES) + 1) + "|",
    ]
    group = None
    for f in feats:
        if f.group != group:
            group = f.group
        lines.append(f"| {f.group}: {f.name} | " + " | ".join(cell(f.name, axis) for axis in AXES) + " |")
    lines += ["", "## Features together", "",
              "The pairs of features refused together though each runs alone (with the sizes it needs), and why:",
              "", "| feature | with | refused |", "|---|---|---|"]
    for a, b, message in pairs:
        lines.append(f"| {a} | {b} | {_cell(message)} |")
    lines += ["", "## Options that do nothing where they are set", "",
              "Accepted, but idle in that layout: `tetron train` says so in one note line at start (`tetron: note: "
              "...`), so that no option is silently ignored.", "", "| set | the note |", "|---|---|"]
    for settings, note in idle:
        lines.append(f"| `{settings}` | {_cell(note)} |")
    lines += ["", "## Refusals", ""]
    for i, message in enumerate(messages, 1):
        lines += [f"### R{i}", "", message, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def write() -> bool:
    """Write docs/support.md if it changed; whether it did."""
    text = support_markdown()
    if SUPPORT_MD.is_file() and SUPPORT_MD.read_text(encoding="utf-8") == text:
        return False
    SUPPORT_MD.write_text(text, encoding="utf-8")
    return True


if __name__ == "__main__":
    print("docs/support.py: wrote docs/support.md" if write() else "docs/support.md is current")
