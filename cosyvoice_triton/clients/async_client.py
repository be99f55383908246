"""The asyncio client of the served models (``tritonclient.http.aio`` / ``tritonclient.grpc.aio``, ``aiohttp`` for
HTTP streams): :class:`AsyncCosyVoiceClient`, the same calls as the synchronous
:class:`~.sync_client.CosyVoiceClient`, awaited. ``AsyncVCClient`` and ``AsyncTTSClient`` are its older names, kept
as aliases."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..admin import admin_headers, given_admin_key
from ..shapes import SPEAKER_EMBEDDING_MODEL, SPEECH_TOKENS_MODEL, TTS_MODEL, TTS_STREAM_MODEL, VC_MODEL
from . import wire
from .retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy

log = logging.getLogger(__name__)

__all__ = ["AsyncCosyVoiceClient", "AsyncTTSClient", "AsyncVCClient"]


class AsyncCosyVoiceClient(wire._ClientBase):
    """asyncio client (``tritonclient.http.aio`` / ``tritonclient.grpc.aio``); one session reused. Priorities as
    :class:`~.sync_client.CosyVoiceClient`."""

    def __init__(self, url: str | None = None, *, protocol: str = "http", model: str = VC_MODEL,
                 timeout: float = 300.0, concurrency: int = 8, retry: RetryPolicy = DEFAULT_RETRY,
                 admin_key: str | None = None, check_priority: bool = True):
        super().__init__(url, protocol, model, timeout, concurrency, retry, admin_key, check_priority)
        if protocol == "http":
            import tritonclient.http as module
            import tritonclient.http.aio as aio

            self._client = aio.InferenceServerClient(self.url, conn_limit=self.concurrency,
                                                     conn_timeout=self.timeout)
        else:
            import tritonclient.grpc as module
            import tritonclient.grpc.aio as aio

            self._client = aio.InferenceServerClient(self.url)
        self._module = module

    async def close(self) -> None:
        await self._client.close()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> AsyncCosyVoiceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def statistics(self, model: str = "") -> dict:
        if self.protocol == "http":
            return await self._client.get_inference_statistics(model, headers=admin_headers("http"))
        return await self._client.get_inference_statistics(model, headers=admin_headers("grpc"), as_json=True)

    async def _model_config(self, model: str) -> dict:
        headers = self._config_headers()
        if self.protocol == "http":
            return wire._config_of(await self._client.get_model_config(model, headers=headers))
        return wire._config_of(await self._client.get_model_config(model, headers=headers, as_json=True))

    async def priority_levels(self, model: str | None = None) -> int | None:
        """See :meth:`~.sync_client.CosyVoiceClient.priority_levels`."""
        model = model or self.model
        if model not in self._levels:
            levels = None
            if given_admin_key(self.admin_key):
                try:
                    config = await self._model_config(model)
                    steps = [st["model_name"] for st in (config.get("ensemble_scheduling") or {}).get("step") or []]
                    known = {m: await self.priority_levels(m) for m in dict.fromkeys(steps)}
                    levels = wire.config_priority_levels(config, known.__getitem__)
                except Exception as exc:
                    log.info("priority levels of %s unknown (%s: %s)", model, type(exc).__name__, exc)
            self._levels[model] = levels
        return self._levels[model]

    async def validate_priority(self, model: str, priority) -> int:
        """See :meth:`~.sync_client.CosyVoiceClient.validate_priority`."""
        value = wire._priority_value(priority)
        if value and self.check_priority:
            wire._check_levels(model, value, await self.priority_levels(model))
        return value

    async def convert(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                      seed: int | None = None, parameters: Mapping[str, Any] | None = None,
                      encoded: bool = False, priority: int | None = None) -> wire.VCResult:
        src, s_sr = wire._payload(source, source_sr, "source", encoded)
        prm, p_sr = wire._payload(prompt, prompt_sr, "prompt", encoded)
        inputs = wire.build_inputs(self._module, src, s_sr, prm, p_sr, seed)
        t0 = time.perf_counter()
        res = await self._infer(self.model, inputs, parameters, priority=priority)
        return wire._result(res, time.perf_counter() - t0)

    async def convert_many(self, pairs: Iterable[wire.Pair], *, seed: int | None = None,
                           priority: int | None = None) -> list[wire.VCResult | wire.VCError]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(job):
            async with sem:
                try:
                    return await self.convert(**{"seed": seed, "priority": priority, **job})
                except wire.VCError as exc:
                    return exc
                except Exception as exc:
                    return wire.VCError(str(exc), "client")

        return list(await asyncio.gather(*(one(wire._pair_args(p)) for p in pairs)))

    async def _infer(self, model: str, inputs: Sequence, parameters: Mapping[str, Any] | None = None, *,
                     retry: bool = True, priority: int | None = None):
        level = await self.validate_priority(model, priority)
        try:
            async for attempt in (self.retry if retry else NO_RETRY).async_retrying(self._counted):
                with attempt:
                    if self.protocol == "http":
                        return await self._client.infer(model, list(inputs), parameters=parameters, priority=level)
                    return await self._client.infer(model, list(inputs), parameters=parameters, priority=level,
                                                    client_timeout=self.timeout)
        except Exception as exc:
            raise wire.VCError.from_exception(exc) from exc
        raise AssertionError("unreachable: tenacity raises the last error")

    async def stream_raw(self, model: str, inputs: Sequence, *, parameters: Mapping[str, Any] | None = None,
                         stats: wire.StreamStats | None = None,
                         priority: int | None = None) -> AsyncIterator[wire.StreamChunk]:
        """Chunks of a decoupled model as they arrive (``tritonclient.grpc.aio`` stream, or HTTP
        ``generate_stream`` with ``aiohttp``); closing the generator early cancels the call (gRPC: the request on
        the server too) or closes the connection (HTTP). Errors and ``priority`` as
        :meth:`~.sync_client.CosyVoiceClient.stream_raw` (checked when the iteration starts)."""
        if self.protocol == "http":
            wire._no_stream_priority(model, priority)
            inner = self._http_stream(model, inputs, parameters, stats)
            try:
                async for chunk in inner:
                    yield chunk
            finally:  # closed early: close its connection now, not when the generator is collected
                await inner.aclose()
            return
        request = {"model_name": model, "inputs": list(inputs), "parameters": parameters,
                   "priority": await self.validate_priority(model, priority)}

        async def requests():
            yield request

        stats = stats if stats is not None else wire.StreamStats()
        t0 = time.perf_counter()
        call = self._client.stream_infer(requests(), stream_timeout=self.timeout)
        done, index = False, 0
        try:
            async for result, error in call:
                if error is not None:
                    done = True
                    raise wire.VCError.from_exception(error)
                if result.as_numpy("waveform") is not None:
                    chunk = wire._chunk(result, t0, index)
                    index += 1
                    stats.add(chunk)
                    yield chunk
                if wire._is_final(result):
                    break
            done = True
        finally:
            if not done:
                call.cancel()

    async def _http_stream(self, model, inputs, parameters, stats) -> AsyncIterator[wire.StreamChunk]:
        import aiohttp

        body = wire.JsonFields.body(inputs, parameters)
        stats = stats if stats is not None else wire.StreamStats()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                sock_connect=min(self.timeout, 60.0), sock_read=self.timeout))
        t0 = time.perf_counter()
        try:
            async with self._session.post(wire._stream_url(self.url, model), json=body) as response:
                if response.status != 200:
                    raise wire._http_refusal(model, response.status, await response.read())
                reader = wire._SSEChunks(model, stats, t0)
                async for data in response.content.iter_any():
                    for chunk in reader.feed(data):
                        yield chunk
                for chunk in reader.close():
                    yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise wire.VCError(f"{model}: {type(exc).__name__}: {exc}", "connection") from exc

    def convert_stream(self, source, prompt=None, *, speaker_id: str | None = None, source_sr: int | None = None,
                       prompt_sr: int | None = None, seed: int | None = None,
                       parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                       stats: wire.StreamStats | None = None, model: str = wire.VC_STREAM_MODEL,
                       priority: int | None = None) -> AsyncIterator[wire.StreamChunk]:
        """``async for chunk in client.convert_stream(...)``: see
        :meth:`~.sync_client.CosyVoiceClient.convert_stream`."""
        if self.protocol == "http":
            wire._no_stream_priority(model, priority)
        return self.stream_raw(model, wire._vc_inputs(self._stream_module, source, prompt, source_sr, prompt_sr, seed,
                                                 speaker_id, encoded and self.protocol == "grpc"),
                               parameters=parameters, stats=stats, priority=priority)

    async def tts(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
                  instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
                  seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                  model: str = TTS_MODEL, priority: int | None = None) -> wire.VCResult:
        inputs = wire._tts_inputs(self._module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode, seed,
                             encoded)
        t0 = time.perf_counter()
        res = await self._infer(model, inputs, parameters, priority=priority)
        return wire._result(res, time.perf_counter() - t0)

    def tts_stream(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
                   instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
                   seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                   stats: wire.StreamStats | None = None, model: str = TTS_STREAM_MODEL,
                   priority: int | None = None) -> AsyncIterator[wire.StreamChunk]:
        if self.protocol == "http":
            wire._no_stream_priority(model, priority)
        inputs = wire._tts_inputs(self._stream_module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode,
                             seed, encoded and self.protocol == "grpc")
        return self.stream_raw(model, inputs, parameters=parameters, stats=stats, priority=priority)

    async def speech_tokens(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                            parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                            model: str = SPEECH_TOKENS_MODEL) -> np.ndarray:
        """See :meth:`~.sync_client.CosyVoiceClient.speech_tokens`."""
        data, sr = wire._payload(audio_, sample_rate, "audio", encoded)
        res = await self._infer(model, wire._audio_inputs(self._module, "source", data, sr), parameters,
                                priority=priority)
        return wire._output(res, "speech_tokens", np.int32)

    async def speaker_embedding(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                                parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                                model: str = SPEAKER_EMBEDDING_MODEL) -> np.ndarray:
        """See :meth:`~.sync_client.CosyVoiceClient.speaker_embedding`."""
        data, sr = wire._payload(audio_, sample_rate, "audio", encoded)
        res = await self._infer(model, wire._audio_inputs(self._module, "prompt", data, sr), parameters,
                                priority=priority)
        return wire._output(res, "speaker_embedding", np.float32)

    async def register_speaker(self, speaker_id: str, prompt, *, prompt_sr: int | None = None,
                               prompt_text: str | None = None, encoded: bool = False, priority: int | None = None,
                               family: str = "cosyvoice2"):
        audio_, sr = wire._payload(prompt, prompt_sr, "prompt", encoded)
        return wire._speaker_prompt(await self._infer(wire.speakers_model(family), wire.build_speaker_inputs(
            self._module, "register", speaker_id, prompt=audio_, prompt_sr=sr, prompt_text=prompt_text),
            priority=priority), family)

    async def get_speaker(self, speaker_id: str, *, family: str = "cosyvoice2"):
        inputs = wire.build_speaker_inputs(self._module, "get", speaker_id)
        return wire._speaker_prompt(await self._infer(wire.speakers_model(family), inputs), family)

    async def list_speakers(self, *, family: str = "cosyvoice2") -> list[str]:
        return wire._ids(await self._infer(wire.speakers_model(family),
                                           wire.build_speaker_inputs(self._module, "list")))

    async def delete_speaker(self, speaker_id: str, *, family: str = "cosyvoice2") -> None:
        inputs = wire.build_speaker_inputs(self._module, "delete", speaker_id)
        await self._infer(wire.speakers_model(family), inputs, retry=False)


#: The older names of :class:`AsyncCosyVoiceClient`, kept as aliases.
AsyncVCClient = AsyncCosyVoiceClient
AsyncTTSClient = AsyncCosyVoiceClient
