"""tetron.torch_private: each private torch API against its public fallback (forced by `fallback=True`), on the
CPU, with the tolerance each states; the private path is what every other test runs."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from tetron import torch_private as tp
from tetron.torch_private.version import _parse

FP32 = {"rtol": 1e-5, "atol": 1e-6}  # fp32, different summation orders (a fused kernel's blocks, a batched norm)


def _qkv(tq: int, tk: int, *, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in [(2, 3, tq, 16), (2, 3, tk, 16), (2, 3, tk, 16), (2, 3, tq, 16)]]


def test_the_version_is_read_and_compared():
    assert _parse("2.13.0+cpu") == (2, 13) and _parse("2.11.0a0+git") == (2, 11) and _parse("nightly") == (99, 0)
    assert tp.torch_at_least(2, 4) and not tp.torch_at_least(2, 14, version=(2, 13))
    assert tp.torch_at_least(2, 13, version=(2, 13)) and tp.torch_at_least(3, 0, version=(3, 1))


@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_flash_attention_equals_its_fallback(with_bias):
    """The CPU's fused kernel (causal, and an additive document mask on top) against plain math with lse."""
    q, k, v, dout = _qkv(24, 24)
    bias = None
    if with_bias:  # two documents: 0 to attend, -inf across the boundary
        doc = (torch.arange(24) >= 10).long()
        bias = torch.zeros(1, 1, 24, 24).masked_fill(doc[:, None] != doc[None, :], float("-inf"))
    got = [tp.cpu_flash_attention(q, k, v, True, bias=bias, fallback=f) for f in (False, True)]
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, **FP32)
    out, lse = got[0]
    assert lse.shape == (2, 3, 24) and lse.dtype == torch.float32
    grads = [tp.cpu_flash_attention_backward(dout, q, k, v, out, lse, True, bias=bias, fallback=f)
             for f in (False, True)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **FP32)
    # and both are attention: torch's public SDPA on the same mask
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    full = mask if bias is None else mask & (bias == 0)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full), **FP32)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_attention_calls_keep_their_shapes_and_fall_back_to_math(kernel):
    """The CUDA kernels run here only through torch's meta kernels: their outputs' shapes and dtypes are the
    fallback's; on real tensors the fallback is the math path."""
    forward = {"flash": tp.cuda_flash_attention, "efficient": tp.cuda_efficient_attention}[kernel]
    backward = {"flash": tp.cuda_flash_attention_backward, "efficient": tp.cuda_efficient_attention_backward}[kernel]
    meta = [torch.empty(2, 4, 40, 64, device="meta", dtype=torch.bfloat16) for _ in range(3)]
    private, public = forward(*meta, True), forward(*meta, True, fallback=True)
    assert [(t.shape, t.dtype) for t in private] == [(t.shape, t.dtype) for t in public]
    grads = [backward(meta[0], *meta, *private, True, fallback=f) for f in (False, True)]
    assert [(t.shape, t.dtype) for t in grads[0]] == [(t.shape, t.dtype) for t in grads[1]]
    q, k, v, dout = _qkv(8, 8)
    out, lse = forward(q, k, v, True, fallback=True)
    assert out.equal(tp.math_attention(q, k, v, True)[0]) and lse.equal(tp.math_attention(q, k, v, True)[1])
    assert all(a.equal(b) for a, b in zip(backward(dout, q, k, v, out, lse, True, fallback=True),
                                          tp.math_attention_backward(dout, q, k, v, out, lse, True)))


@pytest.mark.skipif(not tp.grouped_mm_available("cpu"), reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("counts", [[3, 0, 9, 1], [0, 0, 0, 5], [4, 4, 0, 0]])
def test_grouped_mm_equals_a_matmul_per_group(counts):
    """torch._grouped_mm against one matmul per group, forward and both gradients, empty groups included."""
    g = torch.Generator().manual_seed(1)
    x0, w0 = torch.randn(sum(counts), 16, generator=g), torch.randn(len(counts), 16, 8, generator=g)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    results = []
    for fallback in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = tp.grouped_mm(x, w, ends, fallback=fallback)
        out.backward(torch.ones_like(out))
        results.append((out, x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **FP32)


def _graph() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, generator=g).requires_grad_()
    w = torch.randn(3, 4, generator=g).requires_grad_()
    return x, w, (x @ w).tanh(), torch.randn(2, 4, generator=g)


def test_run_backward_equals_its_fallback_from_a_released_output():
    """Backward from an output whose data was released (the pipeline's), accumulating; and to given inputs
    without accumulating, from a gradient edge (weight_grad's B and W): the engine and public autograd agree."""
    grads = []
    for fallback in (False, True):
        x, w, out, dout = _graph()
        edge = get_gradient_edge(out)
        (dx,) = tp.run_backward((edge,), (dout,), keep_graph=True, inputs=(get_gradient_edge(x),), accumulate=False,
                                fallback=fallback)
        assert x.grad is None and w.grad is None  # nothing accumulated
        out.data = torch.empty(0)
        tp.run_backward((out,), (dout,), fallback=fallback)
        grads.append((dx, x.grad, w.grad))
    for a, b in zip(*grads):
        assert a.equal(b)
    torch.testing.assert_close(grads[0][0], grads[0][1], rtol=0, atol=0)


def test_the_other_helpers_equal_their_fallbacks():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=g) for n in (1, 7, 300)]
    private, public = tp.foreach_norm(tensors), tp.foreach_norm(tensors, fallback=True)
    torch.testing.assert_close(torch.stack(private), torch.stack(public), **FP32)
    a, b = [t.clone() for t in tensors], [t.clone() for t in tensors]
    tp.foreach_scale_(a, torch.tensor(0.3))
    tp.foreach_scale_(b, torch.tensor(0.3), fallback=True)
    assert all(x.equal(y) for x, y in zip(a, b))
    tree = {"a": [torch.ones(1), (2, torch.zeros(2))], "b": 3}
    private, public = tp.tree_leaves(tree), tp.tree_leaves(tree, fallback=True)
    assert len(private) == len(public) == 4 and all(x is y for x, y in zip(private, public))
    for op in (torch.ops.aten.add.Tensor, torch.ops.aten.mm.default, torch.ops.c10d.allreduce_.default):
        assert tp.op_name(op) == tp.op_name(op, fallback=True)
    assert not tp.is_fake(torch.ones(1)) and not tp.is_fake(torch.ones(1), fallback=True)
    assert not tp.in_backward() and not tp.in_backward(fallback=True)
    seen = []
    x, w, out, dout = _graph()
    out.register_hook(lambda grad: seen.append(tp.in_backward()))
    out.backward(dout)
    assert seen == [True]


def test_storage_swap_moves_memory_and_the_pool_resizes_without_it():
    from tetron.parallel.storage_pool import StoragePool

    a, b = torch.arange(4.0), torch.zeros(4)
    sa = a.untyped_storage()
    if tp.storage_swap_available(torch.device("cpu")):
        tp.swap_storages(sa, b.untyped_storage())
        assert a.untyped_storage() is sa and a.equal(torch.zeros(4)) and b.equal(torch.arange(4.0))
    for reuse in (None, False):  # the pool's private path where available, and its public one
        pool, t = StoragePool(torch.device("cpu"), reuse=reuse), torch.ones(8)
        storage = t.untyped_storage()
        pool.empty(storage)
        assert storage.nbytes() == 0
        pool.fill(storage, 32)
        assert storage.nbytes() == 32 and t.untyped_storage() is storage


def test_is_view_and_its_safe_fallback():
    base = torch.ones(4, requires_grad=True) * 2
    assert tp.is_view(base[1:]) and not tp.is_view(base)
    assert tp.is_view(base, fallback=True)  # unknown: treated as a view, whose data is never released


def test_materialize_keeps_tied_parameters_tied_and_zeroes_meta_buffers():
    """parallel/init.py's materialize_ through public nn.Module calls: one new Parameter per old one wherever it
    is registered, its attributes kept; meta buffers become zeros."""
    from tetron.parallel.init import materialize_

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        model[1].weight = model[0].weight
        model[1].register_buffer("bias_state", torch.ones(5))
    model[0].weight.marker = "kept"
    materialize_(model, torch.device("cpu"))
    assert model[0].weight is model[1].weight and model[0].weight.device.type == "cpu"
    assert model[0].weight.marker == "kept" and model[1].bias_state.equal(torch.zeros(5))
    assert [n for n, _ in model.named_parameters()] == ["0.weight"]


def test_view_base_version_and_wrapped_tensors_against_their_fallbacks():
    """The activation meter's helpers: the private answers, and what the public paths answer instead."""
    base = torch.ones(4)
    view = base[1:]
    assert tp.view_base(view) is base and tp.view_base(base) is None and tp.view_base(view, fallback=True) is None
    before = tp.version(base)
    base.add_(1)
    assert tp.version(base) == before + 1 and tp.version(base, fallback=True) == 0
    assert tp.wrapped_tensors(base) is None and tp.wrapped_tensors(base, fallback=True) is None


def test_wrapped_tensors_finds_a_wrapper_subclass_inner_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.ones(3), torch.zeros(3)
    inner = tp.wrapped_tensors(TwoTensor(a, b))
    assert inner is not None and [t.data_ptr() for t in inner] == [a.data_ptr(), b.data_ptr()]


def test_engine_runs_says_which_nodes_this_backward_executes():
    """Private: the nodes this engine run executes (a backward to chosen inputs skips the others); public: every
    node (the plain backward's answer), as for a leaf, which torch cannot be asked about then."""
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, grad):
            (node_a, _), (node_b, _) = ctx.next_functions
            seen["private"] = (tp.engine_runs(node_a), tp.engine_runs(node_b))
            seen["public"] = (tp.engine_runs(node_a, fallback=True), tp.engine_runs(node_b, fallback=True))
            return grad, grad

    x, w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    a, b = x * 2, w * 3  # non-leaf inputs: nodes the engine can be asked about
    torch.autograd.grad(Probe.apply(a, b).sum(), [x], retain_graph=True)
    assert seen == {"private": (True, False), "public": (True, True)}
    seen.clear()
    Probe.apply(a, w).sum().backward()  # w is a leaf: True on both paths
    assert seen == {"private": (True, True), "public": (True, True)}
