"""Starting ranks: the elastic launcher for `tetron train`, and each rank's process-group bootstrap.

`launch` starts dp*tp*pp*cp ranks through torch's elastic launcher (or runs the one rank in this
process). Under torchrun, or as a launched child, each rank enters `run_rank`: the only code in
tetron that reads the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, restart counts).
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tetron import device as dev
from tetron.config import Config, from_dict
from tetron.mesh import Mesh
from tetron.metrics import say
from tetron.train import train


def launch(cfg: Config) -> int:
    """Run `cfg` on its world size: in this process when it is one rank or already a launched rank,
    else through the elastic launcher (restarting all ranks up to parallel.max_restarts times)."""
    raw = cfg.to_dict()
    if "RANK" in os.environ or cfg.world_size == 1:
        run_rank(raw)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.world_size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=cfg.parallel.max_restarts,
                          monitor_interval=0.1, start_method="spawn")
    print(f"tetron: starting {cfg.world_size} ranks (dp={cfg.parallel.dp} tp={cfg.parallel.tp} "
          f"pp={cfg.parallel.pp} cp={cfg.parallel.cp}), run folder {cfg.out}", flush=True)
    try:
        elastic_launch(config, run_rank)(raw)
    except ChildFailedError as err:
        rank, first = next(iter(err.failures.items()))
        print(f"tetron: training failed on rank {rank} (exit code {first.exitcode}); "
              f"see its error above", file=sys.stderr)
        return 1
    return 0


def _is_timeout(err: BaseException) -> bool:
    """Whether a torch.distributed error is a collective (or rendezvous) that ran out of time."""
    text = str(err).lower()
    return isinstance(err, (dist.DistBackendError, dist.DistStoreError, RuntimeError)) and (
        "timed out" in text or "timeout" in text)


def init_process_group(device: torch.device, *, timeout_s: float, restart: int) -> None:
    """Join the job's process group: under a launcher from its environment, else a group of one."""
    timeout = timedelta(seconds=timeout_s)
    device_id = device if device.type == "cuda" else None
    backend = dev.backend_for(device)
    if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store outlives a restart, and with it the previous attempt's gloo addresses:
        # a prefix per attempt keeps the new ranks from connecting to the dead ones.
        store = dist.PrefixStore(f"tetron/attempt_{restart}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, device_id=device_id)
    elif "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:  # a single process started without a launcher: a group of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)


def run_rank(raw_config: dict[str, Any]) -> None:
    """Entry point of one launched rank (elastic launcher or torchrun): group, mesh, train, sample."""
    cfg = from_dict(raw_config)
    # The elastic launcher counts restarts; a restarted rank continues from OUT's latest checkpoint.
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restart > 0 and cfg.checkpoint.resume is None:
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto"))
    if restart > 0 and os.environ.get("RANK", "0") == "0":
        say(f"restart {restart} of {cfg.parallel.max_restarts} after a rank failed: resuming from the latest "
            f"checkpoint in {cfg.out}")
    device = dev.pick_device(cfg.parallel.device, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cpu":
        # Ranks share the cores: more threads than cores per rank only adds contention.
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    try:
        init_process_group(device, timeout_s=cfg.parallel.timeout_s, restart=restart)
        p = cfg.parallel
        mesh = Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, device_type=device.type)
        train(cfg, mesh, device=device)
        if mesh.rank == 0 and cfg.logging.sample_tokens > 0:
            from tetron.generate import sample_from_run

            text = sample_from_run(Path(cfg.out), prompt=cfg.logging.sample_prompt,
                                   max_new_tokens=cfg.logging.sample_tokens, device=device, seed=cfg.train.seed)
            print(f"\n--- sample from {cfg.out}/model ---\n{text}\n---", flush=True)
    except Exception as err:
        if not _is_timeout(err):
            raise
        # One line instead of a C++ stack: the usual cause is another rank, not this one.
        print(f"tetron: rank {os.environ.get('RANK', 0)}: a collective did not finish within "
              f"parallel.timeout_s={cfg.parallel.timeout_s:g} s (a rank died or hangs)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
