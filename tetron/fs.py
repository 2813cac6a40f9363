"""Files, safely: writes that a kill at any moment leaves either old or new, never half; reads that are
bounded; a lock that keeps two runs out of one folder.

Everything tetron writes that another run may read (checkpoints, model folders, token caches,
tokenizers, logs moved aside) goes through these: write under a temporary name in the same folder,
sync, rename over the final name, sync the folder. Every small file it reads back (JSON, `latest`,
tokenizer descriptions) goes through `read_bounded`: a regular file, no larger than a limit, so that
no FIFO, device or giant file can make a read hang or exhaust memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import select
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

from tetron.errors import CheckpointError, StorageError, quoted


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _sync_file_range() -> Any:
    """Linux's sync_file_range from the C library (os has none), or None elsewhere."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the dirty pages out; wait for nothing


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Let the disk start on bytes already written, so that the fsync closing the file waits only for the
    last of them: without it the kernel holds a large file's pages in memory until that fsync, which then
    writes all of it while the writer sits idle. A hint: where the call is missing or fails, nothing."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path, tag: str = "") -> Path:
    """A sibling of `path` no other writer uses: `{name}.tmp-{tag}{random}`."""
    return path.with_name(f"{path.name}.tmp-{tag}{secrets.token_hex(4)}")


def write_bytes(path: Path, data: bytes, *, replace: bool = True) -> None:
    """`data` written to a temporary name, synced, then renamed over `path`; with `replace=False`, linked to
    `path` instead, which raises FileExistsError when anything (a file, a folder, a link, a device) has that
    name: a user-named file never replaces what is there, and never writes through it."""
    tmp = temp_name(path)
    try:
        tmp.write_bytes(data)
        fsync_file(tmp)
        if replace:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    except OSError as err:
        err.filename = err.filename or str(path)  # a failed write() names no file: name the one meant
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, path: Path) -> None:
    """Give the complete file `tmp` the new name `path`, atomically and never over an existing one."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # a file system without hard links: create the name exclusively, then copy the bytes in
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(tmp.read_bytes())
            fh.flush()
            os.fsync(fh.fileno())


def write_text(path: Path, text: str, *, replace: bool = True) -> None:
    """`text` written atomically (see write_bytes)."""
    write_bytes(path, text.encode("utf-8"), replace=replace)


def write_json(path: Path, obj: Any, *, indent: int = 1) -> None:
    """JSON written atomically (see write_text)."""
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def replace_folder(tmp: Path, folder: Path, *, overwrite: bool = True) -> None:
    """Sync every file of the complete folder `tmp`, then put it at `folder`.

    An existing `folder` is first renamed to `{folder}.tmp-old-*` and removed once the new one is in
    place (a kill between the two renames leaves that copy, which checkpoint.clean_stale restores).
    With `overwrite=False` an existing `folder` is an error and nothing is touched."""
    for f in tmp.iterdir():
        if f.is_file():
            fsync_file(f)
    fsync_dir(tmp)
    old = None
    if folder.exists():
        if not overwrite:
            raise FileExistsError(f"{folder}: already exists")
        old = temp_name(folder, "old-")
        folder.rename(old)
    tmp.rename(folder)
    fsync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_temps(parent: Path, name: str | None = None) -> None:
    """Clear what writers killed mid-way left in `parent` (only the temporaries of `name`, if given):
    a `.tmp-old-*` folder whose final name is free is the previous version that replace_folder had
    moved aside, the only copy left, so it goes back; every other temporary is removed."""
    for p in parent.iterdir() if parent.is_dir() else []:
        if ".tmp-" not in p.name or (name is not None and not p.name.startswith(f"{name}.tmp-")):
            continue
        final = parent / p.name.split(".tmp-")[0]
        if ".tmp-old-" in p.name and p.is_dir() and not final.exists():
            p.rename(final)
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, which must hold at most `limit` bytes. A FIFO or device
    (which could block or never end) or a larger file raises OSError naming the problem in strerror."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # non-blocking: opening a FIFO must not wait for a writer
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than the {limit} expected", str(path))
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while being read
        raise OSError(errno.EFBIG, f"more than the {limit} bytes expected", str(path))
    return data


def missing_reason(path: Path) -> str:
    """Why nothing can be read at `path`, for an error line: "no such file", or what stands there instead (a
    loop of symbolic links, a link to nothing, a FIFO, socket, device or folder: none of which is "not there")."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if os.path.islink(path) and err.errno == errno.ENOENT:
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        return {errno.ELOOP: "a loop of symbolic links", errno.ENOENT: "no such file"}.get(err.errno, str(err))
    kinds = {stat.S_ISFIFO: "a FIFO (a named pipe)", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device",
             stat.S_ISBLK: "a device", stat.S_ISDIR: "a folder"}
    return next((f"{what}, not a file" for test, what in kinds.items() if test(mode)), "not a regular file")


CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # characters that end or disturb a line: newline, tab, escape, ...


def what_exists(path: Path) -> str | None:
    """What has the name `path`, in words ("a file", "a folder", "a FIFO (a named pipe)", "a device", "a
    symbolic link", ...), not following a final symbolic link; None when nothing has it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:  # a path through a file, a name too long: something stands in the way
        return err.strerror or str(err)
    kinds = {stat.S_ISREG: "a file", stat.S_ISDIR: "a folder", stat.S_ISLNK: "a symbolic link",
             stat.S_ISFIFO: "a FIFO (a named pipe)", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device",
             stat.S_ISBLK: "a device"}
    return next((what for test, what in kinds.items() if test(mode)), "something that is not a file")


def has_control(text: str) -> bool:
    """Whether `text` holds a control character (a newline, a tab, an escape): such a path or value cannot be
    named on one line of a log, a message or a script."""
    return CONTROL.search(text) is not None


def check_new_file(name: str, flag: str, *, replaces: bytes | None = None) -> bool:
    """Where a command writes the file `flag` names: only where nothing is (a user's file, a folder, a device
    or FIFO is never replaced, never written through), in a folder this user can write. With `replaces`, a
    regular file whose bytes begin so (what the command wrote there before, such as a PNG) may be replaced:
    returns whether one is there. Anything else is a StorageError naming the flag."""
    path = Path(name).expanduser()
    if name.strip() == "" or has_control(name):
        raise StorageError(f"{flag}={quoted(name)}: give a file name (on one line, without control characters)")
    what = what_exists(path)
    if what is not None:
        if replaces is not None and what == "a file" and _begins(path, replaces):
            return True
        mine = " (not one this command wrote)" if replaces is not None and what == "a file" else ""
        raise StorageError(f"{flag} {name}: {what} is already there{mine}; give a new file name (nothing is "
                           f"overwritten)")
    parent = path.parent
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise StorageError(f"{flag} {name}: {parent} is not a folder this user can write; give a file in a "
                           f"writable folder")
    return False


def _begins(path: Path, prefix: bytes) -> bool:
    """Whether the regular file `path` (not a link) begins with `prefix`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(prefix), 0) == prefix
    finally:
        os.close(fd)


def describe_size(n: float) -> str:
    """Bytes in words: 512 B, 3.1 MiB, 2.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def write_failure(err: BaseException, folder: Path, *, needed: int | None = None) -> str | None:
    """One line for an error met while writing into `folder` (the file, what went wrong, the free space
    where the disk is full), or None when `err` is not a failed write."""
    text = str(err)
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
    full = full or "No space left on device" in text or "os error 28" in text
    if not full and not isinstance(err, OSError):
        return None
    name = getattr(err, "filename", None)
    if not name and folder.is_dir():  # the file being written is the newest one
        files = [p for p in folder.iterdir() if p.is_file()]
        name = str(max(files, key=lambda p: p.stat().st_mtime_ns)) if files else str(folder)
    name = name or str(folder)
    if full:
        try:
            free = describe_size(shutil.disk_usage(folder if folder.exists() else folder.parent).free)
        except OSError:
            free = "unknown"
        want = f"; it needs about {describe_size(needed)}" if needed else ""
        return f"{name}: no space left on device ({free} free{want})"
    reason = err.strerror if isinstance(err, OSError) and err.strerror else text.splitlines()[0] if text else "failed"
    return f"{name}: cannot write ({reason})"


# --------------------------------------------------------------------------- the run folder

STATE_FILE = "trainer_state.json"  # written last: a folder without it is not a checkpoint
STEP_DIR = re.compile(r"^step_(\d+)$")
RUN_LOCK = "tetron.lock"  # in OUT while a run uses it (FolderLock)
MAX_JSON_BYTES = 256 << 20  # the largest JSON file read from a checkpoint or model folder


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file of at most `limit` bytes, parsed; any problem is a CheckpointError naming it."""
    try:
        return json.loads(read_bounded(path, limit).decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as err:  # bad UTF-8, bad JSON, an integer too long to convert
        raise CheckpointError(f"{path}: not valid JSON ({str(err).splitlines()[0]})") from None


def checkpoints_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete `step_N` folders under OUT/checkpoints, in the order they were written (oldest
    first). Not by step: a run resumed from an earlier step into the same OUT writes lower step
    numbers after higher ones, and `keep` must keep what was written last."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return []
    found = [((p / STATE_FILE).stat().st_mtime_ns, int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, _, p in sorted(found)]


def find_latest(out: Path) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the last complete one written, else None."""
    root = checkpoints_dir(out)
    try:
        name = read_bounded(root / "latest", 256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if STEP_DIR.match(name) and (root / name / STATE_FILE).is_file():
        return root / name
    done = complete_checkpoints(out)
    return done[-1] if done else None


def is_run_folder(out: Path) -> bool:
    """Whether the folder `out` is empty or recognisably a tetron run folder: its log, only its lock and its
    ranks' logs (a run killed before it wrote anything else), a checkpoints/ with `latest` or a step_N, or a
    model/ with tetron's tokenizer file. A lock beside anything else marks nothing: any folder can hold a file
    of that name, and a run that wrote more than its lock wrote one of these marks."""
    names = {p.name for p in out.iterdir()}
    if "metrics.jsonl" in names:
        return True
    rest = names - {RUN_LOCK}
    if not rest:
        return True
    logs = out / "logs"  # the ranks' logs come first: under torchrun another rank may have begun them
    if rest == {"logs"} and logs.is_dir() and all(re.fullmatch(r"rank_\d+\.log", p.name) for p in logs.iterdir()):
        return True
    root = checkpoints_dir(out)
    if root.is_dir() and any(p.name == "latest" or STEP_DIR.match(p.name.split(".tmp-")[0]) for p in root.iterdir()):
        return True
    return (out / "model" / "tetron_tokenizer.json").is_file()


def earlier_run(out: Path) -> list[str]:
    """What of an earlier run the folder `out` holds that a new run would mix with or replace: its metrics
    (a new run appends to them), its last complete checkpoint, its model/ (an empty list: none of these)."""
    metrics, model, done = out / "metrics.jsonl", out / "model", complete_checkpoints(out)
    found = ["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size > 0 else []
    found += [f"checkpoints/{done[-1].name}"] if done else []
    return found + (["model/"] if model.is_dir() and any(model.iterdir()) else [])


def aside_name(folder: Path) -> Path:
    """The first `folder.old-N` beside `folder` that does not exist."""
    n = 1
    while (aside := folder.with_name(f"{folder.name}.old-{n}")).exists() or aside.is_symlink():
        n += 1
    return aside


def set_aside(folder: Path) -> Path:
    """Rename `folder` to `aside_name(folder)` and return the new path: moved, never deleted."""
    aside = aside_name(folder)
    os.rename(folder, aside)
    fsync_dir(aside.parent)
    return aside


def blocking_output() -> None:
    """Make standard output and error blocking, as a parent may hand them over non-blocking: CPython then drops,
    silently and with exit status 0, what the pipe cannot take at once."""
    for fd in (1, 2):
        try:
            os.set_blocking(fd, True)
        except OSError:  # closed, or not a file descriptor a flag can be set on
            pass


def write_output(text: str) -> None:
    """Print `text` and a newline whole, whatever the flags of the pipe underneath: a write the pipe cannot take
    now waits until it can (select), where print would drop the rest. CI once read `tetron plan --measure
    --json` cut at exactly 128 KiB with exit status 0, stdout non-blocking by then (the forked ranks share its
    open file; the cause was not found, so the write does not depend on it)."""
    stream = sys.stdout
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO): print is whole there
        print(text, file=stream)
        return
    stream.flush()
    data = memoryview((text + "\n").encode())
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            select.select([], [fd], [])
