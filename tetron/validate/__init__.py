"""Every check of a run configuration that needs no process group: one `ConfigError` line each,
naming the field, the values and what would work, raised before any rank starts. Nothing that could
be refused here may reach a rank: numbers (finite, in range), the device, the run folder and every
path the run writes, the checkpoint or model folder it starts from, a hub name it would download."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

from tetron.config import Config
from tetron.data.loader import data_specs, tokenizer_spec
from tetron.data.sources import source_of
from tetron.data.tokenizer import MAX_BPE_VOCAB
from tetron.device import compile_problem, device_problem
from tetron.errors import ConfigError, quoted
from tetron.errors import check as _check
from tetron.models.qwen3_moe import MoeConfig
from tetron.observe.profiling import parse_steps
from tetron.optim import OPTIMIZERS
from tetron.overrides import one_of
from tetron.parallel.pipeline_schedules import SCHEDULES, ScheduleSpec
from tetron.validate.paths import (
    FileChecks,
    looked,
    validate_checkpoint,
    validate_no_model,
    validate_out,
    validate_sources,
    validate_val_path,
)


def _word(n: int) -> str:
    return ("two", "three", "four")[n - 2] if 2 <= n <= 4 else str(n)


def _chunks_needed(spec: ScheduleSpec) -> str:
    """What pp_virtual above 1 needs, from the registered schedules: "pp_schedule=interleaved (or zbv, with 2)"."""
    anything = [n for n, s in SCHEDULES.items() if s.virtual is None]
    fixed = [f"{n}, with {s.virtual}" for n, s in SCHEDULES.items() if s.virtual is not None and s.virtual > 1]
    return f"pp_schedule={' or '.join(anything)}" + (f" (or {'; or '.join(fixed)})" if fixed else "")


def _validate_schedule_chunks(cfg: Config, spec: ScheduleSpec) -> None:
    """What the schedule declares it needs (pipeline_schedules.register_schedule): a fixed number of chunks per
    rank with the layers to fill them, and for a split backward no compiled layers."""
    p, layers = cfg.parallel, cfg.model.num_hidden_layers
    name = f"parallel.pp_schedule={p.pp_schedule}"
    if spec.virtual is not None and spec.virtual > 1:
        _check(p.pp_virtual == spec.virtual, f"{name} runs exactly {_word(spec.virtual)} chunks "
               f"per pipeline rank{' (a V)' if spec.style == 'v' else ''}: set parallel.pp_virtual={spec.virtual}, "
               f"not {p.pp_virtual}")
        stages, most = spec.virtual * p.pp, layers // spec.virtual
        works = (f"use pp_schedule=zbh1 or 1f1b ({p.pp_schedule} needs at least {2 * spec.virtual} layers)"
                 if most < spec.min_pp else ("use pp=2" if most == 2 else f"use pp from {spec.min_pp} to {most}")
                 + ", or pp_schedule=zbh1")
        _check(spec.min_pp <= p.pp <= most, f"{name} cuts the model into {spec.virtual}*pp={stages} stages, "
               f"{_word(spec.virtual)} on each of pp >= {spec.min_pp} ranks, and "
               f"model.num_hidden_layers={layers} must fill them; {works}")
    if spec.splits_backward:
        _check(not cfg.train.compile, f"{name} with train.compile: a compiled layer's backward cannot be split "
               f"into B and W; use compile=false or pp_schedule=1f1b")


def _validate_schedule_stages(cfg: Config, spec: ScheduleSpec) -> None:
    """What a schedule of any number of chunks per rank declares it needs: pp, layers, micro-batches."""
    p, layers, m = cfg.parallel, cfg.model.num_hidden_layers, cfg.train.grad_acc
    name = f"parallel.pp_schedule={p.pp_schedule}"
    if spec.virtual is None:
        _check(p.pp >= spec.min_pp, f"{name} needs pp >= {spec.min_pp}, not pp={p.pp}; use pp >= {spec.min_pp} or 1f1b")
        stages = p.pp * p.pp_virtual
        _check(stages <= layers,
               f"parallel.pp_virtual={p.pp_virtual} x pp={p.pp} = {stages} virtual stages is more than "
               f"model.num_hidden_layers={layers}; use pp_virtual <= {layers // p.pp}")
    least = spec.min_micro_batches_per_pp * p.pp
    _check(m >= least, f"train.grad_acc={m} micro-batches: {name.removeprefix('parallel.')} needs at least "
           f"{spec.min_micro_batches_per_pp}*pp={least}; use grad_acc={least} or more (or pp_schedule=zbv)")
    if spec.micro_batches_per_pp:
        # Micro-batches go round the ring in groups of pp, one group per chunk in turn (Megatron's order).
        _check(m % p.pp == 0,
               f"train.grad_acc={m} micro-batches: {name.removeprefix('parallel.')} needs a multiple of pp={p.pp}; "
               f"use grad_acc={max(1, -(-m // p.pp)) * p.pp} (or pp_schedule=1f1b, which takes any number)")


def _validate_pipeline(cfg: Config) -> None:
    """The pipeline checks: the schedule's name and needs, stages vs layers, the split."""
    p, layers = cfg.parallel, cfg.model.num_hidden_layers
    _check(p.pp_schedule in SCHEDULES, f"parallel.pp_schedule={quoted(p.pp_schedule)}: use {one_of(tuple(SCHEDULES))}")
    spec = SCHEDULES[p.pp_schedule]
    _check(p.pp_virtual >= 1, f"parallel.pp_virtual={p.pp_virtual} must be at least 1")
    _check(p.pp_virtual == 1 or spec.virtual != 1,
           f"parallel.pp_virtual={p.pp_virtual} (layer chunks per pipeline rank) needs {_chunks_needed(spec)}; "
           f"pp_schedule={p.pp_schedule} runs one chunk per rank: use pp_virtual=1 with it")
    _validate_schedule_chunks(cfg, spec)
    _check(p.pp <= layers, f"parallel.pp={p.pp} is more than model.num_hidden_layers={layers}; use pp <= {layers}")
    _validate_schedule_stages(cfg, spec)
    stages = p.pp * p.pp_virtual
    # afab and 1f1b take any number of micro-batches (grad_acc >= 1 is checked below); with fewer
    # than pp, stages idle most of the step: the bubble is (pp-1)/(grad_acc+pp-1) of it.
    if p.pp_split is not None:
        split = p.pp_split
        _check(len(split) == stages,
               f"parallel.pp_split={split} has {len(split)} entries; give one per pipeline stage "
               f"(pp*pp_virtual = {stages})")
        _check(min(split) >= 1, f"parallel.pp_split={split}: every stage needs at least 1 layer")
        _check(sum(split) == layers,
               f"parallel.pp_split={split} sums to {sum(split)}; it must sum to model.num_hidden_layers={layers}")


def _validate_memory(cfg: Config) -> None:
    """ZeRO and mixed precision: both live in the fp32 gradient buckets of dp_impl=bucket."""
    p, t = cfg.parallel, cfg.train
    _check(p.zero in (0, 1, 2, 3),
           f"parallel.zero={p.zero}: use 0 (off), 1 (optimizer state), 2 (and gradients) or 3 (and parameters)")
    for needs, what in ((p.zero >= 1, f"parallel.zero={p.zero} (it shards the gradient buckets)"),
                        (t.dtype == "bfloat16", "train.dtype=bfloat16 (gradients accumulate in its fp32 buckets)"),
                        (p.reduce_dtype == "bfloat16", "parallel.reduce_dtype=bfloat16 (it reduces the buckets)")):
        _check(not needs or p.dp_impl == "bucket", f"{what} needs parallel.dp_impl=bucket, not {p.dp_impl}")
    n = p.dp * p.cp
    _check(p.dp_shard is None or (p.dp_shard >= 1 and n % p.dp_shard == 0),
           f"parallel.dp_shard={p.dp_shard} must divide dp*cp={n}: ZeRO shards over groups of dp_shard ranks "
           f"and replicates across them (null: all {n})")
    _check(p.dp_shard in (None, n) or p.zero >= 1,
           f"parallel.dp_shard={p.dp_shard} needs parallel.zero >= 1: without ZeRO nothing is sharded")


def _validate_layout(cfg: Config, world_size: int | None) -> None:
    """The parallel sizes against the world and the model's shapes."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    for name in ("dp", "tp", "pp", "cp"):
        _check(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)} must be at least 1")
    if world_size is not None:
        _check(world_size == cfg.world_size,
               f"world size {world_size} is not dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {cfg.world_size}; "
               f"launch {cfg.world_size} ranks or change the sizes")
    _check(p.bucket_mb > 0, f"parallel.bucket_mb={p.bucket_mb} must be positive")
    _check(0 < p.timeout_s <= 1e7, f"parallel.timeout_s={p.timeout_s} must be positive (seconds, at most 1e7)")
    problem = device_problem(p.device, cfg.world_size if world_size is None else None)
    _check(problem is None, f"parallel.device={p.device}: {problem}")

    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim"):
        _check(getattr(m, name) >= 1, f"model.{name}={getattr(m, name)} must be at least 1")
    _check(m.num_attention_heads % m.num_key_value_heads == 0,
           f"model.num_key_value_heads={m.num_key_value_heads} must divide "
           f"num_attention_heads={m.num_attention_heads}")
    _check(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    _check(m.num_attention_heads % p.tp == 0,
           f"parallel.tp={p.tp} must divide model.num_attention_heads={m.num_attention_heads}")
    _check(m.num_key_value_heads % p.tp == 0,
           f"parallel.tp={p.tp} must divide model.num_key_value_heads={m.num_key_value_heads}")
    _check(m.intermediate_size % p.tp == 0,
           f"parallel.tp={p.tp} must divide model.intermediate_size={m.intermediate_size}")
    _check(p.vocab_pad_multiple >= 1, f"parallel.vocab_pad_multiple={p.vocab_pad_multiple} must be at least 1")
    chunks = 2 * p.cp if p.cp_layout == "zigzag" and p.cp > 1 else p.cp
    _check(d.seq_len % chunks == 0,
           f"data.seq_len={d.seq_len} must be divisible by {'2*cp' if chunks != p.cp else 'cp'}={chunks} "
           f"(cp={p.cp}, cp_layout={p.cp_layout}); use a multiple of {chunks}")
    _check(not p.sp or (d.seq_len // p.cp) % p.tp == 0,
           f"parallel.sp needs data.seq_len={d.seq_len} / cp={p.cp} divisible by tp={p.tp}; "
           f"use a seq_len that is a multiple of {p.cp * p.tp}")
    heads = m.num_attention_heads // p.tp  # query heads per tp rank (kv heads are repeated where too few)
    _check(p.cp_impl != "ulysses" or heads % p.cp == 0,
           f"parallel.cp_impl=ulysses needs the query heads per tp rank (num_attention_heads="
           f"{m.num_attention_heads} / tp={p.tp} = {heads}) divisible by cp={p.cp}; use a cp that divides "
           f"{heads}, or cp_impl=ring")
    _validate_pipeline(cfg)


def _validate_data(cfg: Config, seen: FileChecks | None = None) -> None:
    """The sequence length, the data source (resolved, not read) and the tokenizer against the model."""
    m, d = cfg.model, cfg.data
    _check(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be at least 1")
    _check(d.seq_len <= m.max_position_embeddings,
           f"data.seq_len={d.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    _check(d.max_bytes is None or d.max_bytes > 0, f"data.max_bytes={d.max_bytes} must be positive")
    validate_sources(cfg, seen)
    tok = tokenizer_spec(cfg)
    if tok.startswith("bpe:"):
        specs = data_specs(cfg)
        _check(not d.sources and not source_of(d.path).tokenized,
               f"data.tokenizer={tok} is trained on text, and {'data.sources is' if d.sources else 'data.path is a'} "
               f"{'set' if d.sources else 'token store'}: leave data.tokenizer unset (--data.tokenizer=null) to use "
               f"the store's, or give a tokenizer folder (tetron tokenize {specs[0]} --tokenizer {tok} makes a "
               f"store with one)")
        n = tok[4:]
        _check(n.isdigit() and 257 <= int(n) <= MAX_BPE_VOCAB,
               f"data.tokenizer={tok[:40]}: use bpe:N with N from 257 (256 bytes + EOS) to {MAX_BPE_VOCAB:,}, "
               f"e.g. bpe:4096")
        _check(int(n) <= m.vocab_size,
               f"data.tokenizer={tok} has a larger vocabulary than model.vocab_size={m.vocab_size}; "
               f"use bpe:{m.vocab_size} or a larger vocab_size")
    elif tok == "bytes":
        _check(m.vocab_size >= 256, f"data.tokenizer=bytes needs model.vocab_size >= 256, not {m.vocab_size}")


def _validate_train(cfg: Config) -> None:
    """The optimizer, schedule and batch settings."""
    p, t = cfg.parallel, cfg.train
    for name in ("steps", "micro_batch", "grad_acc"):
        _check(getattr(t, name) >= 1, f"train.{name}={getattr(t, name)} must be at least 1")
    _check(t.lr > 0, f"train.lr={t.lr} must be positive")
    _check(t.eps > 0, f"train.eps={t.eps} must be positive (AdamW divides by sqrt(v) + eps)")
    _check(0 <= t.seed < 2**63, f"train.seed={t.seed} must be in [0, 2**63)")
    _check(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _check(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    _check(t.decay_steps is None or t.decay_steps >= 1,
           f"train.decay_steps={t.decay_steps} must be at least 1 (or null: train.steps)")
    _check(0 < t.decay_fraction <= 1, f"train.decay_fraction={t.decay_fraction} must be in (0, 1]")
    _check(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0")
    _check(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1/beta2 must be in [0, 1)")
    _check(t.loss_chunk_tokens >= 0,
           f"train.loss_chunk_tokens={t.loss_chunk_tokens} must be >= 0 (0: the loss over all tokens at once)")
    _check(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    _check(p.max_restarts >= 0, f"parallel.max_restarts={p.max_restarts} must be >= 0")
    problem = compile_problem(p.device) if t.compile else None
    _check(problem is None, f"train.compile=true: {problem}; install it or set train.compile=false")


def _validate_optim(cfg: Config) -> None:
    """The optimizer: a known one; where it needs whole matrices, no tensor parallelism that splits them unless it
    gathers them itself (ZeRO keeps each whole on one rank for it); Muon's settings in range."""
    name, p = cfg.optim.name, cfg.parallel
    _check(name in OPTIMIZERS, f"optim.name={name!r}: unknown optimizer; use one of {', '.join(sorted(OPTIMIZERS))}")
    kind, o = OPTIMIZERS[name], cfg.optim
    _check(not kind.needs_whole_matrices or kind.gathers_tp_splits or p.tp == 1,
           f"optim.name={name} needs whole matrices, which tensor parallelism splits (parallel.tp={p.tp}); use tp=1")
    _check(0 <= o.muon_momentum < 1, f"optim.muon_momentum={o.muon_momentum} must be in [0, 1) (Muon's default: 0.95)")
    _check(1 <= o.muon_ns_steps < 100, f"optim.muon_ns_steps={o.muon_ns_steps} must be 1 to 99 (Muon's default: 5)")
    _check(len(o.muon_ns_coefficients) == 3 and all(math.isfinite(c) for c in o.muon_ns_coefficients),
           f"optim.muon_ns_coefficients={o.muon_ns_coefficients} must be three finite numbers a, b, c "
           f"(default: [3.4445, -4.775, 2.0315])")
    _check(o.muon_eps > 0, f"optim.muon_eps={o.muon_eps} must be > 0 (default: 1e-7)")
    if o.qk_clip_tau is not None:
        _check(o.qk_clip_tau > 0, f"optim.qk_clip_tau={o.qk_clip_tau} must be > 0 (Kimi-K2's: 100), or null: off")
        normed = [i for i in range(cfg.model.num_hidden_layers) if cfg.model.attention_options(i).qk_norm]
        # QK-norm rescales q and k after their projections: scaling the projections would not move a logit
        _check(not normed, f"optim.qk_clip_tau={o.qk_clip_tau}: model_type={cfg.model.model_type} norms q and k "
                           f"(QK-norm, which bounds the logits itself); use optim.qk_clip_tau=null")


def _validate_numbers(cfg: Config) -> None:
    """Every number finite (no nan or inf anywhere: a timeout of inf, an lr of nan)."""
    for section in ("model", "parallel", "data", "train", "optim", "logging", "checkpoint"):
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            values = value.items() if isinstance(value, dict) else [("", value)]
            for key, v in values:
                if isinstance(v, float) and not math.isfinite(v):  # the line built only then (the planner's
                    where = f"{section}.{f.name}" + (f".{key}" if key else "")  # search validates 10**4 configs)
                    raise ConfigError(f"{where}={v} must be a finite number")


def _validate_model(cfg: Config) -> None:
    """The model's settings that give every weight its meaning: positive, and token ids inside the vocabulary."""
    m = cfg.model
    for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
        _check(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be positive")
    _check(m.max_position_embeddings >= 1, f"model.max_position_embeddings={m.max_position_embeddings} must be >= 1")
    s = m.rope_scaling
    if s is not None and s["rope_type"] == "linear":  # Gemma 3's global layers (models/layer_types.py)
        _check(s["factor"] > 0, f"model.rope_scaling={s}: factor must be positive")
    elif s is not None and s["rope_type"] == "yarn":
        _check(s["factor"] > 0 and s["original_max_position_embeddings"] >= 1 and s["beta_fast"] > 0
               and s["beta_slow"] > 0, f"model.rope_scaling={s}: factor, beta_fast, beta_slow and "
               f"original_max_position_embeddings must be positive")
    elif s is not None:
        _check(s["factor"] > 0 and s["low_freq_factor"] > 0 and s["original_max_position_embeddings"] >= 1,
               f"model.rope_scaling={s}: factor, low_freq_factor and original_max_position_embeddings must be positive")
        _check(s["high_freq_factor"] > s["low_freq_factor"],
               f"model.rope_scaling={s}: high_freq_factor must be above low_freq_factor (llama3 divides by the gap)")
    for name in ("bos_token_id", "eos_token_id"):
        ids = getattr(m, name)
        for i in ids if isinstance(ids, list) else [] if ids is None else [ids]:
            _check(0 <= i < m.vocab_size, f"model.{name}={ids}: ids must be in [0, vocab_size={m.vocab_size})")


def _validate_moe(cfg: Config) -> None:
    """An MoE model trains in every layout (its mlp whole on every tp rank, its experts split by ep); only
    transformers' batch-wise auxiliary loss is refused where sequences are split over ranks."""
    m, p = cfg.model, cfg.parallel
    if not isinstance(m, MoeConfig):
        return
    split = f"cp={p.cp}" if p.cp > 1 else f"sp=true (tp={p.tp})" if p.sp and p.tp > 1 else None
    _check(m.moe_aux_loss == "sequence" or split is None,
           f"model.moe_aux_loss={m.moe_aux_loss} with parallel.{split}: transformers' formula over each forward's "
           f"batch is for comparing in one process; use moe_aux_loss=sequence")
    _check(m.moe_capacity_factor is None or m.moe_capacity_factor >= 0,
           f"model.moe_capacity_factor={m.moe_capacity_factor} must be >= 0 (0 or null: dropless)")
    for name in ("router_aux_loss_coef", "router_z_loss_coef", "moe_bias_update_rate", "routed_scaling_factor"):
        _check(getattr(m, name) >= 0, f"model.{name}={getattr(m, name)} must be >= 0")
    _check(m.moe_intermediate_size >= 1, f"model.moe_intermediate_size={m.moe_intermediate_size} must be >= 1")


def _validate_mtp(cfg: Config) -> None:
    """Multi-token prediction (models/mtp.py): its weight (it runs in every layout)."""
    w = cfg.train.mtp_loss_weight
    _check(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0,
           f"train.mtp_loss_weight={w} must be a finite number >= 0")


def _validate_experts(cfg: Config) -> None:
    """Expert parallelism: ep ranks carved out of dp*cp, each holding num_experts/ep experts of every MoE layer;
    what it has not been made to compose with is refused."""
    m, p = cfg.model, cfg.parallel
    _check(p.ep >= 1, f"parallel.ep={p.ep} must be at least 1")
    if p.ep == 1:
        return
    _check(isinstance(m, MoeConfig), f"parallel.ep={p.ep} splits the experts of an MoE model, and "
                                     f"model_type={m.model_type} has none; use ep=1")
    _check((p.dp * p.cp) % p.ep == 0, f"parallel.ep={p.ep} must divide dp*cp = {p.dp}*{p.cp} = {p.dp * p.cp} "
                                      f"(its ranks are carved out of them); use an ep that divides it")
    _check(m.num_experts % p.ep == 0, f"parallel.ep={p.ep} must divide model.num_experts={m.num_experts} "
                                      f"(each rank holds num_experts/ep of them); use an ep that divides it")
    _check(p.dp_shard is None or p.dp_shard % p.ep == 0, f"parallel.dp_shard={p.dp_shard} with ep={p.ep}: ep must "
           f"divide dp_shard (HSDP shards the experts over a shard group's ranks holding them, so it holds whole ep "
           f"groups); use a dp_shard that ep divides")


def _validate_observing(cfg: Config) -> None:
    """Validation data and schedule, the profiled steps, the W&B extra."""
    d, t, lg = cfg.data, cfg.train, cfg.logging
    _check(0 <= d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in [0, 1) (0: nothing held out)")
    _check(d.val_path is None or d.val_fraction == 0,
           f"data.val_path and data.val_fraction={d.val_fraction} both set: hold out one way, not both")
    _check(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0 (0: no validation)")
    _check(t.eval_batches >= 1, f"train.eval_batches={t.eval_batches} must be at least 1")
    _check(t.eval_every == 0 or d.val_path is not None or d.val_fraction > 0,
           f"train.eval_every={t.eval_every} needs held-out data: set data.val_fraction (e.g. 0.01) or data.val_path")
    validate_val_path(cfg)
    if lg.profile is not None:
        try:
            parse_steps(lg.profile)
        except ValueError as err:
            raise ConfigError(f"logging.profile={lg.profile!r}: {err} (e.g. --profile 5:7)") from None
    _check(lg.wandb is None or importlib.util.find_spec("wandb") is not None,
           f"logging.wandb={lg.wandb} needs the wandb package: pip install 'tetron[wandb]' (or unset logging.wandb)")


def idle_options(cfg: Config, given: set[str]) -> list[str]:
    """One note line for each option the user set (`given`: "section.key" names) that does nothing in this layout,
    so that none is silently ignored: what it would act on is absent (sp without tp, ZeRO over one rank), or another
    setting already does its work (RoPE is relative, so positions restarted within masked documents change
    nothing)."""
    p, t, d = cfg.parallel, cfg.train, cfg.data
    shards = p.dp_shard or p.dp * p.cp
    rules = (
        ("parallel.sp", p.sp and p.tp == 1, "parallel.sp=true does nothing at tp=1: sequence parallelism splits "
                                            "activations over the tp ranks"),
        ("parallel.cp_impl", p.cp == 1, f"parallel.cp_impl={p.cp_impl} does nothing at cp=1 (no context parallelism)"),
        ("parallel.cp_layout", p.cp == 1,
         f"parallel.cp_layout={p.cp_layout} does nothing at cp=1 (no context parallelism)"),
        ("parallel.pp_schedule", p.pp == 1, f"parallel.pp_schedule={p.pp_schedule} does nothing at pp=1 (no pipeline)"),
        ("parallel.zero", p.zero >= 1 and shards == 1,
         f"parallel.zero={p.zero} shards over {'dp_shard' if p.dp_shard else 'dp*cp'}=1 rank: nothing is sharded"),
        ("parallel.zero_accumulate", p.zero < 2 or t.grad_acc == 1,
         f"parallel.zero_accumulate={p.zero_accumulate} does nothing with "
         + (f"zero={p.zero} (it chooses how ZeRO-2/3 accumulate)" if p.zero < 2
            else "grad_acc=1 (it chooses how micro-batches accumulate)")),
        ("parallel.dp_shard", p.dp_shard is not None and p.dp_shard == p.dp * p.cp,
         f"parallel.dp_shard={p.dp_shard} is all of dp*cp: plain ZeRO, no replicas (the same as null)"),
        ("parallel.reduce_dtype", p.reduce_dtype != "float32" and p.dp * p.cp == 1,
         f"parallel.reduce_dtype={p.reduce_dtype} does nothing at dp*cp=1: no gradients are averaged"),
        ("data.reset_positions", d.reset_positions and d.mask_documents,
         "data.reset_positions=true does nothing with data.mask_documents=true: RoPE depends only on the distance "
         "between positions, and attention stays within each document"),
        ("train.eval_batches", t.eval_every == 0, "train.eval_batches does nothing with train.eval_every=0"),
    )
    return [note for field, idle, note in rules if field in given and idle]


def validate(cfg: Config, *, world_size: int | None = None, seen: FileChecks | None = None) -> None:
    """Every check that needs no process group; raises ConfigError with one line naming the field. `seen`: the
    filesystem checks' outcomes kept across calls (FileChecks); None: looked at every time."""
    if cfg.model is None:
        validate_no_model(cfg)
    _validate_numbers(cfg)
    _validate_model(cfg)
    _validate_moe(cfg)
    _validate_mtp(cfg)
    _validate_experts(cfg)
    _validate_layout(cfg, world_size)
    _validate_data(cfg, seen)
    _validate_train(cfg)
    _validate_optim(cfg)
    _validate_memory(cfg)
    validate_checkpoint(cfg)
    lg = cfg.logging
    _check(lg.log_every >= 1, f"logging.log_every={lg.log_every} must be at least 1")
    _check(lg.sample_tokens >= 0, f"logging.sample_tokens={lg.sample_tokens} must be >= 0")
    _check(math.isfinite(lg.sample_temperature) and lg.sample_temperature >= 0,
           f"logging.sample_temperature={lg.sample_temperature} must be a finite number >= 0 (0: greedy)")
    _check(lg.sample_top_k >= 0, f"logging.sample_top_k={lg.sample_top_k} must be >= 0 (0: no limit)")
    _check(lg.peak_tflops is None or lg.peak_tflops > 0, f"logging.peak_tflops={lg.peak_tflops} must be positive")
    _validate_observing(cfg)
    looked(("out", cfg.out), lambda: validate_out(cfg), seen)
