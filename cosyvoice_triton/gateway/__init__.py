"""HTTP gateway in front of Triton: OpenAI's speech API (``POST /v1/audio/speech``) over the served TTS models,
and the limits Triton cannot enforce (body size, JSON depth, compressed bodies, API keys, per-key concurrency and
rate, request ids, CORS, its own Prometheus metrics). ``python -m cosyvoice_triton.gateway --help``."""

from .app import create_app
from .config import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]
