"""Starting ranks: the elastic launcher for `tetron train`, and each rank's process-group bootstrap.

`launch` starts dp*tp*pp*cp ranks through torch's elastic launcher (or runs the one rank in this
process), watched by watch.RankWatch, which ends the run with one line. Under torchrun, or as a
launched child, each rank enters `run_rank`: the only code in tetron that reads the launcher's
environment (RANK, LOCAL_RANK, WORLD_SIZE, restart counts). A rank turns a stop signal into a saved
checkpoint (stop.py), and a user error, a timed-out collective or a lost peer into one line (or, under
tetron's launcher, into its report, from which the launcher prints the line).

`python -m tetron.launch [torchrun's arguments]` is torchrun, except that a stop signal after which the ranks
saved ends it with exit status 0, as tetron's launcher does: torch's agent turns SIGTERM, SIGINT or SIGHUP into
a SignalException, passes the signal on to the ranks (which finish their step and save), waits for them, then
raises it, and torchrun exits 1 with a traceback: a scheduler would count a clean preemption as a failure.
`tetron slurm` starts each node's ranks this way.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tetron import device as dev
from tetron.checkpoint.save import model_specs
from tetron.config import Config, from_dict
from tetron.errors import UserError
from tetron.fs import checkpoints_dir, find_latest, write_text
from tetron.mesh import Mesh
from tetron.models.spec import spec_of
from tetron.observe.metrics import say
from tetron.observe.rank_logs import RankLog
from tetron.observe.watch import RankReport, RankWatch, resume_point
from tetron.stop import SAME_REQUEST_S, StopRequest, stop_signals, stopped_line, watch_signals
from tetron.train import train

# How long torch's launcher waits for ranks it stops before it kills them: tetron's watch kills a rank that
# does not end by itself well before (GRACE_S); this only bounds what the watch cannot see.
SHUTDOWN_TIMEOUT_S = 10


def launch(cfg: Config) -> int:
    """Run `cfg` on its world size: in this process when it is one rank or already a launched rank,
    else through the elastic launcher (restarting all ranks up to parallel.max_restarts times)."""
    raw = cfg.to_dict()
    if "RANK" in os.environ or cfg.world_size == 1:
        run_rank(raw)
        return 0
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    start_method = dev.rank_start_method(cfg.parallel.device)
    if start_method == "fork":
        import torch._dynamo  # noqa: F401  (every rank's optimizer imports it, with sympy: once here, inherited)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.world_size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=cfg.parallel.max_restarts,
                          monitor_interval=0.1, start_method=start_method, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    print(start_line(cfg), flush=True)
    _quiet_launcher_logs()
    with tempfile.TemporaryDirectory(prefix="tetron-ranks-") as folder:
        watch = RankWatch(Path(folder), out=cfg.out, steps=cfg.train.steps, timeout_s=cfg.parallel.timeout_s,
                          stop_signal=cfg.checkpoint.stop_signal, max_restarts=cfg.parallel.max_restarts)
        return watch.run(lambda: elastic_launch(config, run_rank)(raw, folder))


def start_line(cfg: Config) -> str:
    """The launching process's first line: the ranks, their layout (ep, out of dp*cp, where an MoE model
    splits its experts), the run folder."""
    p = cfg.parallel
    ep = f" ep={p.ep}" if p.ep > 1 else ""
    layout = f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}{ep}"
    return f"tetron: starting {cfg.world_size} ranks ({layout}), run folder {cfg.out}"


def _quiet_launcher_logs() -> None:
    """torch's launcher logs each rank it stops or restarts, and that it runs in a thread (tetron's watch
    keeps the main thread for signals); the watch says what happened in one line instead."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (creates the loggers silenced below)
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401
    import torch.multiprocessing.spawn  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _is_timeout(err: BaseException) -> bool:
    """Whether a torch.distributed error is a collective (or rendezvous) that ran out of time."""
    text = str(err).lower()
    return isinstance(err, (dist.DistBackendError, dist.DistStoreError, RuntimeError)) and (
        "timed out" in text or "timeout" in text)


def _is_peer_gone(err: BaseException) -> bool:
    """Whether a torch.distributed error is another rank's process going away mid-collective."""
    text = str(err).lower()
    return isinstance(err, (dist.DistError, RuntimeError)) and any(
        s in text for s in ("connection closed by peer", "connection reset by peer", "broken pipe", "pair closure"))


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


def run_rank(raw_config: dict[str, Any], reports: str | None = None) -> None:
    """Entry point of one launched rank (elastic launcher or torchrun): group, mesh, train, sample.

    `reports`: the folder of tetron's launcher (watch.py), which prints the run's last line from what each
    rank reports there; None under torchrun or in a single process, where rank 0 prints it."""
    cfg = from_dict(raw_config)
    # The elastic launcher counts restarts; a restarted rank continues from OUT's latest checkpoint.
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    rank = int(os.environ.get("RANK", 0))
    report = RankReport(Path(reports), rank=rank, attempt=restart) if reports else None
    # A launched rank may get one request twice within moments: torchrun's agent passes on a signal the
    # ranks also got directly, and a launcher that dies sends its death signal (SIGINT) once per thread.
    repeat_s = SAME_REQUEST_S if "RANK" in os.environ else 0.0
    stop, restore = setup_rank(cfg, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                               forked=reports is not None, same_request_s=repeat_s,
                               on_abort=lambda sig: _abort(sig, cfg.out, announce=rank == 0 and report is None))
    launcher = os.getppid()
    rank_log = RankLog.start(Path(cfg.out).expanduser(), rank, attempt=restart)  # OUT/logs/rank_N.log
    try:
        if report is not None:
            report.write("running")
            if report.stop_requested():  # restarted after a stop was requested: nothing more to train
                report.write("stopped")
                return
        _train_rank(cfg, restart=restart, stop=stop, report=report)
        if report is not None:
            _end_without_launcher(launcher)
    except Exception as err:
        _rank_failed(err, cfg, report)
    finally:
        restore()
        if dist.is_initialized():
            dist.destroy_process_group()
        rank_log.restore()


def setup_rank(cfg: Config, *, ranks_per_node: int, forked: bool = True, same_request_s: float = 0.0,
               on_abort: Callable[[signal.Signals], None] | None = None) -> tuple[StopRequest, Callable[[], None]]:
    """The settings of one rank's process, made before anything else it does: every `tetron train` rank
    (under tetron's launcher, torchrun or alone) and every benchmark's rank (bench/common.py) call this, so
    that a benchmark times what users run (tests/test_bench_setup.py checks that they match).

    On the CPU, torch's threads and glibc's mmap threshold (setup_rank_process). Signals: a rank `forked`
    from a process with handlers of its own (tetron's launcher) starts from the defaults; then the stop
    signals ask for a checkpoint and a stop (StopRequest), a second one calls `on_abort` (default: exit at
    once). Returns the request and the function that restores the signal handlers found."""
    signals = stop_signals(cfg.checkpoint.stop_signal)
    if forked:
        _forget_launcher_signals(signals)
    setup_rank_process(cfg, ranks_per_node=ranks_per_node)
    # past a file-size limit (ulimit -f) a write then fails with EFBIG, which a save reports in one line and
    # cleans up after, instead of the kernel killing the rank mid-save
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    stop = StopRequest()
    restore = watch_signals(signals, on_stop=stop.request, forwarded=True, same_request_s=same_request_s,
                            on_abort=on_abort or (lambda sig: _abort(sig, cfg.out, announce=False)))
    return stop, restore


def setup_rank_process(cfg: Config, *, ranks_per_node: int) -> None:
    """setup_rank's process settings, without its signals (also for `tetron plan --measure`'s ranks): on the
    CPU, torch's threads (the node's cores shared by its `ranks_per_node` ranks) and glibc's mmap threshold
    for the ZeRO stage (device.cpu_mmap_threshold)."""
    if dev.runs_on_cpu(cfg.parallel.device):
        torch.set_num_threads(dev.cpu_threads(ranks_per_node))
        layer_bytes = _smallest_layer_grad_bytes(cfg) if cfg.parallel.zero >= 3 else 0
        threshold = dev.cpu_mmap_threshold(cfg.parallel.zero, layer_grad_bytes=layer_bytes)
        if threshold is not None:
            dev.map_large_allocations(threshold)


def _smallest_layer_grad_bytes(cfg: Config) -> int:
    """The fp32 gradient bytes of the smallest decoder layer on one rank (its tp part): ZeRO-3's unit; 0 for
    a configuration without a model (a benchmark's ranks that build their own)."""
    if cfg.model is None:
        return 0
    plan = spec_of(cfg.model).plan
    sizes: dict[int, int] = {}
    for _, name, _, shape in model_specs(cfg.model, buffers=False):
        if plan.stage_part(name) == "layer":
            sizes[plan.layer_index(name)] = sizes.get(plan.layer_index(name), 0) + math.prod(shape)
    return 4 * min(sizes.values(), default=0) // cfg.parallel.tp


def _forget_launcher_signals(signals: list[signal.Signals]) -> None:
    """A rank forked by tetron's launcher inherits the launcher's signal handlers and wakeup fd, which would
    hand the rank's signals to the launcher's watch (also after this rank restores what it found): start
    from the defaults a spawned rank has."""
    signal.set_wakeup_fd(-1)
    for sig in signals:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _end_without_launcher(launcher: int) -> None:
    """torch's launcher has a finished rank wait until it reads the rank's result; if the launcher is gone
    (killed: its death signal made this rank save and return), that wait never ends. End the rank then."""
    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        sys.stdout.flush()
        os._exit(0)

    threading.Thread(target=watch, name="tetron-launcher-watch", daemon=True).start()


def _train_rank(cfg: Config, *, restart: int, stop: StopRequest, report: RankReport | None) -> None:
    """This rank's run: device, process group, mesh, training; then the sample (rank 0), or on a stop
    request the line saying where to resume."""
    if restart > 0 and cfg.checkpoint.resume is None:
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto"))
    # Under tetron's launcher the watch says this, naming the rank and its signal; under torchrun only its agent
    # knew them, so rank 0 says what it can.
    if restart > 0 and os.environ.get("RANK", "0") == "0" and report is None:
        say(f"restart {restart} after a rank failed: {resume_point(cfg.out)}")
    device = dev.pick_device(cfg.parallel.device, int(os.environ.get("LOCAL_RANK", 0)))
    init_process_group(device, timeout_s=cfg.parallel.timeout_s, restart=restart)
    p = cfg.parallel
    mesh = Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, dp_shard=p.dp_shard, device_type=device.type,
                timeout=timedelta(seconds=p.timeout_s))
    result = train(cfg, mesh, device=device, stop=stop)
    if result.stopped_at is not None:
        folder = str(checkpoints_dir(Path(cfg.out)) / f"step_{result.stopped_at}")
        if report is not None:  # the signal, where this rank got it itself (the others learn of it in a collective)
            report.write("stopped", step=result.stopped_at, checkpoint=folder, signal=stop.signal)
        elif mesh.rank == 0:
            print(stopped_line(stop.signal or "a signal", result.stopped_at, steps=cfg.train.steps, folder=folder),
                  flush=True)
        note = _stopped_note(os.getppid())  # under torchrun_main (our parent): its exit status is 0 after this save
        if report is None and note.parent.is_dir() and os.environ.get("LOCAL_RANK", "0") == "0":
            write_text(note, folder + "\n")
        return
    if mesh.rank == 0 and cfg.logging.sample_tokens > 0:
        from tetron.observe.generate import sample_from_run

        lg = cfg.logging
        text = sample_from_run(Path(cfg.out), prompt=lg.sample_prompt, max_new_tokens=lg.sample_tokens,
                               temperature=lg.sample_temperature, top_k=lg.sample_top_k, device=device,
                               seed=cfg.train.seed)
        print(f"\n--- sample from {cfg.out}/model ---\n{text}\n---", flush=True)
    if report is not None:
        report.write("done")


def _rank_failed(err: Exception, cfg: Config, report: RankReport | None) -> None:
    """A failed rank: one line (or its report) for what a user can act on, then exit 1; anything else,
    a bug, keeps its traceback."""
    rank = int(os.environ.get("RANK", 0))
    if isinstance(err, (UserError, FloatingPointError)):  # a full disk, a NaN loss, ...
        kind, line = "error", f"tetron: {'' if rank == 0 else f'rank {rank}: '}error: {err}"
    elif _is_timeout(err):
        # One line instead of a C++ stack: the usual cause is another rank, not this one.
        kind, line = "timeout", (f"tetron: rank {rank}: a collective did not finish within "
                                 f"parallel.timeout_s={cfg.parallel.timeout_s:g} s (a rank died or hangs)")
        if report is None and "MASTER_ADDR" in os.environ:  # tetron's launcher names them itself
            silent = _silent_ranks(rank)
            if silent is None:
                raise SystemExit(1) from None  # a lower rank that timed out too says it
            if silent:
                line += f"; {'rank' if len(silent) == 1 else 'ranks'} {', '.join(map(str, silent))} stopped answering"
    elif _is_peer_gone(err):
        kind, line = "peer", f"tetron: rank {rank}: another rank went away during a collective ({err})"
    else:
        if report is not None:  # torch's launcher keeps a rank's traceback to itself: print it (and so log it)
            traceback.print_exception(err)
        raise err
    if report is not None:
        report.write(kind, message=str(err))
    else:
        print(line.splitlines()[0], file=sys.stderr, flush=True)
    raise SystemExit(1) from None


def _silent_ranks(rank: int, wait_s: float = 2.0) -> list[int] | None:
    """After a timeout under torchrun: each rank that timed out says so in the job's store and waits a
    moment for the others; the ranks that never said so are the ones that stopped answering. Returns them
    on the lowest rank that timed out, None on the others (one line for the job), [] when the store cannot
    tell (it may live in the rank that stopped)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    prefix = f"tetron/timed_out/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=wait_s + 3))
        store.set(f"{prefix}{rank}", "1")
        time.sleep(wait_s)
        said = [r for r in range(world) if store.check([f"{prefix}{r}"])]
    except (RuntimeError, ValueError, OSError):  # DistStoreError and DistNetworkError are RuntimeErrors
        return []
    return [r for r in range(world) if r not in said] if min(said, default=rank) == rank else None


def _abort(sig: signal.Signals, out: str, *, announce: bool) -> None:
    """A second stop signal: end this process now (from the signal thread, whatever the main thread is
    blocked in). Saves are atomic, so the last complete checkpoint stays whole."""
    if announce:
        latest = find_latest(Path(out))
        where = f"the last complete checkpoint is {latest}" if latest else "no checkpoint was saved"
        os.write(2, f"tetron: aborted by a second {sig.name}; {where}\n".encode())
    os._exit(128 + sig)


def _stopped_note(agent: int) -> Path:
    """Where the first rank of a node notes that it saved after a stop signal, for torchrun_main in the
    process `agent` (torchrun's agent starts the ranks as its own children): a folder only it creates."""
    return Path(tempfile.gettempdir()) / f"tetron-torchrun-{agent}" / "stopped"


def torchrun_main(argv: list[str] | None = None) -> int:
    """torchrun with `argv`; 0 when it ends by a signal the ranks saved on (the first rank of this node notes
    the save in _stopped_note), else as torchrun ends."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    note = _stopped_note(os.getpid())
    shutil.rmtree(note.parent, ignore_errors=True)  # left by a killed process that had this pid
    note.parent.mkdir(mode=0o700)
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except SignalException:
        if not note.is_file():  # the ranks did not save: a failure, as torchrun says
            raise
    finally:
        shutil.rmtree(note.parent, ignore_errors=True)
    return 0  # the ranks' own last line (stop.stopped_line) said where they saved


if __name__ == "__main__":
    sys.exit(torchrun_main())
