"""The limits themselves, apart from the HTTP plumbing (``middleware.py``): API keys, per-key concurrency and rate
(moving window of the ``limits`` library), and JSON bodies parsed only within a nesting depth."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np
from limits import parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from .errors import GatewayError
from .tenants import key_tenant

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes included
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays / objects in ``body`` (brackets inside strings do not count), in linear time
    and without recursion, so it can run before any parser sees the bytes."""
    a = np.frombuffer(_STRING.sub(b'""', body), np.uint8)
    if not a.size:
        return 0
    delta = np.isin(a, _OPEN).astype(np.int32) - np.isin(a, _CLOSE).astype(np.int32)
    return int(max(np.cumsum(delta).max(), 0))


def bounded_loads(body: bytes, max_depth: int):
    """``json.loads`` of a request body nested at most ``max_depth`` deep; 400 otherwise."""
    depth = json_depth(body)
    if depth > max_depth:
        raise GatewayError(400, f"the JSON body is nested {depth} deep; at most {max_depth} levels are accepted",
                           code="json_too_deep")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise GatewayError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


class KeyRing:
    """The accepted API keys (none: no authentication). ``identify`` -> a short id of the key for the limits
    and the logs (never the key); ``tenant_of`` that id -> the key's tenant (``names``: key -> tenant name; a key
    without one is its own tenant, named by :func:`~.tenants.key_tenant`)."""

    def __init__(self, keys: Iterable[str], names: Mapping[str, str] | None = None):
        keys = [k for k in keys if k]
        self._keys = [k.encode() for k in keys]
        names = names or {}
        self._tenants = {_key_id(k): names.get(k) or key_tenant(k) for k in keys}

    def tenant_of(self, key_id: str) -> str:
        return self._tenants[key_id]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str:
        if not self._keys:
            raise ValueError("no keys configured")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                               headers={"www-authenticate": "Bearer"})
        given = token.strip().encode()
        if not any([hmac.compare_digest(given, k) for k in self._keys]):  # every key compared: no early exit
            raise GatewayError(401, "invalid API key", code="invalid_api_key", headers={"www-authenticate": "Bearer"})
        return _key_id(token.strip())


def _key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyLimiter:
    """Per key: at most ``max_concurrency`` requests in flight (0: unlimited) and ``rate`` (``limits`` notation,
    e.g. ``"10/second"``; None: unlimited). Runs on the event loop's thread: no locks."""

    def __init__(self, max_concurrency: int = 0, rate: str | None = None):
        self.max_concurrency = max(0, int(max_concurrency))
        self._active: dict[str, int] = defaultdict(int)
        self._rate = parse(rate) if rate else None
        self._window = MovingWindowRateLimiter(MemoryStorage()) if self._rate else None

    def acquire(self, key: str) -> None:
        """Take a slot for ``key`` or raise 429 (with Retry-After); :meth:`release` it when the answer is done."""
        if self._rate is not None and not self._window.hit(self._rate, key):
            reset = self._window.get_window_stats(self._rate, key).reset_time
            wait = max(1, int(np.ceil(reset - time.time())))
            raise GatewayError(429, f"rate limit reached ({self._rate}); retry in {wait} s",
                               code="rate_limit_exceeded", headers={"retry-after": str(wait)})
        if self.max_concurrency and self._active[key] >= self.max_concurrency:
            raise GatewayError(429, f"too many concurrent requests for this key (at most {self.max_concurrency})",
                               code="concurrency_limit_exceeded", headers={"retry-after": "1"})
        self._active[key] += 1

    def release(self, key: str) -> None:
        self._active[key] -= 1
        if self._active[key] <= 0:
            del self._active[key]

    def active(self, key: str) -> int:
        return self._active.get(key, 0)
