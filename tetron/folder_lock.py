"""One writer per folder: a lock file that keeps two runs out of one run folder (cli.py) and two token-store
builds out of one store (data/store_build.py), and tells a lock left by a killed process from a live one."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from tetron.fs import read_bounded


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux), to tell it from a later process
    that was given the same pid; None where that cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return ticks is None or _start_ticks(pid) in (None, ticks)


class FolderLock:
    """`folder/name` held by one process at a time: an exclusive flock (the kernel drops it when the
    holder exits, however it exits), and the holder's pid, host and start time in the file, which tell a
    lock left by a killed process (same host, that process gone) from a live one, where flock cannot
    (a file system without it, or a holder on another host). `run_id` names a job whose restarted
    processes may take over their predecessor's lock."""

    def __init__(self, folder: Path, name: str, *, run_id: str | None = None) -> None:
        self.folder, self.path, self.run_id = Path(folder), Path(folder) / name, run_id
        self.fd: int | None = None
        self.created = False

    def holder(self) -> dict[str, Any] | None:
        """What the lock file says about its holder (None if absent, empty or unreadable)."""
        try:
            info = json.loads(read_bounded(self.path, 1 << 16))
        except (OSError, ValueError, RecursionError):
            return None
        return info if isinstance(info, dict) else None

    def _stale(self, info: dict[str, Any], *, flocked: bool | None) -> bool:
        """Whether the holder `info` is gone (when flock is unsupported, `flocked` is None)."""
        if self.run_id is not None and info.get("run_id") == self.run_id:
            return True  # an earlier attempt of this same job
        if info.get("host") != socket.gethostname():
            return False  # nothing here can tell whether a process on another host lives
        pid, ticks = info.get("pid"), info.get("start_ticks")
        if flocked or type(pid) is not int:
            return True
        return not _alive(pid, ticks if type(ticks) is int else None)

    def describe(self, info: dict[str, Any] | None) -> str:
        if not info:
            return f"{self.path} is held by another process"
        where = f"pid {info.get('pid')} on host {info.get('host')}, since {info.get('started')}"
        gone = "" if info.get("host") == socket.gethostname() else f"; if that run is gone, delete {self.path}"
        return f"{self.path} is held by another run ({where}){gone}"

    def acquire(self) -> None:
        """Take the lock, or raise BlockingIOError whose strerror says who holds it."""
        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            flocked = _try_flock(fd)
            same = flocked is not False and _same_file(self.path, fd)
            info = self.holder() if same else None
            if flocked is False or (same and info and not self._stale(info, flocked=flocked)):
                os.close(fd)
                self.release()
                raise BlockingIOError(errno.EAGAIN, self.describe(info or self.holder()), str(self.path))
            if not same:  # the file was released and removed between open and flock: try again
                os.close(fd)
                continue
            record = {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _start_ticks(os.getpid()),
                      "started": time.strftime("%Y-%m-%d %H:%M:%S"), "run_id": self.run_id}
            data = json.dumps(record).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            self.fd = fd
            return
        raise BlockingIOError(errno.EAGAIN, f"{self.path}: kept changing while being taken", str(self.path))

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and drop the lock; remove the folder if the lock
        created it and nothing else was written there."""
        if self.fd is not None:
            try:
                if _same_file(self.path, self.fd):
                    os.unlink(self.path)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        if self.created:
            try:
                self.folder.rmdir()  # only if empty
            except OSError:
                pass
            self.created = False


def _same_file(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (a lock released meanwhile is unlinked)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _try_flock(fd: int) -> bool | None:
    """An exclusive, non-blocking flock on `fd`: True if taken, False if another process holds it, None
    where the file system does not support it."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
