"""Tenants: each API key belongs to one tenant (named in the keys file, else a short digest of the key), and a
tenant's voices live in the ``speakers`` model under ``t-<tenant>.<voice>``, so that one tenant can never name,
list, replace or delete another's. Without keys there is one public namespace: the voices are the model's ids as
they are (those registered on Triton directly included), except the reserved ``t-`` ones.

A tenant's voice id is 1-45 characters of ``[A-Za-z0-9_.-]`` not starting with ``.``: the scoped id (at most
``t-`` + 16 + ``.`` = 19 characters more) must fit the store's 64; a public one, unscoped, may have all 64."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import shown
from .errors import GatewayError

SCOPE = "t-"
TENANT_CHARS = 16
TENANT = re.compile(rf"[A-Za-z0-9_-]{{1,{TENANT_CHARS}}}")
#: The longest voice id a user may give: the store's 64 less the longest tenant prefix.
MAX_VOICE_CHARS = 64 - len(SCOPE) - TENANT_CHARS - 1
_VOICE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
#: What a stored voice counts against the byte quota: its prompt as 16-bit mono audio at 16 kHz.
BYTES_PER_SECOND = 32_000
#: CosyVoice 2's speech tokens a second: a stored prompt's length in seconds is its token count / 25.
TOKENS_PER_SECOND = 25


def key_tenant(key: str) -> str:
    """The tenant of a key the keys file does not name: 12 hex digits of its SHA-256 (never the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def check_tenant(name: str) -> str:
    if TENANT.fullmatch(name) is None:
        raise ValueError(f"tenant name {name!r}: use 1-{TENANT_CHARS} characters of A-Z a-z 0-9 _ -")
    return name


@dataclass(frozen=True)
class Namespace:
    """The voices of one tenant (``tenant`` None: the public namespace of a gateway without keys)."""

    tenant: str | None = None

    @property
    def prefix(self) -> str:
        return "" if self.tenant is None else f"{SCOPE}{self.tenant}."

    @property
    def label(self) -> str:
        return "public" if self.tenant is None else self.tenant

    @property
    def max_chars(self) -> int:
        return 64 if self.tenant is None else MAX_VOICE_CHARS

    def check(self, voice: str, param: str = "voice") -> str:
        """``voice`` if it is a valid user id, else 400 naming ``param``."""
        if not isinstance(voice, str) or len(voice) > self.max_chars or _VOICE.fullmatch(voice) is None:
            raise GatewayError(400, f"{param}: voice id {shown(voice)} is invalid: use 1-{self.max_chars} characters "
                               "of A-Z a-z 0-9 _ . - not starting with '.'", param=param, code="invalid_value")
        if self.tenant is None and voice.startswith(SCOPE):
            raise GatewayError(400, f"{param}: unknown voice {shown(voice)} (ids starting with {SCOPE!r} are reserved "
                               "for tenants)", param=param, code="voice_not_found")
        return voice

    def scoped(self, voice: str, param: str = "voice") -> str:
        """The ``speakers`` model's id of the user's ``voice``."""
        return self.prefix + self.check(voice, param)

    def own(self, ids: Iterable[str]) -> list[str]:
        """The user ids of this namespace among the model's ``ids``, sorted."""
        if self.tenant is None:
            return sorted(i for i in ids if not i.startswith(SCOPE))
        p = self.prefix
        return sorted(i[len(p):] for i in ids if i.startswith(p) and len(i) > len(p))

    def unscoped(self, message: str) -> str:
        """``message`` (Triton's, naming a scoped id) as the user sees it: without this tenant's prefix."""
        return message.replace(self.prefix, "") if self.prefix else message


PUBLIC = Namespace()


def namespace(request) -> Namespace:
    """The caller's namespace, as the middleware found it (no keys: the public one)."""
    return Namespace(getattr(request.state, "tenant", None))
