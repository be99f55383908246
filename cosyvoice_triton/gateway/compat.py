"""CosyVoice's own HTTP API, so that clients of the official FastAPI server (``runtime/python/fastapi``) work
unchanged: the same routes, methods (GET and POST), form fields and answer, raw signed 16-bit little-endian mono
PCM at the model's rate (``x-sample-rate`` says which), streamed as Triton produces it.

- ``/inference_sft``: ``tts_text``, ``spk_id`` (one of the caller's voices, ``/v1/audio/voices``: its prompt is
  the voice; CosyVoice 2 has no built-in SFT speakers).
- ``/inference_zero_shot``: ``tts_text``, ``prompt_text``, ``prompt_wav`` (an uploaded file).
- ``/inference_cross_lingual``: ``tts_text``, ``prompt_wav``.
- ``/inference_instruct2``: ``tts_text``, ``instruct_text``, ``prompt_wav``.
- ``/inference_instruct``: refused (400): it needs a CosyVoice 1 instruct model with built-in speakers.
- ``/inference_vc`` (not in the official server): ``source_wav``, and ``prompt_wav`` or ``spk_id``.

Uploads are decoded here (libsndfile: wav, flac, ogg, ...) at their own rate and sent as samples; the server
resamples them to what each model reads. The body size, the API key and the per-key limits are the middleware's,
as for the OpenAI routes; a refusal is a JSON error in OpenAI's shape naming the field."""

from __future__ import annotations

import time
from typing import Annotated

import numpy as np
from fastapi import APIRouter, File, Form, Request, UploadFile
from starlette.concurrency import run_in_threadpool

from ..errors import AudioError
from ..frontend import audio as audio_in
from .backend import ConversionJob, SpeechJob, instruction
from .config import GatewayConfig
from .errors import GatewayError, check_text
from .tenants import Namespace, namespace

PREFIX = "/inference_"
SFT, ZERO_SHOT, CROSS_LINGUAL = PREFIX + "sft", PREFIX + "zero_shot", PREFIX + "cross_lingual"
INSTRUCT, INSTRUCT2, VC = PREFIX + "instruct", PREFIX + "instruct2", PREFIX + "vc"
Text = Annotated[str, Form()]
Upload = Annotated[UploadFile, File()]
PATHS = (SFT, ZERO_SHOT, CROSS_LINGUAL, INSTRUCT, INSTRUCT2, VC)
METHODS = ["GET", "POST"]  # the official server takes both, and its client sends GET with a form body


def form_text(value: str, name: str, config: GatewayConfig) -> str:
    """``value``, a text field: valid, not blank, at most ``config.max_input_chars``; 400 naming ``name``
    otherwise."""
    check_text(value, name)
    if not value.strip():
        raise GatewayError(400, f"{name}: empty text", param=name, code="invalid_value")
    if len(value) > config.max_input_chars:
        raise GatewayError(400, f"{name}: {len(value)} characters; at most {config.max_input_chars}", param=name,
                           code="invalid_value")
    return value


def voice_id(ns: Namespace, value: str, name: str = "spk_id") -> str:
    """The ``speakers`` model's id of the caller's voice ``value`` (in ``ns``, its tenant's: :mod:`.tenants`)."""
    check_text(value, name)
    if not value.strip():
        raise GatewayError(400, f"{name}: empty speaker id", param=name, code="invalid_value")
    return ns.scoped(value, name)


async def upload(file: UploadFile, name: str) -> tuple[np.ndarray, int]:
    """The uploaded file's mono float32 samples and rate; 400 naming ``name`` when it is not usable audio."""
    data = await file.read()
    if not data:
        raise GatewayError(400, f"{name}: the uploaded file is empty", param=name, code="invalid_audio")
    try:
        return await run_in_threadpool(audio_in.decode_audio, data, name=name, max_seconds=audio_in.MAX_SECONDS)
    except AudioError as exc:
        raise GatewayError(400, str(exc), param=name, code="invalid_audio") from None


def router(config: GatewayConfig, streamed) -> APIRouter:
    """The routes; ``streamed`` is the app's streamed answer (its metrics and error handling)."""
    api = APIRouter()

    async def speak(request: Request, job: SpeechJob, route: str):
        t0 = time.perf_counter()
        chunks = request.app.state.backend.stream(job, getattr(request.state, "request_id", ""))
        return await streamed(chunks, "pcm", False, t0, route, namespace(request))

    @api.api_route(SFT, methods=METHODS)
    async def sft(request: Request, tts_text: Text, spk_id: Text):
        job = SpeechJob(text=form_text(tts_text, "tts_text", config), voice=voice_id(namespace(request), spk_id))
        return await speak(request, job, SFT)

    @api.api_route(ZERO_SHOT, methods=METHODS)
    async def zero_shot(request: Request, tts_text: Text, prompt_text: Text,
                        prompt_wav: Upload):
        text, prompt_text = form_text(tts_text, "tts_text", config), form_text(prompt_text, "prompt_text", config)
        wave, sr = await upload(prompt_wav, "prompt_wav")
        return await speak(request, SpeechJob(text=text, reference_audio=wave, reference_rate=sr,
                                              reference_text=prompt_text, mode="zero_shot"), ZERO_SHOT)

    @api.api_route(CROSS_LINGUAL, methods=METHODS)
    async def cross_lingual(request: Request, tts_text: Text, prompt_wav: Upload):
        text = form_text(tts_text, "tts_text", config)
        wave, sr = await upload(prompt_wav, "prompt_wav")
        return await speak(request, SpeechJob(text=text, reference_audio=wave, reference_rate=sr,
                                              mode="cross_lingual"), CROSS_LINGUAL)

    @api.api_route(INSTRUCT, methods=METHODS)
    async def instruct():
        raise GatewayError(400, f"{INSTRUCT} needs a CosyVoice 1 instruct model with built-in speakers "
                                f"(CosyVoice-300M-Instruct); this server runs CosyVoice 2: use {INSTRUCT2} with "
                                "tts_text, instruct_text and a prompt_wav", code="unsupported_mode")

    @api.api_route(INSTRUCT2, methods=METHODS)
    async def instruct2(request: Request, tts_text: Text, instruct_text: Text,
                        prompt_wav: Upload):
        text, how = form_text(tts_text, "tts_text", config), form_text(instruct_text, "instruct_text", config)
        wave, sr = await upload(prompt_wav, "prompt_wav")
        return await speak(request, SpeechJob(text=text, reference_audio=wave, reference_rate=sr,
                                              instruct=instruction(how), mode="instruct"), INSTRUCT2)

    @api.api_route(VC, methods=METHODS)
    async def vc(request: Request, source_wav: Upload, prompt_wav: Annotated[UploadFile | None, File()] = None,
                 spk_id: Annotated[str | None, Form()] = None):
        if (prompt_wav is None) == (spk_id is None):
            raise GatewayError(400, "prompt_wav or spk_id: give exactly one, the voice to convert to",
                               param="prompt_wav", code="invalid_value")
        source, source_sr = await upload(source_wav, "source_wav")
        if prompt_wav is not None:
            prompt, prompt_sr = await upload(prompt_wav, "prompt_wav")
            job = ConversionJob(source=source, source_rate=source_sr, prompt=prompt, prompt_rate=prompt_sr)
        else:
            job = ConversionJob(source=source, source_rate=source_sr, voice=voice_id(namespace(request), spk_id))
        t0 = time.perf_counter()
        chunks = request.app.state.backend.convert_stream(job, getattr(request.state, "request_id", ""))
        return await streamed(chunks, "pcm", False, t0, VC, namespace(request))

    return api
