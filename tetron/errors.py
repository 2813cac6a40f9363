"""The errors a user can fix, each a one-line message naming the field or file and what would work.

`tetron` prints such an error as one line and exits 2, before any process group starts (or, for what only
a running rank can meet, such as a full disk, as the one line that ends the run)."""

from __future__ import annotations


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


def check(ok: bool, message: str, error: type[UserError] = ConfigError) -> None:
    """Raise `error(message)` unless `ok`."""
    if not ok:
        raise error(message)
