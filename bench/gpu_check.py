"""The GPU check (`make gpu-check`): on one CUDA GPU, in under 8 minutes, one table of
  1. correctness on the GPU: the model's logits against transformers' LlamaForCausalLM (fp32, TF32 off),
     each fused block-attention kernel against the plain-math reference (forward with its log-sum-exp,
     and backward; causal and not; fp32 and bf16), bf16 training against the fp32 run on the CPU;
  2. speed: single-GPU training of SmolLM-360M and SmolLM-1.7B at seq 2048 in bf16, eager and compiled,
     with each recompute mode, the micro-batch the memory model says fits: tokens/s, MFU, peak memory;
  3. the memory model: tetron plan's predicted peak against torch.cuda.max_memory_allocated;
  4. mixture of experts: the experts by torch._grouped_mm against the per-expert loop (bf16, forward and
     backward), and bench/moe.py's model (64 experts, top-8) against transformers' Qwen3MoeForCausalLM: the
     same loss, then tokens/s, and tetron's grouped experts against its loop.
Without CUDA the same checks run at tiny sizes on the CPU in seconds, and the table says that the GPU
figures were not measured. Everything runs in this process through tetron's Python API (a process group
of one rank). A failing row prints its error in the table and the others still run; rows that would
overrun the time budget are skipped, most important first. Needs no network: data `stdlib`, tokenizer
`bytes`. Run from a checkout: `PYTHONPATH=. python3 -m bench.gpu_check` (or `python3 bench/gpu_check.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s modules by name, run by path or with -m

from gpu_check_moe import check_grouped_experts, check_moe_models  # noqa: E402
from gpu_table import Row, Sizes, Table, relative_error, sizes, verdict  # noqa: E402

from tetron import device as dev
from tetron.config import CONFIGS_DIR, from_dict
from tetron.mesh import Mesh
from tetron.models.attention import Documents, document_attention, document_mask
from tetron.models.llama import Llama, LlamaConfig
from tetron.observe.metrics import mfu
from tetron.parallel.block_attention import _math_block, _math_block_backward, block_attention, block_attention_backward
from tetron.parallel.compile import reset_compiled
from tetron.plan.memory import predict
from tetron.train import build_run, dispatch_step, next_batch, read_back, save, train_step
from tetron.validate import validate

# ------------------------------------------------------------------------------------------ 1. correctness


def check_logits(sz: Sizes, device: torch.device) -> list[Row]:
    """tetron's Llama and transformers' on the same weights, fp32 with TF32 off: logits within 1e-4."""
    import transformers

    cfg = LlamaConfig(**sz.logits_model)
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf())
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # weights of O(1) effect, so a wrong op shows in the logits
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.05)
    ours = Llama(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf, ours = hf.to(device), ours.to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_position_embeddings), generator=g).to(device)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = ours(ids)
    err = float((got - want).abs().max())
    return [Row("correctness", f"logits vs transformers ({device.type}, fp32, TF32 off)", f"{err:.2e}", "1e-4",
                verdict(err, 1e-4), f"max |diff|, logits up to {float(want.abs().max()):.1f}")]


def check_block(device: torch.device, dtype: torch.dtype, kernel: str, causal: bool,
                shape: tuple[int, int, int, int]) -> list[Row]:
    """One fused kernel against the math reference: (out, lse), then each one's backward from its own."""
    b, h, t, d = shape
    tk = t if causal else t + t // 2  # a ring block off the diagonal can have more keys than queries
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(b, h, t, d, generator=g, device=device).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, h, tk, d, generator=g, device=device).to(dtype) for _ in range(2))
    out, lse = block_attention(q, k, v, causal, kernel=kernel)
    ref_out, ref_lse = _math_block(q, k, v, causal)
    grads = block_attention_backward(dout, q, k, v, out, lse, causal, kernel=kernel)
    ref_grads = _math_block_backward(dout, q, k, v, ref_out, ref_lse, causal)
    fwd = max(relative_error(out, ref_out), float((lse - ref_lse).abs().max()))
    bwd = max(relative_error(a, w) for a, w in zip(grads, ref_grads))
    limit = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: 8 mantissa bits, a few roundings
    name = f"block attention {kernel} {str(dtype)[6:]} {'causal' if causal else 'full'} T={t}x{tk}"
    return [Row("correctness", f"{name} fwd (out, lse)", f"{fwd:.2e}", f"{limit:g}", verdict(fwd, limit)),
            Row("correctness", f"{name} bwd (dq, dk, dv)", f"{bwd:.2e}", f"{limit:g}", verdict(bwd, limit))]


def check_documents(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> list[Row]:
    """Attention kept within packed documents (data.mask_documents: the fused kernel that takes a mask,
    attention.document_attention) against the math reference with the same mask, forward and backward."""
    b, h, t, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, t, d, generator=g, device=device).to(dtype) for _ in range(4))
    ids = (torch.rand(b, t, generator=g, device=device) < 4 / t).long().cumsum(dim=1)  # ~4 documents a row
    pos = torch.arange(t, device=device)
    mask = document_mask(ids, pos, pos)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = document_attention(*leaves, Documents(ids))
    out.backward(dout)
    ref_out, ref_lse = _math_block(q, k, v, False, mask)
    ref_grads = _math_block_backward(dout, q, k, v, ref_out, ref_lse, False, mask)
    fwd, bwd = relative_error(out, ref_out), max(relative_error(x.grad, w) for x, w in zip(leaves, ref_grads))
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    name = f"document-masked attention {str(dtype)[6:]} T={t}"
    return [Row("correctness", f"{name} fwd", f"{fwd:.2e}", f"{limit:g}", verdict(fwd, limit)),
            Row("correctness", f"{name} bwd (dq, dk, dv)", f"{bwd:.2e}", f"{limit:g}", verdict(bwd, limit))]


def block_cases(device: torch.device, head_dim: int) -> list[tuple[torch.dtype, str]]:
    """(dtype, kernel) pairs to check: what device.py picks for fp32 and bf16, and on CUDA the efficient
    kernel in bf16 too (the fallback where flash is not built or not supported)."""
    cases = [(dt, dev.attention_kernel(device, dt, head_dim)) for dt in (torch.float32, torch.bfloat16)]
    if device.type == "cuda" and (torch.bfloat16, "efficient") not in cases:
        cases.append((torch.bfloat16, "efficient"))
    return cases


def data_bytes(sz: Sizes) -> int:
    """One prefix of the standard library's text for every run, so that it is tokenized once: enough
    windows for the largest speed row (16 x 2049 tokens x 8 steps) on a GPU."""
    return 8_000_000 if sz.gpu else 500_000


def small_run_config(sz: Sizes, out: Path, cache: Path, *, device: str, dtype: str, steps: int) -> dict:
    return {"model": sz.small_model,
            "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": sz.small_model["max_position_embeddings"],
                     "max_bytes": data_bytes(sz), "cache_dir": str(cache)},
            "train": {"steps": steps, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 2, "seed": 0, "dtype": dtype},
            "parallel": {"device": device}, "logging": {"progress": False, "sample_tokens": 0}, "out": str(out)}


def train_losses(raw: dict, device: torch.device) -> list[float]:
    cfg = from_dict(raw)
    validate(cfg)
    run = build_run(cfg, Mesh(device_type=device.type), device)
    return [train_step(run, step).loss for step in range(cfg.train.steps)]


def check_bf16_training(sz: Sizes, device: torch.device, work: Path) -> list[Row]:
    """bf16 on the device (fp32 master weights and gradients) tracks the fp32 run on the CPU."""
    steps, cpu = sz.small_steps, torch.device("cpu")
    ref = train_losses(small_run_config(sz, work / "fp32", work / "cache", device="cpu", dtype="float32",
                                        steps=steps), cpu)
    got = train_losses(small_run_config(sz, work / "bf16", work / "cache", device=device.type, dtype="bfloat16",
                                        steps=steps), device)
    worst = max(abs(a - b) / b for a, b in zip(got, ref))
    return [Row("correctness", f"bf16 training on {device.type} vs fp32 on cpu, {steps} steps", f"{worst:.2e}",
                "3e-2", verdict(worst, 3e-2),
                f"max relative loss difference; loss {ref[0]:.3f} -> {ref[-1]:.3f} (fp32), {got[-1]:.3f} (bf16)")]


def check_rng_resume(sz: Sizes, device: torch.device, work: Path) -> list[Row]:
    """A checkpoint holds the CUDA generator's state and a resume restores it."""
    if device.type != "cuda":
        return [Row("correctness", "CUDA RNG state saved and restored", status="skipped", note="no CUDA here")]
    raw = small_run_config(sz, work / "rng", work / "cache", device="cuda", dtype="bfloat16", steps=2)
    cfg = from_dict(raw)
    run = build_run(cfg, Mesh(device_type="cuda"), device)
    for step in range(2):
        train_step(run, step)
    torch.rand(7, device=device)  # move the generator off its seeded start
    saved = dev.rng_state(device).clone()
    save(run)
    torch.cuda.manual_seed(12345)
    resumed = from_dict({**raw, "checkpoint": {"resume": "auto"}})
    build_run(resumed, Mesh(device_type="cuda"), device)
    same = bool(torch.equal(dev.rng_state(device), saved))
    return [Row("correctness", "CUDA RNG state saved and restored", str(same), "True", "ok" if same else "FAIL")]


def check_host_syncs(sz: Sizes, device: torch.device, work: Path) -> list[Row]:
    """A dispatched step makes the host wait for the device nowhere (torch's sync debug mode counts each
    wait as a warning); the read-back every logging.log_every steps is the one wait."""
    if device.type != "cuda":
        return [Row("correctness", "host waits per dispatched step", status="skipped", note="no CUDA here")]
    raw = small_run_config(sz, work / "syncs", work / "cache", device="cuda", dtype="bfloat16", steps=4)
    run = build_run(from_dict(raw), Mesh(device_type="cuda"), device)
    pending = [dispatch_step(run, 0, next_batch(run))]  # the first step allocates the moments: not counted
    read_back(pending)
    waits: list[str] = []  # where each wait was asked for: the innermost line of tetron's (or bench/'s) code
    counting = [False]  # not while set_sync_debug_mode itself runs: torch 2.11's warns from inside it once

    def record(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if counting[0] and "synchroniz" in str(message):
            ours = [f for f in traceback.extract_stack()[:-1] if "/tetron/" in f.filename or "/bench/" in f.filename]
            waits.append(f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours else "?")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # called as the warning is raised, so the stack is the waiting code's
        torch.cuda.set_sync_debug_mode("warn")
        counting[0] = True
        try:
            pending = [dispatch_step(run, step, next_batch(run)) for step in range(1, 4)]
        finally:
            counting[0] = False
            torch.cuda.set_sync_debug_mode("default")
    read_back(pending)
    return [Row("correctness", "host waits in 3 dispatched steps", str(len(waits)), "0", "ok" if not waits else "FAIL",
                "torch.cuda.set_sync_debug_mode('warn') over dispatch_step and next_batch"
                + (f"; at {', '.join(sorted(set(waits)))}" if waits else ""))]


def correctness(table: Table, sz: Sizes, device: torch.device, work: Path) -> None:
    table.guarded("correctness", "logits vs transformers", lambda: check_logits(sz, device))
    d = sz.attention[-1]
    for dtype, kernel in block_cases(device, d):
        for causal in (True, False):
            table.guarded("correctness", f"block attention {kernel} {dtype}",
                          functools.partial(check_block, device, dtype, kernel, causal, sz.attention))
    for dtype in (torch.float32, torch.bfloat16):
        table.guarded("correctness", f"document-masked attention {dtype}",
                      functools.partial(check_documents, device, dtype, sz.attention))
    table.guarded("correctness", "bf16 training", lambda: check_bf16_training(sz, device, work))
    table.guarded("correctness", "CUDA RNG state", lambda: check_rng_resume(sz, device, work))
    table.guarded("correctness", "host waits per step", lambda: check_host_syncs(sz, device, work))


# ------------------------------------------------------------------------------------------ 2. speed, 3. memory


@dataclass(frozen=True)
class Case:
    model: str  # a configs/ name, or "tiny" on the CPU
    compile: bool
    recompute: str


def cases_by_priority(sz: Sizes, *, skip_compile: bool) -> list[Case]:
    """Every speed row, most telling first: within the time budget the later ones may be skipped. The
    largest model eager and compiled without recompute first, then the smaller, then the recompute modes."""
    models = sz.speed_models[::-1]  # the largest first
    order = [Case(m, c, "none") for m in models for c in (False, True)]
    order += [Case(m, False, r) for m in models for r in ("selective", "full")]
    order += [Case(m, True, r) for m in models for r in ("selective", "full")]
    return [c for c in order if not c.compile or (not skip_compile and c.recompute in sz.compiled_modes)]


def speed_config(sz: Sizes, case: Case, micro_batch: int, work: Path, device: torch.device) -> dict:
    if case.model == "tiny":
        model: Any = {**sz.small_model, "max_position_embeddings": sz.seq}
    else:
        model = yaml.safe_load((CONFIGS_DIR / f"{case.model}.yaml").read_text())["model"]
    steps = sz.warmup + sz.timed
    return {"model": model,
            # one text prefix for every row, so the bytes are tokenized once
            "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": sz.seq, "max_bytes": data_bytes(sz),
                     "cache_dir": str(work / "cache")},
            "train": {"steps": steps, "micro_batch": micro_batch, "grad_acc": 1, "lr": 3e-4, "warmup_steps": 1,
                      "dtype": "bfloat16", "recompute": case.recompute, "compile": case.compile},
            "parallel": {"device": device.type}, "logging": {"progress": False, "sample_tokens": 0},
            "out": str(work / f"speed-{case.model}-{case.compile}-{case.recompute}")}


MICRO_BATCHES = (16, 8, 4, 2, 1)  # above 16 x 2048 tokens a step gains little and costs memory and time
GPU_HEADROOM = 0.85  # of the memory the model may plan to use: the allocator's fragmentation, the context


def choose_micro_batch(sz: Sizes, case: Case, work: Path, device: torch.device) -> tuple[int, int]:
    """The largest micro-batch whose predicted peak (tetron plan's memory model) fits the GPU with
    headroom: (micro_batch, predicted bytes). On the CPU: 2."""
    if not sz.gpu:
        mb = 2
        return mb, predict(from_dict(speed_config(sz, case, mb, work, device))).total
    total = torch.cuda.get_device_properties(device).total_memory
    for mb in MICRO_BATCHES:
        predicted = predict(from_dict(speed_config(sz, case, mb, work, device))).total
        if predicted <= GPU_HEADROOM * total:
            return mb, predicted
    raise RuntimeError(f"even micro-batch 1 is predicted at {predicted / 2**30:.1f} GiB, more than "
                       f"{GPU_HEADROOM:.0%} of {total / 2**30:.0f} GiB")


@dataclass
class Measured:
    case: Case
    micro_batch: int
    predicted: int
    tokens_per_s: float
    mfu: float | None
    peak_mb: float
    first_step_s: float
    held_before_mb: float  # allocated before the run was built: what earlier cases failed to free


def measure(sz: Sizes, case: Case, work: Path, device: torch.device) -> Measured:
    """Train `case` for warm-up + timed steps in this process; median of the timed steps."""
    mb, predicted = choose_micro_batch(sz, case, work, device)
    cfg = from_dict(speed_config(sz, case, mb, work, device))
    validate(cfg)
    held = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    run = build_run(cfg, Mesh(device_type=device.type), device)
    times, peaks = [], []
    for step in range(cfg.train.steps):
        figures = train_step(run, step)
        times.append(figures.time_s)
        peaks.append(dev.peak_memory_mb(device))  # this step's: train_step resets the peak as it starts
    timed = times[sz.warmup:]
    tokens_per_s = mb * sz.seq / statistics.median(timed)
    peak = dev.peak_tflops(device, torch.bfloat16)
    return Measured(case, mb, predicted, tokens_per_s,
                    mfu(tokens_per_s, cfg.model.flops_per_token(sz.seq), peak_tflops=peak, world_size=1),
                    max(peaks[sz.warmup:]), times[0], held)


def case_name(case: Case) -> str:
    return f"{case.model} {'compiled' if case.compile else 'eager'} recompute={case.recompute}"


def speed_rows(m: Measured, sz: Sizes) -> list[Row]:
    mfu_text = f"{m.mfu:.1%}" if m.mfu is not None else "n/a"
    note = (f"micro-batch {m.micro_batch} x {sz.seq}, median of {sz.timed} steps after {sz.warmup} "
            f"(first step {m.first_step_s:.1f} s), peak {m.peak_mb / 1024:.1f} GiB")
    return [Row("speed", case_name(m.case), f"{m.tokens_per_s:,.0f} tok/s", "", "info", f"MFU {mfu_text}; {note}")]


def memory_rows(m: Measured, sz: Sizes) -> list[Row]:
    """Predicted against measured: max_memory_allocated on a GPU; on the CPU there is no such figure (the
    process's resident set holds far more than tensors)."""
    name, pred = case_name(m.case), m.predicted / 2**30
    if not sz.gpu:
        return [Row("memory", name, f"predicted {pred:.3f} GiB", "", "skipped", "not measured on the CPU")]
    measured = m.peak_mb / 1024
    ratio = measured / pred
    # The model predicts eager PyTorch; compiled code fuses element-wise work and holds less.
    status = "info" if m.case.compile else ("ok" if 0.7 <= ratio <= 1.1 else "FAIL")
    held = f"; {m.held_before_mb / 1024:.1f} GiB held before the run" if m.held_before_mb >= 1024 else ""
    return [Row("memory", name, f"{measured:.1f} / {pred:.1f} GiB", "0.7-1.1", status,
                f"measured / predicted = {ratio:.2f}{held}")]


def speed_and_memory(table: Table, sz: Sizes, device: torch.device, work: Path, *, deadline: float,
                     skip_compile: bool) -> None:
    """Each case within the time budget: a speed row and a memory row, or the error, or 'skipped'."""
    cost = {False: 20.0 if sz.gpu else 2.0, True: 120.0 if sz.gpu else 30.0}  # seconds a row is expected to take
    results: dict[Case, list[Row]] = {}
    for case in cases_by_priority(sz, skip_compile=skip_compile):
        if time.monotonic() + cost[case.compile] > deadline:
            results[case] = [Row("speed", case_name(case), status="skipped", note="time budget")]
            continue
        start = time.monotonic()
        rows: list[Row] = []

        def one(case: Case = case) -> list[Row]:
            m = measure(sz, case, work, device)
            return speed_rows(m, sz) + memory_rows(m, sz)

        sub = Table()
        sub.guarded("speed", case_name(case), one)
        rows = sub.rows
        results[case] = rows
        cost[case.compile] = max(cost[case.compile], time.monotonic() - start)
        reset_compiled()
        gc.collect()
        dev.empty_cache(device)
    ordered = sorted(results, key=lambda c: (c.model, c.compile, ("none", "selective", "full").index(c.recompute)))
    for section in ("speed", "memory"):
        for case in ordered:
            table.rows += [row for row in results[case] if row.section == section]


# ------------------------------------------------------------------------------------------ main


def header(device: torch.device) -> str:
    import platform

    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    peak = dev.peak_tflops(device, torch.bfloat16)
    return (f"tetron GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {dev.device_name(device)}"
            f"{f' (dense bf16 peak {peak:g} TFLOP/s)' if peak else ''}, torch {torch.__version__}, "
            f"transformers {hf}, Python {platform.python_version()}")


def start_group(device: torch.device) -> None:
    """A process group of one rank: gloo for CPU tensors, NCCL for CUDA ones (the CPU reference run and the
    GPU runs share it)."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# What Inductor says at the first compiled speed row, on any GPU from Ampere on, because TF32 is off above:
# advice for fp32 matmuls, which the bf16 speed rows do not run. The fp32 checks keep it off on purpose.
TF32_ADVICE = "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"


def quiet_known_noise() -> None:
    """Silence the warnings that are no news here (TF32_ADVICE), and no other: a real warning still shows."""
    warnings.filterwarnings("ignore", message=re.escape(TF32_ADVICE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="stop starting speed rows when this many seconds would be exceeded (default 450)")
    parser.add_argument("--cpu", action="store_true", help="the CPU mode (tiny sizes) even where CUDA is available")
    parser.add_argument("--skip-compile", action="store_true", help="no compiled speed rows (a fast CPU run)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    gpu = torch.cuda.is_available() and not args.cpu
    device = dev.pick_device("cuda" if gpu else "cpu", 0)
    # fp32 means fp32: the logits and kernel checks compare against references at full precision, and MFU
    # counts fp32 matmuls against the peak of the units they run on (device.peak_tflops)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    quiet_known_noise()
    sz = sizes(gpu)
    print(header(device), flush=True)
    table = Table()
    start_group(device)
    try:  # tetron's own lines (model size, data) go to stderr with the progress: stdout holds the table
        with tempfile.TemporaryDirectory(prefix="tetron-gpu-check-") as tmp, contextlib.redirect_stdout(sys.stderr):
            work = Path(tmp)
            correctness(table, sz, device, work)
            table.guarded("correctness", "MoE experts grouped_mm vs loop", lambda: check_grouped_experts(device))
            table.guarded("speed", "MoE models", lambda: check_moe_models(sz, device))
            speed_and_memory(table, sz, device, work, deadline=deadline, skip_compile=args.skip_compile)
    finally:
        dist.destroy_process_group()
    print(table.render())
    if not gpu:
        print("GPU figures were not measured: no CUDA device was used (CPU mode, tiny sizes); run `make gpu-check` "
              "on a machine with a GPU.")
    failed = [r for r in table.rows if r.status in ("FAIL", "error")]
    print(f"{len(table.rows)} rows, {len(failed)} failed or in error", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
