"""Hugging Face hub names, checked fast before anything waits on the network.

A hub look-up with no network retries for tens of seconds and prints pages of warnings. So before one,
tetron asks two cheap questions: is the name in the local cache (then the libraries find it offline),
and can the hub be reached at all (offline mode set in the environment, or a TCP connection to its host
within a few seconds). A name that is neither cached nor reachable is refused in one line, at once.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
PROBE_TIMEOUT_S = 3.0


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories (HF_HUB_CACHE, HF_HOME, or ~/.cache/huggingface)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(home).expanduser() / "hub"


def datasets_cache() -> Path:
    """Where `datasets` keeps prepared datasets (HF_DATASETS_CACHE, or HF_HOME/datasets)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    return hub_cache().parent / "datasets"


def is_cached(name: str, kind: str) -> bool:
    """Whether hub repository `name` ("org/name" or "name") of `kind` ("model" or "dataset") has been
    downloaded before (then the libraries can load it without the network)."""
    repo = name.replace("/", "--")
    if (hub_cache() / f"{kind}s--{repo}" / "snapshots").is_dir():
        return True
    return kind == "dataset" and any(datasets_cache().glob(f"{name.replace('/', '___')}*"))


def _endpoint() -> tuple[str, int]:
    """The host and port a hub request would connect to first: a proxy if one is set, else the hub."""
    url = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or \
        os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    parsed = urlparse(url if "://" in url else f"http://{url}")
    return parsed.hostname or "huggingface.co", parsed.port or (443 if parsed.scheme == "https" else 80)


def offline_reason(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot be reached (offline mode, no route, no name resolution), or None if it can.
    Takes at most `timeout_s` (name resolution, which can hang, runs in a thread that is left behind)."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} (offline mode)"
    host, port = _endpoint()
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append(None)
        except OSError as err:
            result.append(f"{host}:{port} cannot be reached ({err.strerror or type(err).__name__})")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else f"{host}:{port} did not answer within {timeout_s:g} s"


def hub_problem(name: str, kind: str) -> str | None:
    """None when hub repository `name` can be loaded (cached, or the hub is reachable); else why not."""
    if is_cached(name, kind):
        return None
    reason = offline_reason()
    if reason is None:
        return None
    return (f"not a local path, not in the Hugging Face cache ({hub_cache()}), and the hub is unreachable: {reason}; "
            f"give a local folder, or download it once where there is network")
