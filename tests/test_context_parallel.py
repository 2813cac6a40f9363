"""Ring attention and load-balanced sharding against full-sequence attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetron.mesh import Mesh
from tetron.parallel.context_parallel import (
    _math_block,
    _math_block_backward,
    block_attention,
    block_attention_backward,
    ring_attention,
    shard_indices,
)

from harness import run_ranks


def _full_attention(q, k, v, window=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    behind = torch.arange(q.shape[2])[:, None] - torch.arange(q.shape[2])[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(behind >= 0) & (behind < window))


def _ring_rank(T: int, heads: int, kv_heads: int, layout: str, window: int | None = None) -> dict:
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(cp=cp)
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(2, heads, T, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, T, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, T, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(2, heads, T, 16, generator=g, dtype=torch.float64)
    idx = shard_indices(T, cp, rank, layout=layout)
    # the ring runs in fp32, the reference in fp64
    local = [t[:, :, idx].float().requires_grad_(True) for t in (q, k, v)]
    out = ring_attention(*local, window=window, mesh=mesh, layout=layout)
    out.backward(dout[:, :, idx].float())
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _full_attention(*full, window=window)
    ref.backward(dout)
    return {"out": out.detach().double(), "ref": ref.detach()[:, :, idx],
            "grads": [t.grad.double() for t in local], "ref_grads": [t.grad[:, :, idx] for t in full]}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp, heads, kv_heads, window", [(2, 4, 4, None), (2, 4, 2, None), (4, 4, 1, None),
                                                         (4, 4, 2, 5)])  # 8 positions a rank: tiles of 5 and 3
def test_ring_attention_equals_full_attention(cp, heads, kv_heads, window, layout):
    for r in run_ranks(cp, _ring_rank, 32, heads, kv_heads, layout, window):
        # fp32 ring against an fp64 reference: 1e-5 covers fp32 rounding over 32 keys
        torch.testing.assert_close(r["out"], r["ref"], rtol=1e-5, atol=1e-5)
        for name, got, want in zip("qkv", r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_shard_indices_cover_the_sequence_once():
    for layout in ("zigzag", "contiguous"):
        for cp in (1, 2, 4):
            parts = [shard_indices(32, cp, r, layout=layout) for r in range(cp)]
            assert torch.equal(torch.cat(parts).sort().values, torch.arange(32))
            assert all(torch.all(p[1:] > p[:-1]) for p in parts)  # increasing: local causal mask is right
    assert shard_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_matches_plain_math(causal):
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(4))
    out, lse = block_attention(q, k, v, causal)
    ref_out, ref_lse = _math_block(q, k, v, causal)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    for got, want in zip(block_attention_backward(dout, q, k, v, out, lse, causal),
                         _math_block_backward(dout, q, k, v, out, lse, causal)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_zigzag_balances_causal_work():
    """Per-rank attention work at cp=4: contiguous chunks give the last rank 7x the first's work;
    zigzag gives every rank the same (max/min = 1)."""
    from tetron.parallel.context_parallel import attention_work

    seq, cp = 1024, 4
    full_causal = seq * seq // 2
    for layout, expected_ratio in (("contiguous", 7.0), ("zigzag", 1.0)):
        work = [attention_work(seq, cp, r, layout=layout) for r in range(cp)]
        print(layout, work, f"max/min {max(work) / min(work):.3f}")
        # every layout scores each causal pair exactly once (diagonal blocks count half of T_l^2,
        # which is T_l/2 more than the true pair count per block: allow that)
        assert abs(sum(work) - full_causal) <= cp * (seq // cp)
        assert max(work) / min(work) == pytest.approx(expected_ratio, rel=1e-9)


def test_a_windowed_layer_scores_pairs_in_proportion_to_its_window():
    """Under ring attention a sliding window's tiles score only the keys in their reach: a rank's pairs grow with
    the window (at most 2 * window per query), not the sequence; without a window (or one as long as the sequence)
    the blocks are as before."""
    from tetron.parallel.context_parallel import attention_work

    seq, cp = 4096, 4
    for layout in ("zigzag", "contiguous"):
        whole = [attention_work(seq, cp, r, layout=layout) for r in range(cp)]
        assert [attention_work(seq, cp, r, layout=layout, window=seq) for r in range(cp)] == whole
        for window in (64, 128, 256):
            work = [attention_work(seq, cp, r, layout=layout, window=window) for r in range(cp)]
            assert all(seq // cp * window <= w <= seq // cp * 2 * window for w in work), (layout, window, work)
        assert max(whole) >= 2 * seq // cp * seq // cp  # zigzag's every rank, contiguous's last: 1024 queries x 2048
