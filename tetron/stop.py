"""Stopping a run on a signal, as clusters preempt jobs: finish the step, save, exit 0.

SIGTERM, SIGINT, SIGHUP (a closed terminal) and `checkpoint.stop_signal` (SIGUSR1 by default: Slurm's
`--signal=USR1@120` sends it before the time limit) ask a run to stop. Every rank notes the request; the
ranks agree on it through the all-reduce that already carries each step's loss (train.global_loss), so all
of them finish the same step, save a checkpoint together and exit 0. A second such signal aborts at once:
the previous checkpoint is whole, because saves are atomic. After a SIGHUP, output to the terminal that
closed goes to /dev/null (every write to it fails), so that the save's lines cannot end the save.

A signal is seen by a thread reading Python's signal wakeup fd, not by a Python handler, so that it
counts even while the main thread is blocked inside a collective: the second one can end the process
whatever the main thread is doing. A launched rank may receive one request twice within moments (torchrun
passes on a signal its ranks also got directly; a launcher that dies sends them its death signal once for
each of its threads), so there a repeat within SAME_REQUEST_S of the first is the same request. tetron's
own launcher passes requests on as FORWARDED, which never aborts.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import termios
import threading
import time
from typing import Callable

FORWARDED = signal.SIGUSR2  # tetron's launcher -> its ranks: "stop after this step" (never an abort)
SAME_REQUEST_S = 1.0  # a repeat of a stop signal within this many seconds is the same request
_UNCATCHABLE = {"SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGCONT", "SIGPIPE",
                "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGWINCH", "SIGURG", "SIGPROF", "SIGVTALRM", "SIGTRAP", "SIGSYS"}


def parse_signal(name: str) -> signal.Signals:
    """`USR1`, `SIGUSR1` or `sigusr1` -> signal.SIGUSR1; ValueError naming the choices for anything that
    cannot ask a run to stop (unknown, uncatchable, or tetron's own FORWARDED)."""
    key = name.upper()  # not stripped: the name lands in job.sh as given to Slurm, where a newline ends a line
    key = key if key.startswith("SIG") else f"SIG{key}"
    usable = _usable_signals()
    if key not in usable:
        raise ValueError(f"use one of {', '.join(usable)} ({FORWARDED.name} is tetron's own)")
    return signal.Signals[key]


@functools.cache
def _usable_signals() -> list[str]:
    """The names of the signals that can ask a run to stop, sorted."""
    return sorted(s.name for s in signal.Signals if s.name not in _UNCATCHABLE and s != FORWARDED
                  and not s.name.startswith("SIGRT") and s.name not in ("SIGIOT", "SIGCLD", "SIGPOLL"))


def stop_signals(extra: str | None) -> list[signal.Signals]:
    """SIGTERM, SIGINT, SIGHUP (the terminal closed, an ssh session dropped) and the configured extra signal
    (already checked by validate)."""
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    if extra:
        sig = parse_signal(extra)
        if sig not in signals:
            signals.append(sig)
    return signals


class StopRequest:
    """Whether this process has been asked to stop, and by which signal; read by the training loop once
    per step (train.global_loss), set by a signal (or by a test)."""

    def __init__(self) -> None:
        self.signal: str | None = None  # the name of the first stop signal

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def request(self, name: str) -> None:
        if self.signal is None:
            self.signal = name


def watch_signals(signals: list[signal.Signals], *, on_stop: Callable[[str], None],
                  on_abort: Callable[[signal.Signals], None], forwarded: bool = False,
                  same_request_s: float = 0.0) -> Callable[[], None]:
    """Call `on_stop(name)` on the first of `signals` (and on FORWARDED if `forwarded`), `on_abort(sig)` on a
    later one that comes more than `same_request_s` after the first; both from a thread. Returns a function
    that restores the previous handlers. Only the main thread can install handlers: elsewhere this does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    watched = [*signals, *([FORWARDED] if forwarded else [])]
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in watched}  # the C handler feeds the fd
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    first: list[float] = []

    def watch() -> None:
        while data := _read(read_fd):
            for number in data:
                sig = signal.Signals(number)
                if sig == signal.SIGHUP:
                    leave_lost_terminal()
                if sig == FORWARDED and forwarded:
                    on_stop(sig.name)
                elif sig in signals and not first:
                    first.append(time.monotonic())
                    on_stop(sig.name)
                elif sig in signals and time.monotonic() - first[0] > same_request_s:
                    on_abort(sig)
        os.close(read_fd)

    threading.Thread(target=watch, name="tetron-signals", daemon=True).start()

    def restore() -> None:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        os.close(write_fd)  # the watcher reads end-of-file and ends

    return restore


def leave_lost_terminal(fds: tuple[int, ...] = (1, 2)) -> None:
    """Point those of `fds` that are a terminal that hung up (it closed: the SIGHUP's cause) at /dev/null: every
    write to it fails with EIO, and the lines of a save after the SIGHUP must not end the save."""
    for fd in fds:
        try:
            termios.tcgetattr(fd)
        except termios.error as err:
            if err.args[0] != errno.EIO:  # ENOTTY: a file or a pipe, which still works
                continue
        except OSError:
            continue
        else:
            continue  # a terminal still there (a SIGHUP sent by kill): keep writing to it
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 64)
    except OSError:
        return b""


def stopped_line(signal_name: str, step: int, *, steps: int, folder: str) -> str:
    """The one line a run stopped by a signal ends with."""
    return (f"tetron: stopped by {signal_name} after step {step} of {steps}: saved {folder}; "
            f"continue with the same command and --resume auto")
