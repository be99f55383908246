"""The admin key of Triton's restricted APIs (configs, statistics, repository control, shared memory): the header
that carries it and where it comes from. The server launcher passes it to ``tritonserver``; clients, the rollout
and the load tests send it."""

from __future__ import annotations

import os
import secrets

__all__ = ["ADMIN_HEADER", "ADMIN_KEY_ENV", "GRPC_HEADER_PREFIX", "admin_headers", "admin_key", "given_admin_key"]

#: The header a request to a restricted API must carry (lower case: gRPC metadata keys are).
ADMIN_HEADER = "cosyvoice-admin-key"
#: Where the admin key is read from (and put when this process draws one).
ADMIN_KEY_ENV = "COSYVOICE_TRITON_ADMIN_KEY"
#: Triton's gRPC frontend expects restricted-protocol headers under this prefix.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


def admin_key() -> str:
    """The admin key of this process: ``$COSYVOICE_TRITON_ADMIN_KEY``, else a random one drawn now and put there."""
    key = os.environ.get(ADMIN_KEY_ENV, "")
    if not key:
        key = os.environ[ADMIN_KEY_ENV] = secrets.token_hex(24)
    if not key.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"${ADMIN_KEY_ENV} may hold only letters, digits, '-' and '_' (Triton's flag syntax)")
    return key


def given_admin_key(key: str | None) -> str | None:
    """A client's admin key: the one given, else ``$COSYVOICE_TRITON_ADMIN_KEY`` (never drawn), else None."""
    return key or os.environ.get(ADMIN_KEY_ENV) or None


def admin_headers(protocol: str = "http", key: str | None = None) -> dict[str, str]:
    """The header(s) that open the restricted APIs to a ``tritonclient`` call (``headers=``) of ``protocol``."""
    if protocol not in ("http", "grpc"):
        raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
    name = ADMIN_HEADER if protocol == "http" else GRPC_HEADER_PREFIX + ADMIN_HEADER
    return {name: key or admin_key()}
