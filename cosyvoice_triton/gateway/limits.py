"""The limits themselves, apart from the HTTP plumbing (``middleware.py``): API keys, per-key concurrency and rate
(moving window of the ``limits`` library), and JSON bodies parsed only within a nesting depth."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np
from limits import parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from .errors import GatewayError
from .fair import FairGate
from .tenants import key_tenant

_QUOTE, _OPEN, _CLOSE = ord('"'), ord("{"), ord("}")  # "[" and "]" fold onto "{" and "}" (| 0x20)
_ESCAPED = frozenset(b'\\"')  # the bytes an escape that json_depth replaces may end with
_BLOCK = 64 * 1024  # bytes read at a time: the arrays stay small and in cache whatever the body's size
_SPARSE = 8  # fewer than 1 byte in _SPARSE a quote or bracket: work on those bytes only


def json_depth(body: bytes) -> int:
    r"""The deepest nesting of arrays / objects in ``body`` (brackets inside strings do not count; after a string
    that is never closed everything is inside it), in time linear in ``len(body)`` and without recursion, so it can
    run before any parser sees the bytes.

    Read bytewise, as UTF-8 (no quote, backslash or bracket byte inside a multi-byte character), a block at a time
    with what carries over (inside a string or not, the depth, a backslash left to escape the next byte): escapes
    are paired from the left of each run of backslashes (``\\`` then ``\"`` replaced by two other bytes, a linear
    scan each), each quote left opens or closes a string (their running parity) and the depth is the running sum
    of the brackets outside strings, in numpy: no loop per byte in Python, and numpy lets go of the GIL meanwhile.
    No regex: a backtracking one is quadratic on a long unclosed string of ``\"``."""
    depth = deepest = 0
    inside = escaped = False
    for start in range(0, len(body), _BLOCK):
        escaped = escaped and body[start] in _ESCAPED  # the block before ends with a backslash escaping this byte
        block = body[start + escaped: start + _BLOCK]
        escaped = False
        if b"\\" in block:
            block = block.replace(b"\\\\", b"..").replace(b'\\"', b"..")
            escaped = block.endswith(b"\\")  # an odd run of backslashes at the end: it escapes the next byte
        a = np.frombuffer(block, np.uint8)
        folded = a | 0x20
        opens, closes, quotes = folded == _OPEN, folded == _CLOSE, a == _QUOTE
        special = opens | closes | quotes
        count = np.count_nonzero(special)
        if not count:
            continue
        if count * _SPARSE < a.size:
            at = np.flatnonzero(special)
            opens, closes, quotes = opens[at], closes[at], quotes[at]
        within = np.bitwise_xor.accumulate(quotes.view(np.uint8)).view(bool)  # from an opening quote to its closing
        if inside:
            within = ~within
        step = opens.view(np.int8) - closes.view(np.int8)
        step[within] = 0
        running = np.cumsum(step, dtype=np.int32)
        deepest = max(deepest, depth + int(running.max()))
        depth += int(running[-1])
        inside = bool(within[-1])
    return deepest


def bounded_loads(body: bytes, max_depth: int):
    """``json.loads`` of a UTF-8 request body nested at most ``max_depth`` deep; 400 otherwise. Linear in the
    body's size (:func:`json_depth`, then the parser); UTF-16 and UTF-32, which ``json.loads`` would detect, are
    refused: the depth is counted on UTF-8 bytes."""
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        raise GatewayError(400, "the body is not valid JSON: send it as UTF-8", code="invalid_json")
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
    e.g. ``"10/second"``; None: unlimited); work for Triton also takes a slot of the fair ``gate`` (:meth:`admit`,
    :meth:`leave`). Runs on the event loop's thread: no locks."""

    def __init__(self, max_concurrency: int = 0, rate: str | None = None, gate: FairGate | None = None):
        self.gate = gate or FairGate()
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

    async def admit(self, key: str, *, wait: bool = True, counted: bool = True) -> None:
        """:meth:`acquire` (``counted``), then a slot of the fair gate (``wait=False``: at once, for a piece of an
        admitted session); :meth:`leave` both, with the same ``counted``, when Triton has answered."""
        if counted:
            self.acquire(key)
        try:
            if wait:
                await self.gate.acquire(key)
            else:
                self.gate.take(key)
        except BaseException:
            if counted:
                self.release(key)
            raise

    def leave(self, key: str, *, counted: bool = True) -> None:
        self.gate.release()
        if counted:
            self.release(key)

    def release(self, key: str) -> None:
        self._active[key] -= 1
        if self._active[key] <= 0:
            del self._active[key]

    def active(self, key: str) -> int:
        return self._active.get(key, 0)
