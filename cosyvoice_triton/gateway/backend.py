"""What the routes call: speech from the served TTS models over gRPC (``tritonclient.grpc.aio``), voice
conversion (``cosyvoice_vc_stream``) and the ``speakers`` model (list, register, delete, a prompt's length).
Triton's refusals become :class:`~.errors.GatewayError` by their gRPC status code (:data:`HTTP_STATUS`), never by
their text. Streams ask
Triton for gRPC status codes on errors (the ``triton_grpc_error`` header): without it a stream's error carries a
message only."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from ..clients.client import VC_STREAM_MODEL, build_inputs, build_speaker_inputs, build_tts_inputs
from ..clients.wire import speakers_model
from ..shapes import CV3_TTS_MODEL, CV3_TTS_STREAM_MODEL, TTS_MODEL, TTS_STREAM_MODEL
from .errors import GatewayError
from .tenants import TOKENS_PER_SECOND

log = logging.getLogger(__name__)

#: Triton's gRPC status -> the gateway's HTTP status. Anything else (INTERNAL, UNKNOWN, ...) is a 502.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.NOT_FOUND: 503,  # the model is not loaded
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 503,
}
_BY_NAME = {str(code): code for code in grpc.StatusCode}  # tritonclient's InferenceServerException.status()
# CosyVoice 2's end of an instruction. Clients send plain instructions; the official frontend_instruct2 tokenizes its
# text as given and expects the caller to end it with this marker, so the gateway appends it.
ENDOFPROMPT = "<|endofprompt|>"


def instruction(text: str | None) -> str | None:
    """``text`` ended with :data:`ENDOFPROMPT` (None for no or blank text)."""
    if text is None or not text.strip():
        return None
    return text if text.rstrip().endswith(ENDOFPROMPT) else text.rstrip() + ENDOFPROMPT


@dataclass(frozen=True)
class SpeechJob:
    """One text to speak: in a registered voice (``voice``), or in the voice of ``reference_audio`` (an encoded
    file, or float32 samples at ``reference_rate``; ``reference_text`` its transcript for zero-shot, else
    cross-lingual); ``instruct`` for instruct mode; ``mode`` (zero_shot, cross_lingual, instruct) to name the mode
    instead of letting the server infer it; ``speed`` (0.25-4) for a whole answer."""

    text: str
    voice: str | None = None
    reference_audio: bytes | np.ndarray | None = None
    reference_text: str | None = None
    instruct: str | None = None
    seed: int | None = None
    reference_rate: int | None = None
    mode: str | None = None
    speed: float = 1.0  # whole answers only (synthesize): the served model refuses it on a stream
    family: str = "cosyvoice2"  # the Triton models that speak it: cosyvoice_tts*, or cosyvoice3_tts* (TTS_MODELS)


@dataclass(frozen=True)
class ConversionJob:
    """One voice conversion: ``source`` (float32 samples at ``source_rate``) spoken in the voice of ``prompt``
    (samples at ``prompt_rate``) or of a registered ``voice``."""

    source: np.ndarray
    source_rate: int
    prompt: np.ndarray | None = None
    prompt_rate: int | None = None
    voice: str | None = None
    seed: int | None = None


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    code = exc.code() if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) else None
    if code is None and callable(getattr(exc, "status", None)):
        code = _BY_NAME.get(str(exc.status()))
    return code


def backend_error(exc: BaseException) -> GatewayError:
    code = status_of(exc)
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "details", None)):
        message = exc.details() or str(code)
    else:
        message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    status = HTTP_STATUS.get(code, 502) if code is not None else 503  # no status: no answer from Triton at all
    kind = {400: "invalid_value", 503: "backend_unavailable", 504: "backend_timeout"}.get(status, "backend_error")
    if status >= 500:
        log.warning("triton: %s (%s)", message, code)
    return GatewayError(status, message if status == 400 else f"speech backend: {message}", code=kind)


#: (whole, stream) Triton models of each family: CosyVoice3's are served with the render tunable cosyvoice3_dir
TTS_MODELS = {"cosyvoice2": (TTS_MODEL, TTS_STREAM_MODEL), "cosyvoice3": (CV3_TTS_MODEL, CV3_TTS_STREAM_MODEL)}


class TritonBackend:
    """The TTS models on one Triton server (gRPC address ``url``); one channel, reused. ``families``: the model
    families served there: a voice is registered with each family's speakers model (each computes its own prompt
    from the recording), so that one id speaks with either; the first one's is the voices' list and lengths."""

    def __init__(self, url: str, *, timeout: float = 300.0, families: tuple[str, ...] = ("cosyvoice2",)):
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as aio

        self.url, self.timeout, self._module = url, float(timeout), grpcclient
        self._client = aio.InferenceServerClient(url)
        self.speaker_models = tuple(speakers_model(f) for f in families)

    def _inputs(self, job: SpeechJob) -> list:
        return build_tts_inputs(self._module, job.text, prompt=job.reference_audio, prompt_sr=job.reference_rate,
                                prompt_text=job.reference_text, instruct=job.instruct,
                                speaker_id=None if job.reference_audio is not None else job.voice, mode=job.mode,
                                seed=job.seed, speed=job.speed)

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(TTS_STREAM_MODEL))
        except Exception:
            return False

    async def synthesize(self, job: SpeechJob, request_id: str = "") -> tuple[np.ndarray, int]:
        try:
            res = await self._client.infer(TTS_MODELS[job.family][0], self._inputs(job), request_id=request_id,
                                           client_timeout=self.timeout)
        except Exception as exc:
            raise backend_error(exc) from exc
        return (np.asarray(res.as_numpy("waveform"), np.float32).reshape(-1),
                int(np.asarray(res.as_numpy("sample_rate")).reshape(-1)[0]))

    def stream(self, job: SpeechJob, request_id: str = "") -> AsyncIterator[tuple[np.ndarray, int]]:
        """Chunks as Triton sends them; closing the generator early cancels the request on the server."""
        return self._stream(TTS_MODELS[job.family][1], self._inputs(job), request_id)

    def convert_stream(self, job: ConversionJob, request_id: str = "") -> AsyncIterator[tuple[np.ndarray, int]]:
        """Voice conversion's chunks as Triton sends them (as :meth:`stream`)."""
        inputs = build_inputs(self._module, job.source, job.source_rate, job.prompt, job.prompt_rate, job.seed,
                              speaker_id=job.voice)
        return self._stream(VC_STREAM_MODEL, inputs, request_id)

    async def _stream(self, model: str, inputs: list, request_id: str) -> AsyncIterator[tuple[np.ndarray, int]]:
        request = {"model_name": model, "inputs": inputs, "request_id": request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}

        async def requests():
            yield request

        call = self._client.stream_infer(requests(), stream_timeout=self.timeout,
                                         headers={"triton_grpc_error": "true"})
        done = False
        try:
            async for result, error in call:
                if error is not None:
                    raise backend_error(error)
                wave = result.as_numpy("waveform")
                if wave is not None:
                    yield (np.asarray(wave, np.float32).reshape(-1),
                           int(np.asarray(result.as_numpy("sample_rate")).reshape(-1)[0]))
                params = result.get_response().parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    break
            done = True
        except GatewayError:
            done = True
            raise
        except Exception as exc:
            done = True
            raise backend_error(exc) from exc
        finally:
            if not done:
                call.cancel()

    async def voices(self) -> list[str]:
        """Every id the listing speakers model holds (all tenants')."""
        res = await self._speakers("list", model=self.speaker_models[0])
        ids = res.as_numpy("speaker_ids")
        return [] if ids is None else [bytes(x).decode("utf-8") for x in ids.reshape(-1)]

    async def _speakers(self, *args, model: str, outputs: tuple[str, ...] = ("speaker_ids",), **kw):
        try:
            return await self._client.infer(
                model, build_speaker_inputs(self._module, *args, **kw), client_timeout=self.timeout,
                outputs=[self._module.InferRequestedOutput(n) for n in outputs])
        except Exception as exc:
            raise backend_error(exc) from exc

    async def register_voice(self, voice: str, wave: np.ndarray, sample_rate: int, text: str | None) -> None:
        """Register (or replace) ``voice`` from float32 samples at ``sample_rate`` (and their transcript) with every
        family's speakers model, the listing one last: a refusal of any leaves the voice listed as it was, and one
        registered in part is removed from the others again."""
        *others, listed = self.speaker_models
        done = []
        try:
            for model in (*others, listed):
                await self._speakers("register", voice, prompt=wave, prompt_sr=sample_rate, prompt_text=text,
                                     model=model)
                done.append(model)
        except GatewayError:
            for model in done:
                with contextlib.suppress(GatewayError):
                    await self._speakers("delete", voice, model=model)
            raise

    async def delete_voice(self, voice: str) -> None:
        """Delete ``voice`` from every family's speakers model (the listing one first; one that never had it, e.g.
        registered before the family was served, is skipped)."""
        listed, *others = self.speaker_models
        await self._speakers("delete", voice, model=listed)
        for model in others:
            with contextlib.suppress(GatewayError):
                await self._speakers("delete", voice, model=model)

    async def voice_seconds(self, voice: str) -> float:
        """How long ``voice``'s stored prompt is (its speech tokens, 25 a second)."""
        res = await self._speakers("get", voice, outputs=("prompt_tokens",), model=self.speaker_models[0])
        return res.as_numpy("prompt_tokens").size / TOKENS_PER_SECOND

    async def close(self) -> None:
        await self._client.close()
