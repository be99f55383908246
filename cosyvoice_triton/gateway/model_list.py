"""OpenAI's model list at the gateway: ``GET /v1/models`` and ``GET /v1/models/{id}``, the speech model names it
accepts in ``model`` (``--models``: ``cosyvoice2`` and OpenAI's names, each CosyVoice 2 on the served TTS models),
in OpenAI's format (``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}``). Behind the
key like the other ``/v1`` routes (the middleware's)."""

from __future__ import annotations

import time

from fastapi import APIRouter

from ..errors import shown
from .config import GatewayConfig
from .errors import GatewayError

MODELS_PATH = "/v1/models"
OWNER = "FunAudioLLM"  # CosyVoice 2's authors: every name is that model


def router(config: GatewayConfig) -> APIRouter:
    """The routes; ``created`` is when the gateway started (unix seconds)."""
    api = APIRouter()
    created = int(time.time())

    def entry(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": OWNER}

    @api.get(MODELS_PATH)
    async def models():
        return {"object": "list", "data": [entry(m) for m in config.models]}

    @api.get(MODELS_PATH + "/{model}")
    async def model(model: str):
        if model not in config.models:
            raise GatewayError(404, f"model {shown(model)} is not served here; one of {', '.join(config.models)}",
                               param="model", code="model_not_found")
        return entry(model)

    return api
