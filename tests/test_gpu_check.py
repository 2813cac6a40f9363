"""bench/gpu_check.py keeps working where CI runs: its CPU mode (tiny sizes) end to end, and its table."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cpu_mode_prints_one_passing_table():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu", "--skip-compile", "--budget-s", "300"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("tetron GPU check") and "cpu" in lines[0]
    assert lines[1].startswith("section") and set(lines[2]) <= {"-", "+"}  # the header, then the rule
    rows = [[cell.strip() for cell in line.split("|")] for line in lines[3:] if " | " in line]
    checks = {(r[0], r[1]): r[4] for r in rows}  # (section, check) -> status
    assert checks[("correctness", "logits vs transformers (cpu, fp32, TF32 off)")] == "ok"
    for dtype in ("float32", "bfloat16"):
        for kind in ("causal T=40x40", "full T=40x60"):
            for part in ("fwd (out, lse)", "bwd (dq, dk, dv)"):
                assert checks[("correctness", f"block attention cpu_flash {dtype} {kind} {part}")] == "ok"
    assert checks[("correctness", "bf16 training on cpu vs fp32 on cpu, 6 steps")] == "ok"
    assert checks[("correctness", "CUDA RNG state saved and restored")] == "skipped"
    grouped = "MoE experts grouped_mm vs per-expert loop float32, 5 experts, 40 rows"
    assert checks[("correctness", f"{grouped} fwd")] == checks[("correctness", f"{grouped} bwd (dx, dW)")] == "ok"
    assert checks[("correctness", "MoE loss vs transformers Qwen3MoeForCausalLM (cpu)")] == "ok"
    assert checks[("speed", "MoE tetron vs transformers Qwen3MoeForCausalLM")] == "info"
    assert checks[("speed", "MoE tetron experts grouped_mm vs per-expert loop")] == "info"
    for mode in ("none", "selective", "full"):
        assert checks[("speed", f"tiny eager recompute={mode}")] == "info"
        assert checks[("memory", f"tiny eager recompute={mode}")] == "skipped"
    assert "GPU figures were not measured" in proc.stdout
    assert lines[-1] == f"{len(rows)} rows, 0 failed or in error"


def test_a_failing_row_is_reported_and_the_rest_run():
    gc = _load()
    table = gc.Table()

    def broken():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    table.guarded("speed", "smollm-1.7b eager recompute=none", broken)
    table.guarded("speed", "next", lambda: [gc.Row("speed", "next", "1 tok/s", status="info")])
    assert [(r.check, r.status) for r in table.rows] == [("smollm-1.7b eager recompute=none", "error"),
                                                         ("next", "info")]
    assert table.rows[0].note == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert gc.verdict(1e-5, 1e-4) == "ok" and gc.verdict(2e-4, 1e-4) == "FAIL"


def test_speed_rows_run_most_telling_first():
    gc = _load()
    cases = gc.cases_by_priority(gc.sizes(True), skip_compile=False)
    assert len(cases) == len(set(cases)) == 12  # 2 models x eager/compiled x 3 recompute modes
    assert cases[:2] == [gc.Case("smollm-1.7b", False, "none"), gc.Case("smollm-1.7b", True, "none")]
    assert not any(c.compile for c in gc.cases_by_priority(gc.sizes(True), skip_compile=True))
    on_cpu = gc.cases_by_priority(gc.sizes(False), skip_compile=False)
    assert [c for c in on_cpu if c.compile] == [gc.Case("tiny", True, "selective")]


def test_known_noise_is_quiet_and_real_warnings_are_not():
    """Inductor's TF32 advice (the GPU check turns TF32 off for its fp32 checks, then compiles bf16 runs) is
    silenced; any other warning still shows."""
    import warnings

    gpu_check = _load()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpu_check.quiet_known_noise()
        advice = gpu_check.TF32_ADVICE + ". Consider setting `torch.set_float32_matmul_precision('high')`"
        warnings.warn(advice, stacklevel=1)
        warnings.warn("a real problem", stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real problem"]
