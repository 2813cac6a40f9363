"""The errors a user can fix, each a one-line message naming the field or file and what would work.

`tetron` prints such an error as one line and exits 2, before any process group starts (or, for what only
a running rank can meet, such as a full disk, as the one line that ends the run)."""

from __future__ import annotations

import reprlib
import sys

# How an error line quotes a value: a short prefix, however large the value (a 400-digit number, a YAML
# alias that expands to a billion items): reprlib stops at these depths and lengths instead of walking it all.
_QUOTE = reprlib.Repr()  # (set attribute by attribute: Python 3.10 and 3.11 take no keywords)
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxlong, _QUOTE.maxother = 2, 40, 24, 40
_QUOTE.maxtuple = _QUOTE.maxlist = _QUOTE.maxdict = _QUOTE.maxset = _QUOTE.maxfrozenset = _QUOTE.maxdeque = 3


class UserError(ValueError):
    """A problem with the user's input; the message is one line for the user."""


class ConfigError(UserError):
    """A bad value in the run configuration, naming the field."""


class DataError(UserError):
    """A data source or tokenizer problem, naming it and a fix."""


class CheckpointError(UserError):
    """A checkpoint or model folder that cannot be used, naming the file."""


class StorageError(UserError):
    """A file that could not be written (a full disk, a read-only folder), naming it and what would help."""


def quoted(value: object) -> str:
    """`repr(value)`, cut to a short prefix (at most about 60 characters) for an error line."""
    if isinstance(value, int) and value.bit_length() > 10_000:  # repr() refuses ints of over 4,300 digits
        return f"<an integer of {value.bit_length():,} bits>"
    return _QUOTE.repr(value)


def check(ok: bool, message: str, error: type[UserError] = ConfigError) -> None:
    """Raise `error(message)` unless `ok`."""
    if not ok:
        raise error(message)


def quoted_key(key: object) -> str:
    """An unknown key as an error line names it: as written, cut to a short prefix."""
    text = str(key) if not isinstance(key, int) or key.bit_length() < 10_000 else quoted(key)
    return text if len(text) <= 40 else text[:40] + "..."


def failed(message: str) -> int:
    """Print a user error as tetron's one line on stderr; returns the exit status for it, 2."""
    print(f"tetron: error: {message}", file=sys.stderr)
    return 2
