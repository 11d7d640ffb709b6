"""A hub id that cannot be reached fails at once: one probe of the hub (or of the proxy that
leads to it) bounded by `PROBE_TIMEOUT_S`, instead of the hub client's retries (52 s were
measured before the error on a machine without network).

With ``HF_HUB_OFFLINE=1`` nothing is probed: the local cache is all there is. Without
network, a model already in the local cache loads from it (``local_files_only``); one that
is not fails in one line naming ``HF_HUB_OFFLINE=1`` and local model directories.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from .errors import GenerateError

__all__ = ["PROBE_TIMEOUT_S", "hub_access", "hub_address", "hub_reachable", "reachable"]

PROBE_TIMEOUT_S = 3.0
"""How long the hub may take to accept a connection (name resolution included)."""

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
"""Environment variables of a proxy the hub client would go through (probed instead)."""


def hub_address() -> tuple[str, int]:
    """``(host, port)`` the hub client connects to first: the proxy where one is set, else
    the hub's endpoint (``HF_ENDPOINT``, ``https://huggingface.co`` by default)."""
    from huggingface_hub import constants

    proxy = next((os.environ[k] for k in PROXY_VARIABLES if os.environ.get(k)), None)
    if proxy:
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    else:
        url = urlsplit(constants.ENDPOINT)
    default = 443 if url.scheme == "https" else 80
    return url.hostname or "huggingface.co", url.port or default


def reachable(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` seconds, name
    resolution included (it runs in a daemon thread, as the resolver has no timeout)."""
    opened: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            opened.append(True)
        except OSError:
            opened.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(opened and opened[0])


@functools.cache
def hub_reachable() -> bool:
    """Whether the hub (or its proxy) accepts a connection; probed once per process."""
    return reachable(*hub_address())


def _cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id``'s config."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repository id
        return False


def hub_access(repo_id: str) -> dict[str, Any]:
    """Keyword arguments for transformers' ``from_pretrained`` of a hub id: none where the
    hub can be reached; ``local_files_only=True`` where it cannot (or ``HF_HUB_OFFLINE`` is
    set) and the model is in the local cache.

    Raises:
        GenerateError: the hub cannot be reached (or ``HF_HUB_OFFLINE`` is set) and the
            model is not in the local cache; the message names ``HF_HUB_OFFLINE=1`` and
            local model directories.
    """
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    if not offline and hub_reachable():
        return {}
    if _cached(repo_id):
        return {"local_files_only": True}
    local = (
        "give a local model directory instead (--model ./DIR: one saved with save_pretrained, "
        f"or `hf download {repo_id} --local-dir DIR` where there is network)"
    )
    if offline:
        raise GenerateError(
            f"{repo_id}: not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 keeps the "
            f"hub out of reach: {local}"
        )
    host, port = hub_address()
    raise GenerateError(
        f"{repo_id}: the Hugging Face hub cannot be reached (no connection to {host}:{port} "
        f"within {PROBE_TIMEOUT_S:g} s) and the model is not in the local cache: {local}; "
        "once it is cached, HF_HUB_OFFLINE=1 loads it without asking the hub"
    )
