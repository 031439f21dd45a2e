"""Fail fast, with the offline alternative, when the Hugging Face Hub cannot be reached.

Without this, ``datasets`` spends ~23 s and ``transformers`` ~48 s retrying before the same
ConnectionError; a short TCP probe (at most PROBE_TIMEOUT_S, usually well under a second on a
machine without network) answers first.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
_TRUE = {"1", "on", "yes", "true"}
_VERDICT_TTL_S = 60.0
_verdicts: dict[tuple[str, int], tuple[float, str | None]] = {}   # target -> (when, problem)


class HubUnavailableError(ConnectionError):
    """The hub is needed for a dataset or tokenizer and cannot be used (offline mode or no network)."""


def offline_mode() -> bool:
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in _TRUE for n in names)


def _probe_target() -> tuple[str, int]:
    # Behind a proxy the hub itself is not directly reachable: probe the proxy instead.
    return probe_target(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))


def probe_target(url: str) -> tuple[str, int]:
    """(host, port) to probe for ``url``: the HTTPS proxy if one is set, else the URL's host."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    parsed = urlparse(proxy or url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.hostname or urlparse(url).hostname or "localhost", port


def tcp_problem(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None if a TCP connection to host:port opens within ``timeout_s`` (name lookup included,
    which a socket timeout does not bound), else why not."""
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}:{port} is unreachable ({e})")

    worker = threading.Thread(target=connect, name=f"probe {host}", daemon=True)
    worker.start()
    worker.join(timeout_s + 0.2)
    return result[0] if result else f"{host}:{port} did not answer within {timeout_s:g} s"


def hub_problem(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot be used now (offline mode, or no answer), or None. The probe runs once
    per process (its verdict is reused for a minute), so the start-up check and the data and
    tokenizer loaders that follow it do not each wait for it."""
    if offline_mode():
        return "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / TRANSFORMERS_OFFLINE)"
    target = _probe_target()
    when, problem = _verdicts.get(target, (-1e9, None))
    if time.monotonic() - when > _VERDICT_TTL_S:
        problem = tcp_problem(*target, timeout_s=timeout_s)
        _verdicts[target] = (time.monotonic(), problem)
    return problem


def require_hub(what: str, alternative: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise HubUnavailableError naming ``alternative`` unless the hub is reachable now."""
    problem = hub_problem(timeout_s)
    if problem is not None:
        raise HubUnavailableError(
            f"{what} needs the Hugging Face Hub, but {problem}. Offline, use {alternative}.")
