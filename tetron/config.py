"""Run configuration: typed dataclasses, loaded from YAML, overridden from the command line.

A config is built in three steps: the YAML file becomes a plain dict, command-line overrides (overrides.py) edit
that dict in the order given, and `from_dict` turns it into dataclasses (unknown keys are an error). `validate`
(validate.py) then checks all that can be checked before a process group starts: one `ConfigError` line each.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from tetron.errors import ConfigError, quoted, quoted_key
from tetron.fs import missing_reason, read_bounded
from tetron.models import config_from_hf, family
from tetron.models.llama import LlamaConfig
from tetron.overrides import apply_overrides, build_section, check_expansion, coerce, did_you_mean, read_yaml

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"

# Every choice a config field offers, in one place: the field's type says it, from_dict checks it.
PpSchedule = str  # a registered pipeline schedule (parallel/pipeline_schedules.py; validate.py checks the name)
DpImpl = Literal["naive", "bucket"]
CpLayout = Literal["zigzag", "contiguous"]
CpImpl = Literal["ring", "ulysses"]
DeviceKind = Literal["auto", "cpu", "cuda"]
Dtype = Literal["float32", "bfloat16"]
ZeroAccumulate = Literal["sharded", "full"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["cosine", "wsd", "constant"]
OnNonfinite = OnBadRecord = Literal["stop", "skip"]



@dataclass
class ParallelConfig:
    dp: int = 1  # data-parallel replicas
    tp: int = 1  # tensor-parallel ranks (within a node)
    pp: int = 1  # pipeline stages
    cp: int = 1  # context-parallel ranks (ring attention)
    ep: int = 1  # expert-parallel ranks, out of dp*cp (dividing it): each MoE layer's experts split over them
    pp_schedule: PpSchedule = "1f1b"  # pipeline schedule, one registered in parallel/pipeline_schedules.py: "afab" (all
    # forward, all backward), "1f1b", "interleaved", zero-bubble "zbh1" (1F1B's memory) and "zbv" (two chunks per
    # rank in a V; pp_virtual=2), or "dualpipev" (DeepSeek's DualPipeV: zbv's V; grad_acc >= 2*pp; pp_virtual=2)
    pp_virtual: int = 1  # virtual stages (layer chunks) per pipeline rank: above 1 with interleaved; 2 with zbv or
    # dualpipev
    pp_split: list[int] | None = None  # layers per pipeline stage (virtual-stage order); None: as even as possible
    cp_layout: CpLayout = "zigzag"  # the sequence over cp: "zigzag" (balanced for causal attention) or "contiguous"
    cp_impl: CpImpl = "ring"  # attention over cp: "ring" (P2P of k/v blocks, any cp) or "ulysses" (all-to-all to
    # heads; query heads per tp rank must be divisible by cp)
    sp: bool = False  # sequence parallelism: split activations outside attention/MLP along the sequence over tp
    sp_regather: bool = True  # with sp: each attention/MLP block keeps its input's sequence shard for the backward
    # and all-gathers it again there (Megatron's: 1/tp of the memory); false: keeps the gathered input (one
    # all-gather fewer per block and backward)
    vocab_pad_multiple: int = 1  # pad the vocabulary to a multiple of tp * this (64 or 128 speeds up GPU matmuls)
    dp_impl: DpImpl = "bucket"  # "naive": an all-reduce hook per parameter; "bucket": fp32 buckets, overlapped
    bucket_mb: float = 25.0  # gradient bucket size for dp_impl=bucket, in MB of fp32
    zero: int = 0  # ZeRO stage over dp*cp: 1 shards optimizer state, 2 also gradients, 3 also parameters
    reduce_dtype: Dtype = "float32"  # dtype gradients are averaged in over dp*cp (bfloat16 halves the traffic)
    zero_accumulate: ZeroAccumulate = "sharded"  # ZeRO-2/3 with grad_acc > 1: "sharded" reduce-scatters every
    # micro-batch into this rank's slice (gradients 1/dp_shard), "full" keeps whole buffers and reduces once a
    # step (fewer collectives, more memory); ZeRO-0/1 always keep whole buffers (ignored there)
    dp_shard: int | None = None  # HSDP: ZeRO's shard group, a divisor of dp*cp (replicated across groups); null: dp*cp
    device: DeviceKind = "auto"  # "cpu", "cuda" or "auto" (cuda when available)
    timeout_s: float = 600.0  # a collective that takes longer fails the run with an error
    max_restarts: int = 0  # the launcher restarts all ranks this many times after a failure (they resume "auto")
    ignore_memory_limit: bool = False  # start even when the predicted per-rank memory (tetron plan's model)
    # exceeds the device's, or on the CPU the machine's available memory (--force)


@dataclass
class DataConfig:
    path: str = "stdlib"  # file, folder, glob of .txt/.md/.py/.jsonl/.parquet, "stdlib", hf:NAME[[:CONFIG]:SPLIT],
    # or a token store folder (tetron tokenize)
    sources: list[dict[str, Any]] | None = None  # a mixture instead of path: [{path: STORE_OR_SPEC, weight: W,
    # epochs: E}], rows drawn by weight; a source leaves after `epochs` passes (optional; none: no limit)
    hash_contents: bool = False  # key the token cache of local files by their bytes, not their sizes and mtimes
    tokenizer: str | None = None  # "bytes", "bpe:N", a HF tokenizer folder or hub name; None (null, e.g.
    # --data.tokenizer=null): the tokenizer of the checkpoint or model folder the run starts from, else a token
    # store's, else "bytes" (a store's or init_from's also wins over a config file's, with a note; not over
    # --tokenizer)
    text_field: str = "text"  # the text column of .jsonl/.parquet/hf datasets
    max_bytes: int | None = None  # use only about this many bytes of text (a fixed prefix)
    seq_len: int = 256  # training sequence length in tokens
    cache_dir: str | None = None  # token and tokenizer cache; default ~/.cache/tetron
    on_bad_record: OnBadRecord = "stop"  # a record that cannot be read (bad JSON or UTF-8, no text): "stop" naming
    # its file and line or row, or "skip" it (the number skipped is said once)
    val_fraction: float = 0.0  # hold out the last fraction of data.path's windows for validation (never trained on)
    mask_documents: bool = False  # attention stays within each document of a packed window (the store's
    # document ends), instead of one causal sequence per window
    reset_positions: bool = False  # RoPE positions count from 0 at each document's start in a window
    val_path: str | None = None  # held-out text for validation, tokenized with the run's tokenizer (instead of
    # val_fraction); same forms as path


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    micro_batch: int = 8  # sequences per micro-batch per data-parallel rank
    grad_acc: int = 1  # micro-batches accumulated per optimizer step
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # the decay ends at lr * min_lr_ratio
    warmup_steps: int = 10  # linear warm-up from 0 to lr
    schedule: Schedule = "cosine"  # after warm-up: "cosine" decay, "wsd" (warmup-stable-decay) or "constant"
    decay_steps: int | None = None  # the step the decay ends at (its horizon); None: train.steps
    decay_fraction: float = 0.2  # wsd: the last fraction of decay_steps over which the lr decays
    weight_decay: float = 0.1  # AdamW decay, applied to matrices only
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon, added to the root of the second moment
    grad_clip: float = 1.0  # global gradient-norm clip; 0 disables
    seed: int = 0  # seeds the weights, the data order and the sampler
    dtype: Dtype = "float32"  # parameters for compute: "float32" or "bfloat16" (fp32 master weights, fp32 grads);
    # a config that sets none trains in bfloat16 on CUDA (tetron train and tetron slurm say so in a note)
    recompute: Recompute = "none"  # activation recomputation per decoder layer: "none", "selective" or "full"
    loss_chunk_tokens: int = 1024  # the head's matmul and the loss run over this many tokens at a time: only one
    # chunk's fp32 logits [chunk, vocab/tp] ever exist (1024 x 49152: 192 MiB); 0: all of a micro-batch's at once
    compile: bool = False  # torch.compile each decoder layer (regional compilation): faster steps on GPUs, a
    # slower start (a minute or so per distinct layer shape); off by default
    on_nonfinite: OnNonfinite = "stop"  # a NaN/inf loss: "stop" the run naming the step, or "skip" the step's update
    eval_every: int = 0  # validation loss (val_loss, val_ppl) every this many steps and at the last; 0: never
    eval_batches: int = 4  # global batches of held-out windows per validation (the same windows every time)
    mtp_loss_weight: float = 0.1  # weight w of multi-token prediction's loss (model.num_nextn_predict_layers > 0) in
    # the objective loss + w * mtp_loss (DeepSeek-V3 used 0.3, then 0.1)


@dataclass
class OptimConfig:
    name: str = "adamw"  # the optimizer (tetron/optim): "adamw" (its settings: train.lr, weight_decay, beta1/2, eps)
    # or "muon": Muon on the hidden matrices (experts' each on its own), AdamW on the rest (docs/optim.md)
    muon_momentum: float = 0.95  # Muon's momentum (torch.optim.Muon's `momentum`), in [0, 1)
    muon_nesterov: bool = True  # Nesterov momentum: orthogonalise grad + momentum * buffer, not the buffer
    muon_ns_steps: int = 5  # Newton-Schulz iterations per matrix and step (`ns_steps`), 1 to 99
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])  # the quintic
    # Newton-Schulz iteration's (a, b, c) (`ns_coefficients`; Keller Jordan's, as torch's default)
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the iteration's dtype: torch's bf16, or fp32 (exact
    # to fp32 rounding across layouts, whose reductions round differently; and on a CPU without bf16 matmuls faster)
    muon_eps: float = 1e-7  # floor of the Frobenius norm a matrix is divided by before the iteration (`eps`)
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"  # Muon's lr per matrix of
    # [A, B]: train.lr * 0.2 * sqrt(max(A, B)) (Moonlight's: AdamW's lr and weight decay carry over), or
    # train.lr * sqrt(max(1, A / B)) (Keller Jordan's); torch.optim.Muon's `adjust_lr_fn`
    qk_clip_tau: float | None = None  # QK-clip (Kimi-K2's MuonClip), with either optimizer: after each step, the q and
    # k weight rows of each kv-head group whose largest pre-softmax logit (scale * q.k, before soft-capping; sinks
    # apart) over the step's global batch exceeded this are scaled by sqrt(tau / max) each; max_attn_logit is logged
    # (docs/optim.md); null: off. Kimi-K2 used 100


@dataclass
class CheckpointConfig:
    save_every: int = 0  # save OUT/checkpoints/step_N every this many steps; 0: only at the end of the run
    keep: int = 3  # complete checkpoints kept (the oldest are deleted after each save)
    resume: str | None = None  # a checkpoint folder to continue from, or "auto": OUT's latest, if any
    init_from: str | None = None  # start from these weights: a Hugging Face model folder or hub name
    shard_mb: int = 2000  # largest safetensors shard in MB; a larger tensor gets a shard of its own
    async_save: bool = False  # copy the state off the training tensors; a thread writes it while training goes on
    new_tokenizer: bool = False  # start from weights with another tokenizer than the one they ship (ids change meaning)
    new_model_settings: bool = False  # start from weights trained with another rope_theta, rope_scaling or
    # rms_norm_eps (e.g. to extend the context), or an MoE model's other routing (scoring_func,
    # num_experts_per_tok, norm_topk_prob, n_group, topk_group, routed_scaling_factor); otherwise refused
    new_data: bool = False  # resume on other data than the checkpoint's (its data order does not continue)
    new_optimizer: bool = False  # resume with another optimizer (optim.name) than the checkpoint's: take its
    # weights and start the optimizer's state fresh; otherwise such a difference is refused
    overwrite: bool = False  # OUT holds an earlier run (metrics, checkpoints, model): rename it to OUT.old-N and
    # start anew; without this (or resume) such a folder is refused, never mixed with or replaced
    stop_signal: str | None = "SIGUSR1"  # besides SIGTERM and SIGINT, this signal makes a run finish its step,
    # save a checkpoint and exit 0 (Slurm: --signal=USR1@120); null: only those two


@dataclass
class LoggingConfig:
    log_every: int = 1  # progress-bar refresh and stdout line interval, in steps
    progress: bool = True  # print a progress bar on rank 0
    peak_tflops: float | None = None  # the device's peak TFLOP/s per rank, for MFU where not known
    sample_tokens: int = 120  # tokens generated from the trained model at the end; 0 disables
    sample_prompt: str = "def "  # the prompt of that sample
    sample_temperature: float = 0.8  # that sample's temperature (0: greedy); lower gives more typical text
    sample_top_k: int = 50  # that sample draws among the k likeliest tokens (0: all)
    tensorboard: bool = False  # also write every metric as TensorBoard events under OUT/tensorboard
    wandb: str | None = None  # also log every metric to this Weights & Biases project (pip install tetron[wandb])
    timers: bool = False  # per step, the time in compute and waiting on each axis' communication (max over ranks)
    profile: str | None = None  # torch.profiler traces of these steps, "A:B" (A to B) or "A", in OUT/profile/


@dataclass
class Config:
    model: LlamaConfig | None = None  # None: none given (validate refuses to train without one)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    out: str = "runs/default"  # the run folder: metrics.jsonl, tokenizer, final model

    @property
    def world_size(self) -> int:
        return self.parallel.dp * self.parallel.tp * self.parallel.pp * self.parallel.cp

    @property
    def global_batch(self) -> int:
        return self.train.micro_batch * self.train.grad_acc * self.parallel.dp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_model(spec: Any) -> LlamaConfig:
    """The model section: a name from configs/, a HF config.json or model folder, or a dict of fields
    (optionally with `name` giving the base they override)."""
    overrides: dict[str, Any] = {}
    if isinstance(spec, dict):
        overrides = dict(spec)
        spec = overrides.pop("name", None)
    base: dict[str, Any] = {}
    if spec is not None:
        if not isinstance(spec, str):
            raise ConfigError(f"model={spec!r}: give a name from configs/, a config.json path or a dict of fields")
        path = Path(spec).expanduser()
        named = CONFIGS_DIR / f"{spec}.yaml"
        if path.is_dir() or path.suffix == ".json":
            if not (path / "config.json" if path.is_dir() else path).is_file():
                raise ConfigError(f"model={spec}: no config.json there (give a Hugging Face model folder)")
            try:
                base = dataclasses.asdict(config_from_hf(path))
            except ValueError as err:
                raise ConfigError(f"model={spec}: {err}") from None
        elif named.is_file():
            section = (read_yaml(named.read_text()) or {}).get("model")
            if section is None:
                raise ConfigError(f"model={spec}: {named} has no model section")
            base = dataclasses.asdict(resolve_model(section))
        else:
            shaped = config_with_shape_of(spec)
            if shaped is not None:
                raise ConfigError(f"model={spec}: not a local folder; configs/{shaped}.yaml has its architecture: "
                                  f"--model {shaped} (or download the model's folder and give its path)")
            names = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
            raise ConfigError(f"model={spec}: unknown model; use one of {names} or a Hugging Face config.json/folder")
    base.update(overrides)
    model_type = base.get("model_type", "llama")
    try:
        config_class = family(model_type).config_class
    except ValueError as err:
        raise ConfigError(f"model.{err}") from None
    return build_section(config_class, base, "model")


def _source_numbers(data: DataConfig) -> DataConfig:
    """data.sources' weight and epochs as numbers, read like any float field: YAML 1.1 keeps `5e-1` as text."""
    if not data.sources:
        return data
    sources = [{**s, **{key: coerce(s[key], float, f"data.sources[{i}].{key}") for key in ("weight", "epochs")
                        if isinstance(s.get(key), str)}} if isinstance(s, dict) else s
               for i, s in enumerate(data.sources)]
    return dataclasses.replace(data, sources=sources)


def from_dict(raw: dict[str, Any]) -> Config:
    """Dataclasses from a raw dict; unknown keys and wrongly typed values raise ConfigError."""
    raw = dict(raw or {})
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(raw) - known, key=str)
    if unknown:
        near = did_you_mean(str(unknown[0]), sorted(known))
        raise ConfigError(f"{quoted_key(unknown[0])}: unknown section{near}; known sections are "
                          f"{', '.join(sorted(known))}")
    kwargs: dict[str, Any] = {name: build_section(cls, raw.get(name), name)
                              for name, cls in SECTIONS.items() if name != "model"}
    kwargs["data"] = _source_numbers(kwargs["data"])
    ck = kwargs["checkpoint"]
    # Without a model section, the model is the one a checkpoint or model folder to start from holds.
    source = ck.init_from if ck.resume in (None, "auto") else ck.resume
    if raw.get("model") is not None:
        kwargs["model"] = resolve_model(raw["model"])
    elif source and (Path(source).expanduser() / "config.json").is_file():
        kwargs["model"] = resolve_model(str(Path(source).expanduser()))
    if "out" in raw:
        kwargs["out"] = coerce(raw["out"], str, "out")
    return Config(**kwargs)


SECTIONS: dict[str, type] = {"model": LlamaConfig, "parallel": ParallelConfig, "data": DataConfig,
                             "train": TrainConfig, "optim": OptimConfig, "checkpoint": CheckpointConfig,
                             "logging": LoggingConfig}


def config_with_shape_of(hub_name: str) -> str | None:
    """The configs/ name whose first comment line names `hub_name` ("Llama-3-8B's shape
    (meta-llama/Meta-Llama-3-8B)"), compared without case; None when none does."""
    if "/" not in hub_name:
        return None
    for path in sorted(CONFIGS_DIR.glob("*.yaml")):
        first = path.read_text(encoding="utf-8").split("\n", 1)[0]
        if f"({hub_name.lower()})" in first.lower():
            return path.stem
    return None


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or start from defaults when path is None) and apply command-line overrides."""
    return from_dict(load_raw(path, overrides))


def load_raw(path: str | os.PathLike | None, overrides: list[str] = ()) -> dict[str, Any]:
    """The config as written (the YAML file's mapping, the overrides applied), before defaults and checks:
    what the user set, for the defaults that depend on the device (cuda_dtype)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file() and (CONFIGS_DIR / f"{path}.yaml").is_file():
            p = CONFIGS_DIR / f"{path}.yaml"
        if not p.is_file():
            raise ConfigError(f"config {path}: {missing_reason(p)} (give a YAML file or a name from configs/)")
        try:
            raw = read_yaml(read_bounded(p, 16 << 20).decode("utf-8")) or {}
        except ConfigError as err:  # a key given twice
            raise ConfigError(f"config {p}: {err}") from None
        except OSError as err:
            raise ConfigError(f"config {p}: cannot read ({err.strerror})") from None
        except RecursionError:
            raise ConfigError(f"config {p}: not valid YAML (nested too deeply)") from None
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ConfigError(f"config {p}: not valid YAML ({quoted(str(err).splitlines()[0])})") from None
        except ValueError:  # the YAML is valid, a value is not: an integer of over 4,300 digits
            raise ConfigError(f"config {p}: an integer of more than 4,300 digits; integer fields take at most "
                              f"19 (int64)") from None
        check_expansion(raw, f"config {p}")
        if not isinstance(raw, dict):
            raise ConfigError(f"config {p}: expected a mapping of sections at the top level")
    return apply_overrides(raw, list(overrides), sections=SECTIONS)


def is_set(raw: dict[str, Any], section: str, key: str) -> bool:
    """Whether the raw config (load_raw) sets `section.key`."""
    values = raw.get(section)
    return isinstance(values, dict) and key in values


def cuda_dtype(raw: dict[str, Any], *, device_type: str) -> str | None:
    """The dtype a run on `device_type` trains in when its config does not set train.dtype: bfloat16 on CUDA
    (tensor cores: fp32 would run at a fraction of the GPU's speed and hold twice the activations), else None
    (the field's default, float32, stands: the CPU has no fast bf16; nor does a dp_impl without the fp32
    buckets bf16 needs)."""
    train, parallel = raw.get("train"), raw.get("parallel")
    if device_type != "cuda" or not (train is None or isinstance(train, dict)) or is_set(raw, "train", "dtype"):
        return None  # (a train section that is no mapping is from_dict's to refuse)
    if isinstance(parallel, dict) and parallel.get("dp_impl", "bucket") != "bucket":
        return None  # bf16 lives in the fp32 gradient buckets: another dp_impl trains in fp32, as it says
    return "bfloat16"
