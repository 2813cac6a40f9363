"""Across nodes without Slurm: two torchrun agents, each a "node" of 2 ranks, meeting at a c10d rendezvous
on the loopback, train exactly what one node's 4 forked ranks train (the same code on every rank, one
thread each, so the losses are bitwise equal)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import run_parallel, tiny_config

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # s: two agents, each starting 2 ranks that import torch (about 15 s here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_over_c10d_train_like_one(corpus, cache_dir, tmp_path):
    model = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    train = {"steps": 6, "grad_acc": 2}
    parallel = {"dp": 2, "pp": 2, "device": "cpu"}
    raw = tiny_config(corpus, cache_dir, tmp_path / "nodes", model=model, parallel=parallel, train=train)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    ref_raw = tiny_config(corpus, cache_dir, tmp_path / "one", model=model, parallel=parallel, train=train)
    ref_results, ref_written = run_parallel(ref_raw)  # also tokenizes into the shared cache

    port, env = free_port(), {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    # The same command on every node; the rendezvous endpoint is the first node's address.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
           "-m", "tetron.cli", "train", str(config)]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)

    records = [json.loads(line) for line in (tmp_path / "nodes" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["loss"] for r in records] == [m["loss"] for m in ref_written["metrics"]] == ref_results[0]["losses"]
    assert (tmp_path / "nodes" / "model" / "model.safetensors").is_file()
