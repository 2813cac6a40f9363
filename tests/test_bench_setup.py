"""The benchmarks' ranks are set up as `tetron train` sets up its ranks (issue 40): torch's threads, glibc's
mmap threshold and the signal handlers, seen from inside a rank of each. The step once lost a third of its
speed to an allocator setting the benchmarks never made, because their harness set ranks up by itself."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from tetron import device as dev
from tetron import launch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import common  # noqa: E402  (bench/common.py: the harness of the multi-rank benchmarks)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGXFSZ)


def _handler_name(handler: object) -> str:
    if handler in (signal.SIG_DFL, signal.SIG_IGN, None):
        return str(handler)
    return getattr(handler, "__qualname__", repr(handler))


def rank_state(mallopt_calls: list) -> dict:
    """What a rank's setup left: threads, the mallopt calls it made, signal handlers, the wakeup fd."""
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    return {"threads": torch.get_num_threads(), "mallopt": [list(c) for c in mallopt_calls],
            "handlers": {sig.name: _handler_name(signal.getsignal(sig)) for sig in SIGNALS},
            "wakeup_fd": fd >= 0, "signal_thread": any(t.name == "tetron-signals" for t in threading.enumerate())}


def _launched_rank(raw: dict, reports: str, result: str, calls: list) -> None:
    """A rank as tetron's launcher starts it (its environment, run_rank), stopped where training would start."""
    os.environ.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0")

    def probe(cfg, **_) -> None:
        Path(result).write_text(json.dumps(rank_state(calls)))

    launch._train_rank = probe
    launch.run_rank(raw, reports)


def _bench_rank(rank: int, args: argparse.Namespace) -> None:
    Path(args.result.format(rank=rank)).write_text(json.dumps(rank_state(args.calls)))


@pytest.mark.parametrize("zero", [0, 3])
def test_bench_ranks_are_set_up_as_launched_ranks(tmp_path, monkeypatch, zero):
    """Within 8 cores and 2 ranks: 4 threads each; under ZeRO-3 (only) the mmap threshold of half a layer; the
    stop signals watched by tetron's thread. The same in a benchmark's rank as in a launched one."""
    calls: list = []  # the forked ranks inherit the recorder, each its own copy
    monkeypatch.setattr(dev, "_mallopt", lambda param, value: calls.append((param, value)) or True)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    cfg = common.rank_config(2, zero=zero, model="smollm-135m")  # only built on the meta device, for its sizes
    raw = {**cfg.to_dict(), "out": str(tmp_path / "run")}
    (tmp_path / "reports").mkdir()
    launched = tmp_path / "launched.json"
    child = mp.get_context("fork").Process(target=_launched_rank,
                                           args=(raw, str(tmp_path / "reports"), str(launched), calls))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    common.launch(_bench_rank, argparse.Namespace(ranks=2, calls=calls, result=str(tmp_path / "bench{rank}.json")),
                  cfg=cfg)
    want = json.loads(launched.read_text())
    assert want["threads"] == 4
    threshold = dev.cpu_mmap_threshold(zero, layer_grad_bytes=launch._smallest_layer_grad_bytes(cfg))
    assert want["mallopt"] == ([[-3, threshold]] if zero == 3 else [])
    assert zero < 3 or threshold > 1 << 20
    assert want["wakeup_fd"] and want["signal_thread"]
    watched = {name for name, handler in want["handlers"].items() if "watch_signals" in handler}
    assert watched == {"SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"}
    assert want["handlers"]["SIGXFSZ"] == str(signal.SIG_IGN)  # a file-size limit is an EFBIG a save reports
    for rank in range(2):
        assert json.loads((tmp_path / f"bench{rank}.json").read_text()) == want


def test_mmap_threshold_is_half_a_layer_under_zero3_only():
    """SmolLM-135M's decoder layer: q and o 576x576, k and v 576x192, three MLP matrices 576x1536, two norms;
    its fp32 gradient is 14,160,384 bytes, a third of it per rank at tp 3. The threshold: half of that,
    within glibc's bounds, and only under ZeRO-3."""
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    for tp in (1, 3):
        cfg = common.from_dict({"model": "smollm-135m", "parallel": {"tp": tp, "zero": 3, "device": "cpu"}})
        assert launch._smallest_layer_grad_bytes(cfg) == 4 * layer // tp
    assert dev.cpu_mmap_threshold(3, layer_grad_bytes=4 * layer) == 2 * layer
    assert dev.cpu_mmap_threshold(3, layer_grad_bytes=1000) == 1 << 20
    assert dev.cpu_mmap_threshold(3, layer_grad_bytes=1 << 30) == 32 << 20
    assert all(dev.cpu_mmap_threshold(z, layer_grad_bytes=4 * layer) is None for z in (0, 1, 2))


BENCHMARKS = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "bench").glob("*.py"))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_imports(name):
    """A benchmark is run by hand, not by the suite, so a name it imports from tetron can vanish unseen
    (bench/checkpoint.py imported a validator that had been renamed). Importing each one here catches that;
    every benchmark's work sits under its `__main__` guard or in functions."""
    import importlib

    importlib.import_module(name)
