"""The gateway's settings: one frozen dataclass, from CLI flags with ``COSYVOICE_GATEWAY_*`` environment defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .tenants import TENANT

ENV_PREFIX = "COSYVOICE_GATEWAY_"
#: Model names accepted in ``model``: this project's, and OpenAI's, so that existing clients work unchanged (they
#: speak with CosyVoice2). ``cosyvoice3`` (the CosyVoice3 models, render tunable ``cosyvoice3_dir``) is added with
#: ``--models`` where the deployment serves them.
DEFAULT_MODELS = ("cosyvoice2", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
#: Triton's models served again at the KServe entry points (``/v2/...`` and gRPC): the pipelines users call. The
#: member stages, ``speakers`` (voices are the tenants' own: ``/v1/audio/voices``) and the admin APIs are not.
KSERVE_MODELS = ("cosyvoice_vc", "cosyvoice_vc_stream", "cosyvoice_vc_live", "cosyvoice_tts", "cosyvoice_tts_stream",
                 "cosyvoice_tts_live", "cosyvoice2", "cosyvoice3_vc", "cosyvoice3_tts", "cosyvoice3_tts_stream",
                 "cosyvoice3_tts_live", "cosyvoice3_vc_live", "cosyvoice3")


@dataclass(frozen=True)
class GatewayConfig:
    triton_grpc: str = "127.0.0.1:8001"
    triton_http: str = "127.0.0.1:8000"
    grpc_port: int = 0  # the KServe gRPC entry point; 0: off (the command line's default is 8081)
    kserve_models: tuple[str, ...] = KSERVE_MODELS
    triton_metrics: str | None = None  # Triton's metrics URL, appended to /metrics (Triton on loopback); None: off
    host: str = "127.0.0.1"
    port: int = 8080
    models: tuple[str, ...] = DEFAULT_MODELS
    api_keys: frozenset[str] = frozenset()  # empty: no authentication
    tenants: tuple[tuple[str, str], ...] = ()  # (key, tenant name) of the keys a keys file names; others: a digest
    max_voices_per_tenant: int = 20  # 0: unlimited
    max_voice_bytes_per_tenant: int = 10 * 1024 * 1024  # prompts counted as 16-bit 16 kHz audio; 0: unlimited
    # the tenants' sequence ids (live sessions) at the KServe entry points, with keys (sessions.py)
    max_sequences: int = 1024  # open at once, all tenants
    max_sequences_per_tenant: int = 64
    # open sessions one tenant may hold on each live model: half the models' own max_sessions (tunables
    # live_max_sessions 4, live_tts_max_sessions 2), so that one key cannot take them all
    live_sessions_per_tenant: tuple[tuple[str, int], ...] = (("cosyvoice_vc_live", 2), ("cosyvoice_tts_live", 1),
                                                             ("cosyvoice3_tts_live", 1), ("cosyvoice3_vc_live", 2))
    sequence_idle_s: float = 35.0  # at least the live models' idle time (live_idle_timeout_s + 5 s: Triton's)
    # live sessions over WebSocket (live_ws.py): a socket whose input stops this long is cut; pieces waiting to go
    # on to Triton, beyond which the session is cut; the longest audio piece (the live VC model's max_piece_seconds)
    live_idle_s: float = 30.0
    live_max_pending: int = 16
    live_max_piece_s: float = 5.0
    live_min_piece_ms: float = 100.0  # shorter audio frames are gathered into one piece (one request to Triton)
    max_body_bytes: int = 10 * 1024 * 1024  # base64 reference audio included
    max_json_depth: int = 16
    max_input_chars: int = 4096  # OpenAI's limit; the server's own max_text_chars may be lower
    max_concurrency_per_key: int = 8  # 0: unlimited
    rate_limit: str | None = None  # per key, `limits` notation: "10/second", "100 per minute"; None: off
    # the fair gate (fair.py): requests of all keys in flight to Triton at once; beyond, they wait in turn per key
    max_in_flight: int = 32  # 0: no gate (Triton's own queue, first come first served)
    max_queue_s: float = 60.0  # a wait longer than this: 503
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    open_metrics: bool = False  # /metrics without a key even when keys are configured (a scraper that sends none)
    backend_timeout_s: float = 300.0
    # slow and idle clients (connections.py): deadlines to read a request's head and body, connections per port
    header_timeout_s: float = 10.0  # also the gRPC port's handshake
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0  # an HTTP connection idle between requests
    max_connections: int = 512  # per port (HTTP, gRPC); 0: unlimited
    grpc_max_streams: int = 100  # concurrent streams (calls) on one gRPC connection
    grpc_idle_s: float = 300.0  # a gRPC connection without a call this long is closed (GOAWAY)
    log_level: str = "info"


def _env(name: str, default):
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def read_keys(path: str | os.PathLike) -> dict[str, str | None]:
    """key -> its tenant's name (None: unnamed) of a keys file: one key a line, or ``tenant:key`` to name the
    tenant (1-16 of ``A-Za-z0-9_-``; several keys may name one tenant); blank lines and ``#`` comments ignored."""
    out: dict[str, str | None] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        if sep and key.strip() and TENANT.fullmatch(name.strip()):
            out[key.strip()] = name.strip()
        else:
            out[line] = None
    return out


def read_key_file(path: str | os.PathLike) -> frozenset[str]:
    """The keys of a keys file (:func:`read_keys`)."""
    return frozenset(read_keys(path))


def parser() -> argparse.ArgumentParser:
    d = GatewayConfig()
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.gateway",
                                description="OpenAI's speech API, CosyVoice's own and Triton's KServe API (checked) "
                                            "in front of Triton. Every flag "
                                            f"also reads ${ENV_PREFIX}<FLAG> (upper case, '-' as '_').")
    p.add_argument("--triton-grpc", default=_env("triton_grpc", d.triton_grpc), help="Triton's gRPC address")
    p.add_argument("--triton-http", default=_env("triton_http", d.triton_http),
                   help="Triton's HTTP address, behind the gateway's /v2 (KServe) routes")
    p.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", 8081)),
                   help="port of the gateway's KServe gRPC entry point (Triton's gRPC API, checked); 0: off")
    p.add_argument("--kserve-models", default=_env("kserve_models", ",".join(d.kserve_models)),
                   help="comma-separated Triton models served at the KServe entry points (/v2 and gRPC)")
    p.add_argument("--triton-metrics", default=_env("triton_metrics", d.triton_metrics),
                   help="Triton's metrics URL (e.g. http://127.0.0.1:8002/metrics), served again after the "
                        "gateway's own at /metrics: one scrape target when Triton listens on loopback only")
    p.add_argument("--host", default=_env("host", d.host))
    p.add_argument("--port", type=int, default=int(_env("port", d.port)))
    p.add_argument("--models", default=_env("models", ",".join(d.models)),
                   help="comma-separated names accepted in the request's model field")
    p.add_argument("--api-key", action="append", default=None,
                   help=f"an accepted key (repeatable; also ${ENV_PREFIX}API_KEY); none: no authentication")
    p.add_argument("--api-key-file", default=_env("api_key_file", None),
                   help="a file of keys, one a line: 'KEY', or 'TENANT:KEY' to name the key's tenant (a key "
                        "alone is its own tenant)")
    p.add_argument("--max-voices-per-tenant", type=int,
                   default=int(_env("max_voices_per_tenant", d.max_voices_per_tenant)), help="0: unlimited")
    p.add_argument("--max-voice-bytes-per-tenant", type=int,
                   default=int(_env("max_voice_bytes_per_tenant", d.max_voice_bytes_per_tenant)),
                   help="the tenant's voices' prompts, counted as 16-bit mono 16 kHz audio; 0: unlimited")
    p.add_argument("--max-sequences", type=int, default=int(_env("max_sequences", d.max_sequences)),
                   help="open sequence ids (live sessions) the gateway keeps for all tenants; a start beyond: 429")
    p.add_argument("--max-sequences-per-tenant", type=int,
                   default=int(_env("max_sequences_per_tenant", d.max_sequences_per_tenant)),
                   help="open sequence ids of one tenant; a start beyond: 429")
    p.add_argument("--sequence-idle-s", type=float, default=float(_env("sequence_idle_s", d.sequence_idle_s)),
                   help="a sequence id without a request this long is forgotten; keep it at least the live "
                        "models' live_idle_timeout_s + 5")
    p.add_argument("--live-sessions-per-tenant", action="append", default=None, metavar="MODEL=N",
                   help="open sessions one tenant may hold on a live model (repeatable; default "
                        + ", ".join(f"{m}={n}" for m, n in d.live_sessions_per_tenant)
                        + f"; ${ENV_PREFIX}LIVE_SESSIONS_PER_TENANT comma-separated)")
    for name, kind, text in (  # live sessions over WebSocket (live_ws.py)
            ("live_idle_s", float, "a live WebSocket session whose input stops this long (no piece, no message "
                                   "before input.end) is cut with session_idle; keep it below --sequence-idle-s"),
            ("live_max_pending", int, "pieces of a live WebSocket session waiting to go on to Triton; one more cuts "
                                      "the session (input_overrun)"),
            ("live_max_piece_s", float, "the longest audio piece (binary frame) of a live voice conversion session, "
                                        "in seconds; keep it at most the live model's max_piece_seconds"),
            ("live_min_piece_ms", float, "audio frames of a live voice conversion session shorter than this are "
                                         "gathered into one piece before they go on to Triton; 0: each frame alone")):
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=kind(_env(name, getattr(d, name))), help=text)
    p.add_argument("--max-body-bytes", type=int, default=int(_env("max_body_bytes", d.max_body_bytes)))
    p.add_argument("--max-json-depth", type=int, default=int(_env("max_json_depth", d.max_json_depth)))
    p.add_argument("--max-input-chars", type=int, default=int(_env("max_input_chars", d.max_input_chars)))
    p.add_argument("--max-concurrency-per-key", type=int,
                   default=int(_env("max_concurrency_per_key", d.max_concurrency_per_key)), help="0: unlimited")
    p.add_argument("--rate-limit", default=_env("rate_limit", d.rate_limit),
                   help="requests per key, e.g. '10/second' or '600 per minute'; unset: off")
    p.add_argument("--max-in-flight", type=int, default=int(_env("max_in_flight", d.max_in_flight)),
                   help="requests of all keys on their way to Triton at once; beyond, a request waits and freed "
                        "slots go to the waiting keys in turn (0: no gate)")
    p.add_argument("--max-queue-s", type=float, default=float(_env("max_queue_s", d.max_queue_s)),
                   help="the longest a request waits for its turn; beyond: 503")
    p.add_argument("--cors-origin", action="append", default=None,
                   help=f"an allowed CORS origin (repeatable; ${ENV_PREFIX}CORS_ORIGINS comma-separated); "
                        "none: CORS off")
    p.add_argument("--open-metrics", action="store_true",
                   default=_env("open_metrics", "").lower() in ("1", "true", "yes", "on"),
                   help="serve /metrics without a key even when keys are configured (for a scraper that sends none)")
    p.add_argument("--backend-timeout-s", type=float, default=float(_env("backend_timeout_s", d.backend_timeout_s)))
    for name, kind, text in (  # slow and idle clients (connections.py)
            ("header_timeout_s", float, "a request head (request line and headers) must arrive within this of the "
                                        "connection's start or the previous answer, else 408 and the connection "
                                        "closed; also the gRPC handshake"),
            ("body_timeout_s", float, "a request body must arrive within this of its head, else 408 and the "
                                      "connection closed"),
            ("keep_alive_s", float, "an HTTP connection idle this long between requests is closed"),
            ("max_connections", int, "open connections per port (HTTP and gRPC); beyond: the oldest HTTP connection "
                                     "without a request head is closed, or the new one refused with 503; 0: unlimited"),
            ("grpc_max_streams", int, "concurrent calls on one gRPC connection"),
            ("grpc_idle_s", float, "a gRPC connection without a call this long is closed (the client reconnects)")):
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=kind(_env(name, getattr(d, name))), help=text)
    p.add_argument("--log-level", default=_env("log_level", d.log_level))
    return p


def _shares(given: Sequence[str]) -> tuple[tuple[str, int], ...]:
    out = dict(GatewayConfig().live_sessions_per_tenant)
    for item in given:
        model, _, n = item.partition("=")
        if not model.strip() or not n.strip().isdigit() or int(n) < 1:
            raise SystemExit(f"--live-sessions-per-tenant {item!r}: MODEL=N with N >= 1")
        out[model.strip()] = int(n)
    return tuple(sorted(out.items()))


def from_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    args = parser().parse_args(argv)
    shares = _shares(args.live_sessions_per_tenant
                     or [x for x in _env("live_sessions_per_tenant", "").split(",") if x.strip()])
    keys = set(args.api_key or ([_env("api_key", "")] if _env("api_key", "") else []))
    named = read_keys(args.api_key_file) if args.api_key_file else {}
    keys |= set(named)
    origins = args.cors_origin or [o for o in _env("cors_origins", "").split(",") if o.strip()]
    return GatewayConfig(triton_grpc=args.triton_grpc, triton_http=args.triton_http, grpc_port=args.grpc_port,
                         kserve_models=tuple(m.strip() for m in args.kserve_models.split(",") if m.strip()),
                         triton_metrics=args.triton_metrics or None, host=args.host,
                         port=args.port,
                         models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
                         api_keys=frozenset(keys),
                         tenants=tuple(sorted((k, t) for k, t in named.items() if t is not None)),
                         max_voices_per_tenant=args.max_voices_per_tenant,
                         max_voice_bytes_per_tenant=args.max_voice_bytes_per_tenant, max_body_bytes=args.max_body_bytes,
                         max_sequences=args.max_sequences, max_sequences_per_tenant=args.max_sequences_per_tenant,
                         sequence_idle_s=args.sequence_idle_s, live_sessions_per_tenant=shares,
                         live_idle_s=args.live_idle_s, live_max_pending=args.live_max_pending,
                         live_max_piece_s=args.live_max_piece_s, live_min_piece_ms=args.live_min_piece_ms,
                         max_json_depth=args.max_json_depth, max_input_chars=args.max_input_chars,
                         max_concurrency_per_key=args.max_concurrency_per_key, rate_limit=args.rate_limit or None,
                         max_in_flight=args.max_in_flight, max_queue_s=args.max_queue_s,
                         cors_origins=tuple(o.strip() for o in origins), open_metrics=args.open_metrics,
                         backend_timeout_s=args.backend_timeout_s, header_timeout_s=args.header_timeout_s,
                         body_timeout_s=args.body_timeout_s, keep_alive_s=args.keep_alive_s,
                         max_connections=args.max_connections, grpc_max_streams=args.grpc_max_streams,
                         grpc_idle_s=args.grpc_idle_s, log_level=args.log_level)
