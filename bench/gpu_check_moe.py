"""The GPU check's mixture-of-experts rows (bench/gpu_check.py, section 4): tetron's experts by torch._grouped_mm
against its per-expert loop, and bench/moe.py's comparison with transformers' Qwen3MoeForCausalLM."""

from __future__ import annotations

from typing import Callable

import moe
import torch
from gpu_table import Row, Sizes, relative_error, verdict

from tetron.models.moe import Experts

# bench/moe.py's model on a GPU (its GPU_SIZES); on the CPU one tiny layer, a fraction of a second
MOE_TINY = dict(hidden=32, layers=1, experts=4, top_k=2, expert_width=32, seq=32, batch=2, vocab=256)


def check_grouped_experts(device: torch.device) -> list[Row]:
    """tetron's experts by torch._grouped_mm (Experts.grouped, what CUDA bf16 runs) against its per-expert loop,
    forward and backward (dx, d gate_up_proj, d down_proj), some experts empty; on the CPU in fp32 (the
    rows aligned as on CUDA, where tetron's CPU path leaves them in place)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    e, h, width, rows = (64, 1024, 512, 16384) if device.type == "cuda" else (5, 16, 8, 40)
    g = torch.Generator().manual_seed(0)
    experts = Experts(e, h, width)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * h ** -0.5)
    experts = experts.to(device, dtype)
    share = torch.rand(e, generator=g)
    share[[0, e // 2, e - 1]] = 0  # empty experts first, in the middle and last: where alignment could slip
    counts = torch.bincount(torch.multinomial(share, rows, replacement=True, generator=g), minlength=e).to(device)
    x, dout = (torch.randn(rows, h, generator=g).to(device, dtype) for _ in range(2))

    def run(fn: Callable) -> list[torch.Tensor]:
        leaf = x.clone().requires_grad_()
        out = fn(leaf, counts)
        out.backward(dout)
        grads = [leaf.grad, *(p.grad for p in experts.parameters())]
        experts.zero_grad(set_to_none=True)
        return [out.detach(), *grads]

    with moe.experts_path(grouped=False):
        want = run(experts)
    name = f"MoE experts grouped_mm vs per-expert loop {str(dtype)[6:]}, {e} experts, {rows} rows"
    try:
        got = run(experts.grouped)
    except (RuntimeError, NotImplementedError) as err:
        if device.type == "cuda":
            raise
        return [Row("correctness", name, status="skipped", note=f"torch._grouped_mm not on this CPU: {err}"[:120])]
    fwd, bwd = relative_error(got[0], want[0]), max(relative_error(a, b) for a, b in zip(got[1:], want[1:]))
    limit = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the two sum their products in other orders
    note = "" if device.type == "cuda" else "CPU: rows aligned as on CUDA (tetron's CPU path leaves them in place)"
    return [Row("correctness", f"{name} fwd", f"{fwd:.2e}", f"{limit:g}", verdict(fwd, limit), note),
            Row("correctness", f"{name} bwd (dx, dW)", f"{bwd:.2e}", f"{limit:g}", verdict(bwd, limit), note)]


def check_moe_models(sz: Sizes, device: torch.device) -> list[Row]:
    """bench/moe.py's comparison, forward and backward: tetron's Qwen3-MoE against transformers'
    Qwen3MoeForCausalLM (its default experts) on the same weights and batch, the loss first, then tokens/s;
    and tetron with its experts grouped against the loop (forced)."""
    dtype = torch.bfloat16 if sz.gpu else torch.float32
    s = moe.GPU_SIZES if sz.gpu else MOE_TINY
    r = moe.compare_models(s, device, dtype, rounds=3 if sz.gpu else 1, per_round=3 if sz.gpu else 1,
                           impls=(None,), block=False)
    times, losses = r["model"], r["losses"]
    hf = next(n for n in times if n.startswith("transformers"))
    forced = next(n for n in times if n.endswith("(forced)"))
    tps = {n: r["tokens"] / moe.median(t) for n, t in times.items()}
    grouped, loop = ("tetron", forced) if "loop" in forced else (forced, "tetron")
    err = max(abs(v - losses["tetron"]) / losses["tetron"] for v in losses.values())
    limit = 1e-5 if dtype == torch.float32 else 2e-2
    shape = (f"layers {s['layers']}, experts {s['experts']} (top-{s['top_k']}, width {s['expert_width']}), "
             f"hidden {s['hidden']}, batch {s['batch']}x{s['seq']}, {str(dtype)[6:]}")
    return [Row("correctness", f"MoE loss vs transformers Qwen3MoeForCausalLM ({device.type})", f"{err:.2e}",
                f"{limit:g}", verdict(err, limit), f"largest relative difference over {len(losses)} models; {shape}"),
            Row("speed", "MoE tetron vs transformers Qwen3MoeForCausalLM", f"{tps['tetron'] / tps[hf]:.2f}x", "",
                "info", f"fwd+bwd tok/s: tetron {tps['tetron']:,.0f}, {hf} {tps[hf]:,.0f}; {shape}"),
            Row("speed", "MoE tetron experts grouped_mm vs per-expert loop", f"{tps[grouped] / tps[loop]:.2f}x", "",
                "info", f"fwd+bwd tok/s: grouped {tps[grouped]:,.0f}, loop {tps[loop]:,.0f}")]
