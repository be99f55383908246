"""The caller's voices (``/v1/audio/voices``), in its tenant's namespace (:mod:`.tenants`):

- ``GET``: the tenant's voices only, by the ids the tenant gave them.
- ``POST`` (multipart form): ``id``, ``audio`` (an uploaded wav / flac / ogg recording of the voice) and
  ``text`` (its transcript; without it the voice speaks cross-lingually); registering an id the tenant already
  has replaces it. Refused with 403 when the tenant's quota (voices, or bytes of prompt audio) would be exceeded.
- ``DELETE /v1/audio/voices/{id}``.

The quotas are counted from the ``speakers`` model itself (its ids with the tenant's prefix, each prompt's length),
so they hold across gateway restarts; one tenant's registrations are checked and made one at a time."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile

from ..errors import shown
from .compat import upload
from .config import GatewayConfig
from .errors import GatewayError, check_text
from .tenants import BYTES_PER_SECOND, namespace

VOICES_PATH = "/v1/audio/voices"


def _listed(ids: list[str]) -> dict:
    return {"object": "list", "data": [{"id": i, "object": "voice", "name": i} for i in ids]}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def router(config: GatewayConfig, call) -> APIRouter:
    """The routes; ``call(awaitable, ns)``: the app's backend call (its metrics, Triton's messages unscoped)."""
    api = APIRouter()
    locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    @api.get(VOICES_PATH)
    async def voices(request: Request):
        ns = namespace(request)
        return _listed(ns.own(await call(request.app.state.backend.voices(), ns)))

    @api.post(VOICES_PATH, status_code=201)
    async def register(request: Request, id: Annotated[str, Form()], audio: Annotated[UploadFile, File()],
                       text: Annotated[str | None, Form()] = None):
        ns, backend = namespace(request), request.app.state.backend
        voice = ns.check(id, "id")
        check_text(text, "text")
        if text is not None and not text.strip():
            raise GatewayError(400, "text: empty transcript (leave the field out for a voice without one)",
                               param="text", code="invalid_value")
        wave, sr = await upload(audio, "audio")
        cost = len(wave) / sr * BYTES_PER_SECOND
        async with locks[ns.label]:
            own = ns.own(await call(backend.voices(), ns))
            others = [v for v in own if v != voice]
            limit = config.max_voices_per_tenant
            if limit and len(others) >= limit:
                raise GatewayError(403, f"voice quota reached: this key's tenant has {len(others)} voices, at most "
                                   f"{limit}; delete one (DELETE {VOICES_PATH}/<id>) first",
                                   param="id", code="voice_quota_exceeded")
            budget = config.max_voice_bytes_per_tenant
            if budget:
                used = sum([await call(backend.voice_seconds(ns.scoped(v)), ns) for v in others]) * BYTES_PER_SECOND
                if used + cost > budget:
                    raise GatewayError(403, f"voice audio quota reached: this recording counts {_mb(cost)}, the "
                                       f"tenant's other voices {_mb(used)}, at most {_mb(budget)} (prompts counted "
                                       "as 16-bit mono 16 kHz audio); delete a voice or send a shorter recording",
                                       param="audio", code="voice_quota_exceeded")
            await call(backend.register_voice(ns.scoped(voice), wave, sr, text), ns)
        return {"id": voice, "object": "voice", "name": voice}

    @api.delete(VOICES_PATH + "/{voice_id}")
    async def delete(request: Request, voice_id: str):
        ns, backend = namespace(request), request.app.state.backend
        voice = ns.check(voice_id, "voice_id")
        async with locks[ns.label]:
            if voice not in ns.own(await call(backend.voices(), ns)):
                raise GatewayError(404, f"unknown voice {shown(voice)}", param="voice_id", code="voice_not_found")
            await call(backend.delete_voice(ns.scoped(voice)), ns)
        return {"id": voice, "object": "voice.deleted", "deleted": True}

    return api
