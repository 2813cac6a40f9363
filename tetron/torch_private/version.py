"""This torch's version, read once, for the checks of which private APIs it has in the form tetron calls."""

from __future__ import annotations

import re

import torch


def _parse(version: str) -> tuple[int, int]:
    """"2.13.0+cpu" -> (2, 13); a version that does not parse counts as new."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (99, 0)


TORCH_VERSION = _parse(torch.__version__)  # (major, minor)


def torch_at_least(major: int, minor: int, *, version: tuple[int, int] = TORCH_VERSION) -> bool:
    """Whether this torch (or `version`) is `major.minor` or newer."""
    return version >= (major, minor)
