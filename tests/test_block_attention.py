"""One block of attention with its log-sum-exp: the kernel choice, and every kernel this machine can run
against the plain-math reference (the CUDA kernels' numbers are checked by bench/gpu_check.py on a GPU;
here their calls are checked against torch's own shape rules on the meta device)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tetron import device as dev
from tetron.parallel.block_attention import (
    _math_block,
    _math_block_backward,
    block_attention,
    block_attention_backward,
)

# bf16 keeps 8 bits of mantissa: ~4e-3 relative per rounding, a few roundings per output
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}


def _inputs(dtype: torch.dtype, tq: int, tk: int, *, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, tq, 16), (2, 3, tk, 16), (2, 3, tk, 16), (2, 3, tq, 16)]  # q, k, v, dout
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def test_kernel_choice():
    cpu = torch.device("cpu")
    assert dev.attention_kernel(cpu, torch.float32, 64) == "cpu_flash"
    assert dev.attention_kernel(cpu, torch.bfloat16, 64) == "cpu_flash"
    # a device without a fused kernel of its own: the math path
    assert dev.attention_kernel(torch.device("meta"), torch.bfloat16, 64) == "math"


def test_peak_table_counts_tf32_only_when_enabled():
    assert dev._peak_for("H200", torch.bfloat16, tf32=False) == 989.0
    assert dev._peak_for("H100", torch.float16, tf32=True) == 989.0
    assert dev._peak_for("H100", torch.float32, tf32=False) == 67.0  # CUDA cores
    assert dev._peak_for("H100", torch.float32, tf32=True) == 494.5  # TF32 tensor cores: half of bf16
    assert dev._peak_for("A100", torch.float32, tf32=False) == 19.5
    assert set(dev._PEAK_TFLOPS_FP32) == set(dev._PEAK_TFLOPS_BF16)
    assert dev.peak_tflops(torch.device("cpu"), torch.float32) is None
    assert dev.tf32_matmuls() is False  # torch's default, which tetron keeps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal, tq, tk", [(True, 24, 24), (False, 24, 40), (False, 8, 16)])
def test_fused_cpu_kernel_matches_math(dtype, causal, tq, tk):
    """Forward (out, lse) and backward, each kernel's backward fed by either kernel's forward."""
    q, k, v, dout = _inputs(dtype, tq, tk)
    fused = block_attention(q, k, v, causal, kernel="cpu_flash")
    math = _math_block(q, k, v, causal)
    assert block_attention(q, k, v, causal)[0].equal(fused[0])  # the CPU's choice is the fused kernel
    assert fused[1].dtype == math[1].dtype == torch.float32 and fused[1].shape == (2, 3, tq)
    torch.testing.assert_close(fused[0], math[0], **TOL[dtype])
    torch.testing.assert_close(fused[1], math[1], rtol=1e-4, atol=1e-4 if dtype == torch.float32 else 2e-2)
    for out, lse in (fused, math):
        got = block_attention_backward(dout, q, k, v, out, lse, causal, kernel="cpu_flash")
        want = _math_block_backward(dout, q, k, v, out, lse, causal)
        for name, a, b in zip("qkv", got, want):
            assert a.dtype == dtype
            torch.testing.assert_close(a, b, **TOL[dtype], msg=f"d{name}")


@pytest.mark.parametrize("causal", [True, False])
def test_math_block_is_attention(causal):
    """The reference itself against autograd through scaled_dot_product_attention, in fp64."""
    q, k, v, dout = _inputs(torch.float64, 12, 12, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    ref.backward(dout)
    out, lse = _math_block(q, k, v, causal)
    # _math_block computes in fp32 whatever the input
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    for got, leaf in zip(_math_block_backward(dout, q, k, v, out, lse, causal), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernel_calls_match_torch_signatures(kernel, causal):
    """The CUDA kernels' calls, run through torch's meta kernels: arguments accepted, shapes and dtypes
    right, the efficient kernel's padded lse cut to [B, H, Tq] and padded again for its backward."""
    meta = torch.device("meta")
    q = torch.empty(2, 4, 40, 64, device=meta, dtype=torch.bfloat16)  # 40: not a multiple of 32
    k = torch.empty(2, 4, 24 if not causal else 40, 64, device=meta, dtype=torch.bfloat16)
    out, lse = block_attention(q, k, k, causal, kernel=kernel)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = block_attention_backward(q, q, k, k, out, lse, causal, kernel=kernel)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert all(g.dtype == torch.bfloat16 for g in grads)
