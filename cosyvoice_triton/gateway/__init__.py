"""The gateway in front of Triton: OpenAI's speech API (``POST /v1/audio/speech``) over the served TTS models,
CosyVoice's own HTTP API (:mod:`.compat`), Triton's KServe API checked request by request (:mod:`.kserve_http`
under ``/v2``, :mod:`.kserve_grpc` on its own port; the checks: :mod:`.inference`), and the limits Triton cannot
enforce (body size, JSON depth, compressed bodies, framing, API keys and tenants, per-key concurrency and rate,
request ids, CORS, its own Prometheus metrics). ``python -m cosyvoice_triton.gateway --help``."""

from .app import create_app
from .config import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]
