"""The launching process's view of its ranks, and the one line a run ends with.

`tetron train` starts its ranks through torch's elastic launcher, run in a thread so that this process
keeps its own signal handling and a watch loop. Each rank keeps a small report file in a private folder:
its pid when it starts, how it ended when it ends (stopped by a signal and saved, a user error, a
collective that timed out, a peer that went away). From those the watch loop

  - passes a stop request (SIGTERM, SIGINT, checkpoint.stop_signal) on to every rank, once;
  - after a rank has failed, kills what still runs after a moment (a rank stopped or hung in a collective
    never ends by itself, and the launcher would wait for it) and remembers it as the rank that stopped
    answering;
  - on a second stop signal, kills every rank at once;
  - notes how each rank's process ends (a thread waits on it without collecting it: torch's launcher, its
    parent in this process, does that), and when the launcher restarts the ranks says which rank ended the
    attempt and how, and where the ranks resume;

and `finish` turns the reports into one line: where to resume, the user error, the ranks that stopped
answering, or the rank that died.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tetron.fs import find_latest, write_json, write_text
from tetron.observe.metrics import console_line
from tetron.stop import FORWARDED, stop_signals, stopped_line, watch_signals

FAILED = ("error", "timeout", "peer")  # report states of a rank that ended the run
GRACE_S = 1.0  # after a rank failed, how long the others get to end by themselves before they are killed
ABORT_WAIT_S = 10.0  # after an abort killed every rank, how long the launcher gets to wind down
STOP_FILE = "stop"  # in the report folder: a stop was requested (ranks that start later stop at once)


class RankReport:
    """One rank's report file: its pid and state ("running", then "stopped", "done" or one of FAILED)."""

    def __init__(self, folder: Path, *, rank: int, attempt: int) -> None:
        self.folder, self.rank, self.attempt = Path(folder), rank, attempt
        self.path = self.folder / f"attempt{attempt}_rank{rank}.json"

    def write(self, state: str, **fields: Any) -> None:
        write_json(self.path, {"pid": os.getpid(), "rank": self.rank, "attempt": self.attempt, "state": state,
                               **fields})

    def stop_requested(self) -> bool:
        return (self.folder / STOP_FILE).exists()


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process `pid` (R, S, D, T, Z, ...), None when it is gone;
    "?" where there is no /proc to ask."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return "?"
        except OSError:
            return None


def resume_point(out: str) -> str:
    """Where restarted ranks continue: the latest checkpoint of the run folder, or from the start."""
    latest = find_latest(Path(out))
    return f"resuming from {latest}" if latest else "starting over: no checkpoint was saved"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


_STATES = {"T": " (its process is stopped)", "t": " (stopped by a debugger)", "D": " (stuck in uninterruptible I/O)"}


def _exit_code(process: multiprocessing.process.BaseProcess, wait_s: float = 2.0) -> int | None:
    """The exit code of a process whose sentinel has closed (minus the signal that ended it). Reading it collects
    the process, as torch's launcher does from its own thread; the loser of the two waitpid calls reads None for
    the moment the winner takes to record the code, and a restart read then blamed the dead rank's peer."""
    deadline = time.monotonic() + wait_s
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode


class RankWatch:
    """Run the launcher (a callable) in a thread and watch its ranks through `folder`'s reports."""

    def __init__(self, folder: Path, *, out: str, steps: int, timeout_s: float, stop_signal: str | None,
                 max_restarts: int = 0) -> None:
        self.folder, self.out, self.steps, self.timeout_s = Path(folder), out, steps, timeout_s
        self.max_restarts = max_restarts
        # (attempt, rank) -> (when its process ended, the launcher's Process object for it)
        self.exits: dict[tuple[int, int], tuple[float, multiprocessing.process.BaseProcess]] = {}
        self.waiters: dict[int, tuple[int, threading.Thread]] = {}  # pid -> (attempt, its exit watcher)
        self.signals = stop_signals(stop_signal)
        self.stop_signal: str | None = None  # the signal that asked this run to stop
        self.attempt = -1
        self.forwarded: set[int] = set()  # pids the stop request was passed on to
        self.failed_at: float | None = None
        self.stuck: dict[int, str] = {}  # rank -> its process state, for ranks killed because they did not end
        self.aborted: signal.Signals | None = None  # a second stop signal: every rank killed
        self.aborted_at = 0.0

    def reports(self) -> dict[int, dict[str, Any]]:
        """The latest attempt's reports by rank."""
        found: dict[int, dict[int, dict[str, Any]]] = {}
        for path in self.folder.glob("attempt*_rank*.json"):
            try:
                r = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced this very moment
            found.setdefault(r["attempt"], {})[r["rank"]] = r
        return found[max(found)] if found else {}

    def run(self, launcher: Callable[[], Any]) -> int:
        """Start `launcher()` (the elastic launch) in a thread; watch until it returns; the exit code."""
        outcome: dict[str, BaseException] = {}

        def agent() -> None:
            try:
                launcher()
            except BaseException as err:  # handed to finish(), in the main thread
                outcome["error"] = err

        thread = threading.Thread(target=agent, name="tetron-launcher", daemon=True)
        restore = watch_signals(self.signals, on_stop=self.on_stop, on_abort=self.on_abort)  # nobody forwards to us
        try:
            thread.start()
            while thread.is_alive():
                thread.join(0.2)
                self.poll()
                if self.aborted is not None and time.monotonic() - self.aborted_at > ABORT_WAIT_S:
                    os._exit(128 + self.aborted)  # the launcher did not wind down: end without it
        finally:
            restore()
        return self.finish(outcome.get("error"))

    def on_stop(self, name: str) -> None:
        if self.stop_signal is None:
            self.stop_signal = name
            write_text(self.folder / STOP_FILE, name + "\n")

    def on_abort(self, sig: signal.Signals) -> None:
        """A second stop signal: kill every rank now (the launcher then winds down, and restarted ranks
        find the stop file and end at once); finish() says so."""
        self.on_stop(sig.name)
        self.aborted_at = time.monotonic()
        self.aborted = sig
        for report in self.reports().values():
            _kill(report["pid"])

    def poll(self) -> None:
        """One look at the reports: pass a stop request on, kill what still runs after a failure."""
        reports = self.reports()
        attempt = max((r["attempt"] for r in reports.values()), default=-1)
        if attempt != self.attempt:  # the launcher restarted the ranks: a new set of processes
            if attempt > 0:
                console_line(f"tetron: {self.restart_line(attempt)}")
            self.attempt, self.forwarded, self.failed_at, self.stuck = attempt, set(), None, {}
        running = {rank: r for rank, r in reports.items() if r["state"] == "running"}
        new = {rank: r["pid"] for rank, r in running.items() if r["pid"] not in self.waiters}
        # the launcher's own children, looked up once, while they run (a rank started otherwise has none: it is
        # not watched, and a restart then blames the rank whose report says why)
        children = {p.pid: p for p in multiprocessing.active_children()} if new else {}
        for rank, pid in new.items():
            waiter = threading.Thread(target=self._note_exit, args=(attempt, rank, children.get(pid)), daemon=True,
                                      name="tetron-rank-exit")
            self.waiters[pid] = (attempt, waiter)
            waiter.start()
        if self.aborted is not None:
            for r in running.values():
                _kill(r["pid"])
        if self.stop_signal is not None:
            for r in running.values():
                if r["pid"] not in self.forwarded:
                    self.forwarded.add(r["pid"])
                    try:
                        os.kill(r["pid"], FORWARDED)
                    except OSError:
                        pass
        if self.failed_at is None and any(r["state"] in FAILED for r in reports.values()):
            self.failed_at = time.monotonic()
        if self.failed_at is not None and time.monotonic() - self.failed_at > GRACE_S:
            for rank, r in running.items():
                state = process_state(r["pid"])
                if state not in (None, "Z") and rank not in self.stuck:
                    self.stuck[rank] = state
                    _kill(r["pid"])

    def _note_exit(self, attempt: int, rank: int, process: multiprocessing.process.BaseProcess | None) -> None:
        """Note when a rank's process ends (its sentinel closes), so that a restart can name the rank that died
        first and, from its Process object, its signal. Waiting on the sentinel never collects the process, so
        it cannot race torch's launcher for it (a waitid(WNOWAIT) did, on a loaded machine, and lost: the restart
        then blamed the dead rank's peer); the exit code is read once the launcher has collected it."""
        if process is None:
            return
        multiprocessing.connection.wait([process.sentinel])
        self.exits[(attempt, rank)] = (time.monotonic(), process)

    def first_failure(self, attempt: int, reports: dict[int, dict[str, Any]]) -> str:
        """What ended `attempt`, in words: a rank's user error; else the first rank whose process died without a
        word (a signal, a crash); else a rank whose collective timed out or lost its peer (which is what the
        others of a dead rank meet)."""
        # the attempt's ranks have ended: let their exit watchers note when (on a loaded machine a watcher whose
        # sentinel has closed may not yet have run again, and the restart would blame a rank's peer instead)
        for a, waiter in self.waiters.values():
            if a == attempt:
                waiter.join(timeout=5)
        ordered = [r for _, r in sorted(reports.items())]
        errors = [r for r in ordered if r["state"] == "error"]
        if errors:
            return f"rank {errors[0]['rank']} failed (an error)"
        silent = sorted((when, rank, code) for (a, rank), (when, process) in self.exits.items()
                        if a == attempt and reports.get(rank, {}).get("state", "running") == "running"
                        and (code := _exit_code(process)))
        if silent:
            _, rank, how = silent[0]
            return (f"rank {rank} was killed by {signal.Signals(-how).name}" if how < 0 else
                    f"rank {rank} exited with code {how}")
        failed = [r for r in ordered if r["state"] in FAILED]
        if failed:
            what = {"timeout": "a collective that timed out", "peer": "a lost peer"}[failed[0]["state"]]
            return f"rank {failed[0]['rank']} failed ({what})"
        return "a rank failed"

    def restart_line(self, attempt: int) -> str:
        """The line a restart begins with: which rank failed and how, and where the ranks resume."""
        previous: dict[int, dict[str, Any]] = {}
        for path in self.folder.glob(f"attempt{attempt - 1}_rank*.json"):
            try:
                r = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            previous[r["rank"]] = r
        return (f"restart {attempt} of {self.max_restarts} after {self.first_failure(attempt - 1, previous)}: "
                f"{resume_point(self.out)}")

    def resume_hint(self) -> str:
        """How to go on after a failed run: resume where a checkpoint was saved, else start again."""
        if find_latest(Path(self.out)) is not None:
            return "continue with --resume auto"
        return "no checkpoint was saved: run the same command again to start over"

    def finish(self, error: BaseException | None) -> int:
        """Print the run's last line (if it needs one) and return the exit code."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        reports = self.reports()
        if self.aborted is not None:
            latest = find_latest(Path(self.out))
            where = f"the last complete checkpoint is {latest}" if latest else "no checkpoint was saved"
            print(f"tetron: aborted by a second {self.aborted.name}: every rank was killed; {where}", file=sys.stderr,
                  flush=True)
            return 128 + self.aborted
        if error is None:
            by = self.stop_signal or self.rank_signal(reports)
            if by is not None and reports.get(0, {}).get("state") == "stopped":
                latest = find_latest(Path(self.out))  # the step the ranks saved (or an earlier attempt did)
                if latest is None:
                    print(f"tetron: stopped by {by} before any checkpoint was saved", flush=True)
                else:
                    step = int(latest.name.removeprefix("step_"))
                    print(stopped_line(by, step, steps=self.steps, folder=str(latest)), flush=True)
            return 0
        if not isinstance(error, ChildFailedError):
            raise error
        print(self.failure_line(error, reports), file=sys.stderr, flush=True)
        return 1

    @staticmethod
    def rank_signal(reports: dict[int, dict[str, Any]]) -> str | None:
        """A stop signal sent to a rank rather than to this process (a scheduler signalling one process, `kill`
        of a rank's pid): `SIGTERM (sent to rank 1)`, from the reports of the ranks that saw it."""
        seen = [r for _, r in sorted(reports.items()) if r["state"] == "stopped" and r.get("signal")]
        return f"{seen[0]['signal']} (sent to rank {seen[0]['rank']})" if seen else None

    def failure_line(self, error: Any, reports: dict[int, dict[str, Any]]) -> str:
        """One line for a failed run, from the ranks' reports and the launcher's failures."""
        errors = [r for _, r in sorted(reports.items()) if r["state"] == "error"]
        if errors:
            return f"tetron: error: {errors[0]['message']}"
        timed_out = sorted(rank for rank, r in reports.items() if r["state"] == "timeout")
        if timed_out:
            limit = f"parallel.timeout_s={self.timeout_s:g} s"
            if self.stuck:
                stuck = sorted(self.stuck)
                how = "".join(sorted({_STATES.get(s, "") for s in self.stuck.values()}))
                return (f"tetron: error: {_ranks(stuck)} stopped answering{how}: {_ranks(timed_out)} waited {limit} "
                        f"in a collective; the run ended ({self.resume_hint()})")
            return (f"tetron: error: {_ranks(timed_out)}: a collective did not finish within {limit} "
                    f"(a rank died or hangs)")
        for rank, failure in sorted(error.failures.items()):
            if failure.exitcode < 0 and reports.get(rank, {}).get("state", "running") == "running":
                name = signal.Signals(-failure.exitcode).name
                return (f"tetron: error: rank {rank} was killed by {name} (out of memory, or killed from outside); "
                        f"the run ended ({self.resume_hint()})")
        rank, first = next(iter(error.failures.items()))
        return f"tetron: training failed on rank {rank} (exit code {first.exitcode}); see its error above"
