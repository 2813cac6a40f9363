"""tetron.observe.memory and the CPU peak of tetron.device, against byte counts worked out by hand.

Byte counts are integers and compared exactly: every tensor here is fp32 (4 B per element) unless
said, and which tensors autograd saves is fixed by each op's backward formula.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tetron import device as dev
from tetron.models.llama import Llama, LlamaConfig
from tetron.observe.memory import ActivationMeter, StateBytes, optimizer_tensors, state_bytes, tensor_bytes

ROOT = Path(__file__).resolve().parent.parent

B, D_IN, H, D_OUT = 3, 5, 7, 2  # batch and widths of the two-Linear block: distinct, so a wrong sum shows


def block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, D_OUT))


# ------------------------------------------------------------------------------------ state


def test_state_bytes_adamw_after_one_step():
    model = block()
    model.register_buffer("scale", torch.ones(11))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-3)
    before = state_bytes(params=params, grads=[p.grad for p in params], optimizer_tensors=optimizer_tensors(opt),
                         buffers=list(model.buffers()))
    # No gradients yet, no optimizer state yet, and the param_groups' params are the parameters.
    assert before == StateBytes(params=4 * n, grads=0, optimizer=0, buffers=4 * 11)

    model(torch.randn(B, D_IN)).sum().backward()
    opt.step()
    got = state_bytes(params=params, grads=[p.grad for p in params], optimizer_tensors=optimizer_tensors(opt),
                      buffers=list(model.buffers()))
    # AdamW: exp_avg and exp_avg_sq (4 + 4 B/elem) and one fp32 `step` scalar (4 B) per parameter.
    assert got == StateBytes(params=4 * n, grads=4 * n, optimizer=8 * n + 4 * len(params), buffers=4 * 11)
    assert got.total == 16 * n + 4 * len(params) + 44
    assert got.as_dict() == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * len(params),
                             "buffers": 44, "total": got.total}


def test_separate_master_weights_are_optimizer_state():
    """bf16 model parameters and an AdamW over fp32 copies: the copies are optimizer state."""
    model = block().to(torch.bfloat16)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt.step()
    got = state_bytes(params=params, optimizer_tensors=optimizer_tensors(opt))
    # params 2 B/elem; optimizer: masters 4 + moments 8 B/elem + 4 B of `step` per tensor; the masters'
    # own .grad is not something optimizer_tensors reports (the caller passes gradients as grads).
    assert got == StateBytes(params=2 * n, grads=0, optimizer=12 * n + 4 * len(params), buffers=0)


def test_tied_weights_and_views_count_once():
    emb = nn.Embedding(13, 6)
    head = nn.Linear(6, 13, bias=False)
    head.weight = emb.weight
    tied = [emb.weight, head.weight, emb.weight[:2], emb.weight.t()]
    assert tensor_bytes(tied) == 13 * 6 * 4
    assert state_bytes(params=tied, optimizer_tensors=[emb.weight]).total == 13 * 6 * 4


def test_grads_as_views_into_one_flat_buffer():
    """Bucketed data parallelism's layout: every .grad a view into one fp32 buffer."""
    model = block()
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = buffer[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    assert tensor_bytes(p.grad for p in params) == buffer.nbytes
    assert tensor_bytes([params[0].grad]) == buffer.nbytes  # one view holds the whole buffer
    got = state_bytes(params=params, grads=[p.grad for p in params] + [buffer])
    assert (got.params, got.grads) == (buffer.nbytes, buffer.nbytes)


def test_empty_meta_and_missing_tensors_count_nothing():
    freed = torch.ones(100)
    freed.untyped_storage().resize_(0)  # how sharded or released parameters give their memory back
    meta = torch.empty(100, device="meta")
    assert tensor_bytes([freed, meta, None, torch.ones(3, dtype=torch.bfloat16)]) == 3 * 2


# ------------------------------------------------------------------------------------ activations


def test_meter_counts_saved_inputs_and_outputs():
    model = block()
    meter = ActivationMeter(model.parameters())
    x = torch.randn(B, D_IN)
    with meter:
        h = model[0](x)
        assert meter.live_bytes == 4 * B * D_IN  # the first Linear saves its input (for its weight's grad)
        h = model[1](h)
        assert meter.live_bytes == 4 * B * (D_IN + H)  # ReLU saves its output
        # The second Linear saves the ReLU output again (counted once) and its weight (a parameter).
        out = model[2](h)
        assert meter.live_bytes == 4 * B * (D_IN + H)
        loss = out.sum()  # sum saves nothing
    del h, out
    assert meter.live_bytes == meter.peak_bytes == 4 * B * (D_IN + H)
    loss.backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == 4 * B * (D_IN + H)
    meter.reset_peak()
    assert meter.peak_bytes == 0


def test_meter_without_params_counts_the_saved_weight():
    """Left out only when passed in: the second Linear's weight (saved transposed, a view) is counted."""
    model = block()
    meter = ActivationMeter()
    with meter:
        loss = model(torch.randn(B, D_IN)).sum()
    assert meter.live_bytes == 4 * B * (D_IN + H) + 4 * D_OUT * H
    del loss


def test_meter_releases_a_graph_dropped_unrun():
    model = block()
    meter = ActivationMeter(model.parameters())
    with meter:
        loss = model(torch.randn(B, D_IN)).sum()
    assert meter.live_bytes > 0
    del loss  # no backward: freeing the graph must free the holders (no reference cycle through it)
    assert meter.live_bytes == 0


def test_two_micro_batches_in_flight_add_up():
    model = block()
    meter = ActivationMeter(model.parameters())
    one = 4 * B * (D_IN + H)
    with meter:
        first = model(torch.randn(B, D_IN)).sum()
        second = model(torch.randn(B, D_IN)).sum()
    assert meter.peak_bytes == meter.live_bytes == 2 * one
    first.backward()
    assert meter.live_bytes == one
    with meter:  # a third forward while the second still waits, as in 1F1B
        third = model(torch.randn(B, D_IN)).sum()
    assert meter.live_bytes == 2 * one and meter.peak_bytes == 2 * one
    second.backward()
    third.backward()
    assert meter.live_bytes == 0


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x * x * x
        ctx.save_for_backward(x, out)  # the output too (unused below), to count a saved output
        return out

    @staticmethod
    def backward(ctx, grad):
        x, _ = ctx.saved_tensors
        return grad * 3 * x * x


def test_meter_counts_custom_function_saves():
    x = torch.randn(B, D_IN, requires_grad=True)
    meter = ActivationMeter()
    with meter:
        loss = _Cube.apply(x).sum()
    assert meter.live_bytes == 2 * 4 * B * D_IN
    loss.backward()
    assert meter.live_bytes == 0
    torch.testing.assert_close(x.grad, torch.ones_like(x) * 3 * x * x, rtol=0, atol=0)  # the same ops: bitwise


def test_meter_under_checkpointing():
    """The region's own saves go to checkpoint's hook, unseen; seen are y, saved twice by the product
    after the region, and the region's input x, which checkpoint keeps for the recompute: reentrant
    checkpointing saves it with save_for_backward, non-reentrant as a saved tensor in recent torch
    (2.13 here; older versions kept it in a closure, unseen)."""
    model = block()
    x = torch.randn(B, D_IN, requires_grad=True)
    params = [x, *model.parameters()]

    def grads_after(loss: torch.Tensor) -> list[torch.Tensor]:
        loss.backward()  # not autograd.grad: reentrant checkpointing refuses it
        found = [p.grad for p in params]
        for p in params:
            p.grad = None
        return found

    y = model(x)
    expected = grads_after((y * y).sum())
    input_saved = hasattr(torch.utils.checkpoint._CheckpointFrame, "save_inputs")
    for reentrant, seen in [(False, 4 * B * (D_IN * input_saved + D_OUT)), (True, 4 * B * (D_IN + D_OUT))]:
        meter = ActivationMeter(model.parameters())
        with meter:
            y = checkpoint(model, x, use_reentrant=reentrant)
            loss = (y * y).sum()
            assert meter.live_bytes == seen
            del y
            grads = grads_after(loss)  # inside: a reentrant recompute saves through the meter too
        assert meter.live_bytes == 0
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # same ops, same order: bitwise


def test_meter_keeps_autograds_inplace_check():
    a = torch.randn(4, requires_grad=True)
    with ActivationMeter():
        b = a.exp()  # saves its output
        b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()


def test_meter_on_llama_changes_no_gradient():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    ids = torch.randint(0, 97, (2, 16))

    def grads() -> list[torch.Tensor]:
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        return torch.autograd.grad(loss, list(model.parameters()))

    plain = grads()
    meter = ActivationMeter(model.parameters())
    with meter:
        metered = grads()
    assert meter.peak_bytes > 4 * 2 * 15 * 97  # at least the logits, saved by the cross entropy
    assert meter.live_bytes == 0
    for got, want in zip(metered, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ CPU peak


CPU = torch.device("cpu")
ALLOC_MIB = 200


def _assert_peak_is_ru_maxrss() -> None:
    scale = 2**20 if sys.platform == "darwin" else 2**10  # ru_maxrss is in bytes on macOS, KiB on Linux
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale
    peak = dev.peak_memory_mb(CPU)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale
    assert before <= peak <= after


def test_cpu_peak_resets_per_step():
    resettable = dev.reset_peak_memory(CPU)
    assert resettable == os.path.exists(dev._CLEAR_REFS)  # True on Linux (4.0+), as here
    start = dev.peak_memory_mb(CPU)
    x = torch.ones(ALLOC_MIB * 2**20 // 4)  # fill touches every page, so all of it is resident
    high = dev.peak_memory_mb(CPU)
    del x  # this large a block is its own mapping: freeing it gives it back to the kernel at once
    assert dev.reset_peak_memory(CPU) is resettable
    low = dev.peak_memory_mb(CPU)
    # 5% slack below the allocation: the rest of the process's resident set may shrink meanwhile.
    assert high - start >= 0.95 * ALLOC_MIB
    if not resettable:  # no clear_refs: the documented fallback, the peak since the process started
        assert low >= high
        if not os.path.exists(dev._PROC_STATUS):
            _assert_peak_is_ru_maxrss()
        return
    # The new peak is the resident set after the free (VmRSS, read just after); 50 MiB leaves room for
    # whatever else the process touched in between, far less than the 200 MiB a reset that did nothing
    # would keep. Not compared with `start`: a long-lived test process's resident set drifts as earlier
    # tests' freed memory is trimmed.
    rss = next(int(line.split()[1]) for line in open(dev._PROC_STATUS) if line.startswith("VmRSS:")) / 1024
    assert low <= high - (ALLOC_MIB - 50)
    assert abs(low - rss) < 50


# In a fresh interpreter: a process forked from this long-lived one inherits a heap whose free space can
# serve 2 MiB without any new mapping, whatever the threshold (seen in the full suite: 0 bytes mapped).
MAPPED_AFTER_A_REUSE = """
import ctypes, ctypes.util
from tetron import device as dev

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h): hblkhd, the bytes mapped on their own
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert dev.map_large_allocations()
libc.free(libc.malloc(8 << 20))  # mapped, then unmapped: glibc's default would raise its threshold to 8 MiB
before = libc.mallinfo2().hblkhd
small = libc.malloc(2 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(small)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"), reason="needs glibc")
def test_cpu_ranks_map_large_blocks():
    """A fixed mmap threshold (ZeRO-3's CPU ranks set one, here 1 MiB): a 2 MiB block is its own mapping, given
    back when freed, even after a larger block was freed (which by default raises the threshold, so that the
    2 MiB come from the heap, where freed pages stay resident)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", MAPPED_AFTER_A_REUSE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) >= 2 << 20


def test_cpu_peak_without_proc_is_the_peak_since_start(monkeypatch, tmp_path):
    """Where /proc is absent (macOS): no reset, and ru_maxrss, the process's peak since start."""
    monkeypatch.setattr(dev, "_CLEAR_REFS", str(tmp_path / "no-clear_refs"))
    monkeypatch.setattr(dev, "_PROC_STATUS", str(tmp_path / "no-status"))
    assert dev.reset_peak_memory(CPU) is False
    _assert_peak_is_ru_maxrss()


def test_a_parameter_gathered_elsewhere_is_still_a_parameter():
    """ZeRO-3 frees a parameter's storage between uses and gathers it again at another address: what
    autograd saves of it (the weight, or its transpose) is still weights, not activations."""
    lin = nn.Linear(256, 256, bias=False)
    x = torch.randn(4, 256, requires_grad=True)
    meter = ActivationMeter(lin.parameters())
    with meter:
        storage = lin.weight.untyped_storage()
        values = lin.weight.detach().clone()
        before = storage.data_ptr()
        blockers = []  # each takes the block just freed, until the gather lands elsewhere: where the allocator
        for _ in range(8):  # puts a freed block depends on what the process did before (a pytest worker's)
            storage.resize_(0)  # freed, then gathered again: a new address
            blockers.append(torch.empty(values.numel()))
            storage.resize_(values.numel() * 4)
            if storage.data_ptr() != before:
                break
        assert storage.data_ptr() != before  # the case this test is about
        lin.weight.data.copy_(values)
        lin(x).sum().backward()
    assert meter.peak_bytes == x.numel() * 4  # the input alone


def _dtensor_bytes() -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return tensor_bytes([distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])])


def test_dtensors_count_their_local_shard():
    """A DTensor (FSDP2's parameters) counts its local tensor, not its mesh."""
    sys.path.insert(0, os.path.dirname(__file__))
    from harness import run_ranks

    assert run_ranks(1, _dtensor_bytes) == [8 * 4 * 4]
