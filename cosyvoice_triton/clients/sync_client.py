"""The synchronous client of the served models (HTTP or gRPC, ``tritonclient``): :class:`CosyVoiceClient`
(voice conversion, text to speech, their streams, the speech tokens and speaker embedding, registered speakers).
``VCClient`` and ``TTSClient`` are its older names, kept as aliases."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..admin import given_admin_key
from ..shapes import SPEAKER_EMBEDDING_MODEL, SPEECH_TOKENS_MODEL, TTS_MODEL, TTS_STREAM_MODEL, VC_MODEL
from . import wire
from .retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy, is_retryable

log = logging.getLogger(__name__)

__all__ = ["CosyVoiceClient", "TTSClient", "VCClient"]


class CosyVoiceClient(wire._ClientBase):
    """Synchronous client; one connection (pool) reused for every call. Not for use from several threads
    at once: ``convert_many`` runs requests concurrently itself. ``admin_key`` (default
    ``$COSYVOICE_TRITON_ADMIN_KEY``) lets it read model configs to check request priorities (``check_priority``)."""

    def __init__(self, url: str | None = None, *, protocol: str = "http", model: str = VC_MODEL,
                 timeout: float = 300.0, concurrency: int = 8, verbose: bool = False,
                 retry: RetryPolicy = DEFAULT_RETRY, admin_key: str | None = None, check_priority: bool = True):
        super().__init__(url, protocol, model, timeout, concurrency, retry, admin_key, check_priority)
        self._module, self._client = wire.connect(self.url, protocol, timeout=self.timeout,
                                                  concurrency=self.concurrency, verbose=verbose)

    # ------------------------------------------------------------------------------------- basics

    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready()) and bool(self._client.is_model_ready(self.model))
        except Exception:
            return False

    def statistics(self, model: str = "") -> dict:
        """Triton's per-model statistics (all models when ``model`` is empty), as a dict."""
        return wire.inference_statistics(self._client, self.protocol, model)

    def _model_config(self, model: str) -> dict:
        headers = self._config_headers()
        if self.protocol == "http":
            return wire._config_of(self._client.get_model_config(model, headers=headers))
        return wire._config_of(self._client.get_model_config(model, headers=headers, as_json=True))

    def priority_levels(self, model: str | None = None) -> int | None:
        """The priority levels ``model`` (default: this client's) declares (:func:`~.wire.config_priority_levels`), read
        once from its config; ``None`` when the config cannot be read (no admin key, refused)."""
        model = model or self.model
        if model not in self._levels:
            levels = None
            if given_admin_key(self.admin_key):
                try:
                    levels = wire.config_priority_levels(self._model_config(model), self.priority_levels)
                except Exception as exc:  # not checkable: the priority goes as it is
                    log.info("priority levels of %s unknown (%s: %s)", model, type(exc).__name__, exc)
            self._levels[model] = levels
        return self._levels[model]

    def validate_priority(self, model: str, priority) -> int:
        """The priority to send for ``model`` (0: none); :class:`~.wire.PriorityError` for one that is not a whole
        number >= 1 or that the model's config does not allow (checked when the config can be read)."""
        value = wire._priority_value(priority)
        if value and self.check_priority:
            wire._check_levels(model, value, self.priority_levels(model))
        return value

    def close(self) -> None:
        self._client.close()
        if self._session is not None:
            self._session.close()

    def __enter__(self) -> CosyVoiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------------------------- conversion

    def _inputs(self, source, prompt, source_sr, prompt_sr, seed, encoded=False):
        src, s_sr = wire._payload(source, source_sr, "source", encoded)
        prm, p_sr = wire._payload(prompt, prompt_sr, "prompt", encoded)
        return wire.build_inputs(self._module, src, s_sr, prm, p_sr, seed)

    def infer_raw(self, inputs: Sequence, *, parameters: Mapping[str, Any] | None = None,
                  model: str | None = None, priority: int | None = None) -> wire.VCResult:
        """Send prepared ``tritonclient`` inputs (for tests of malformed requests); raises :class:`~.wire.VCError`."""
        t0 = time.perf_counter()
        res = self._infer(model or self.model, inputs, parameters, priority=priority)
        return wire._result(res, time.perf_counter() - t0)

    def _infer(self, model: str, inputs: Sequence, parameters: Mapping[str, Any] | None = None, *,
               retry: bool = True, priority: int | None = None):
        level = self.validate_priority(model, priority)
        try:
            for attempt in (self.retry if retry else NO_RETRY).retrying(self._counted):
                with attempt:
                    if self.protocol == "http":
                        return self._client.infer(model, list(inputs), parameters=parameters, priority=level)
                    return self._client.infer(model, list(inputs), parameters=parameters, priority=level,
                                              client_timeout=self.timeout)
        except Exception as exc:
            raise wire.VCError.from_exception(exc) from exc
        raise AssertionError("unreachable: tenacity raises the last error")

    def convert(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                seed: int | None = None, parameters: Mapping[str, Any] | None = None,
                encoded: bool = False, priority: int | None = None) -> wire.VCResult:
        """Convert ``source`` into the voice of ``prompt``: paths, encoded bytes, or samples with ``*_sr``.
        ``encoded=True`` sends files as they are (the server decodes them) instead of decoding them here.
        ``priority``: the request's priority level (1 highest; None: the model's default)."""
        return self.infer_raw(self._inputs(source, prompt, source_sr, prompt_sr, seed, encoded),
                              parameters=parameters, priority=priority)

    def convert_many(self, pairs: Iterable[wire.Pair], *, seed: int | None = None,
                     priority: int | None = None) -> list[wire.VCResult | wire.VCError]:
        """Many conversions in flight at once (up to ``concurrency``); results in order, a failed one as its
        :class:`~.wire.VCError`. Each pair: ``(source, prompt)`` or a dict of :meth:`convert`'s arguments."""
        jobs = [wire._pair_args(p) for p in pairs]
        out: list[wire.VCResult | wire.VCError | None] = [None] * len(jobs)
        for start in range(0, len(jobs), self.concurrency):
            window = range(start, min(start + self.concurrency, len(jobs)))
            pending: dict[int, tuple[Any, float]] = {}
            inputs_of: dict[int, list] = {}
            for i in window:
                job = {"seed": seed, "priority": priority, **jobs[i]}
                try:
                    level = self.validate_priority(self.model, job["priority"])
                    inputs = self._inputs(job["source"], job["prompt"], job.get("source_sr"), job.get("prompt_sr"),
                                          job.get("seed"), job.get("encoded", False))
                except Exception as exc:
                    out[i] = exc if isinstance(exc, wire.VCError) else wire.VCError(str(exc), "client")
                    continue
                inputs_of[i] = inputs
                pending[i] = (self._submit(inputs, job.get("parameters"), level), time.perf_counter())
            for i, (handle, t0) in pending.items():
                try:
                    res = handle.get_result() if self.protocol == "http" else handle.result()
                    if isinstance(res, Exception):
                        raise res
                    out[i] = wire._result(res, time.perf_counter() - t0)
                except Exception as exc:
                    out[i] = wire.VCError.from_exception(exc)
                    if is_retryable(exc) and self.retry.attempts > 1:  # tried once: the rest of the policy, alone
                        self._counted(exc)
                        try:
                            out[i] = self.infer_raw(inputs_of[i], parameters=jobs[i].get("parameters"),
                                                    priority=jobs[i].get("priority", priority))
                        except wire.VCError as again:
                            out[i] = again
        return out  # type: ignore[return-value]

    def _submit(self, inputs, parameters, priority: int = 0):
        if self.protocol == "http":
            return self._client.async_infer(self.model, inputs, parameters=parameters, priority=priority)
        fut: Future = Future()

        def done(result, error):
            fut.set_result(error if error is not None else result)

        self._client.async_infer(self.model, inputs, done, parameters=parameters, priority=priority,
                                 client_timeout=self.timeout)
        return fut

    # ------------------------------------------------------------------------------- streaming

    def stream_raw(self, model: str, inputs: Sequence, *, parameters: Mapping[str, Any] | None = None,
                   stats: wire.StreamStats | None = None, priority: int | None = None) -> Iterator[wire.StreamChunk]:
        """Chunks of a decoupled model as they arrive: over a gRPC stream, or over HTTP ``generate_stream``
        (``inputs`` built with :attr:`_stream_module`: :class:`~.wire.JsonFields`). Closing the generator early
        (``break``) cancels the request (gRPC) or closes the connection (HTTP). An error raises
        :class:`~.wire.VCError` with the server's message: before the first chunk with its status (HTTP 400,
        ``StatusCode.INVALID_ARGUMENT``...), mid-stream on HTTP with status ``"stream"`` (an SSE error event carries
        no code). ``priority``: gRPC only (:class:`~.wire.PriorityError` over HTTP, raised here, before anything is
        sent)."""
        if self.protocol == "http":
            wire._no_stream_priority(model, priority)
            return self._http_stream(model, inputs, parameters, stats)
        return self._grpc_stream(model, inputs, parameters, stats, self.validate_priority(model, priority))

    def _http_stream(self, model, inputs, parameters, stats) -> Iterator[wire.StreamChunk]:
        import requests

        body = wire.JsonFields.body(inputs, parameters)
        stats = stats if stats is not None else wire.StreamStats()
        if self._session is None:
            self._session = requests.Session()
        t0 = time.perf_counter()
        try:
            response = self._session.post(wire._stream_url(self.url, model), json=body, stream=True,
                                          timeout=(min(self.timeout, 60.0), self.timeout))
        except requests.RequestException as exc:
            raise wire.VCError(f"{model}: {exc}", "connection") from exc
        with response:
            if response.status_code != 200:
                raise wire._http_refusal(model, response.status_code, response.content)
            reader = wire._SSEChunks(model, stats, t0)
            try:
                for data in response.iter_content(chunk_size=None):
                    yield from reader.feed(data)
                yield from reader.close()
            except requests.RequestException as exc:
                raise wire.VCError(f"{model}: the stream broke off: {exc}", "connection") from exc

    def _grpc_stream(self, model, inputs, parameters, stats, priority: int = 0) -> Iterator[wire.StreamChunk]:
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        done, stats = False, stats if stats is not None else wire.StreamStats()
        t0 = time.perf_counter()
        try:
            self._client.async_stream_infer(model, list(inputs), parameters=parameters, priority=priority,
                                            enable_empty_final_response=True)
            index = 0
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout)
                except queue.Empty:
                    raise wire.VCError(f"{model}: no streamed response within {self.timeout:g} s", "timeout") from None
                if error is not None:
                    done = True  # an error is the stream's last response
                    raise wire.VCError.from_exception(error)
                final = wire._is_final(result)
                if result.as_numpy("waveform") is not None:
                    chunk = wire._chunk(result, t0, index)
                    index += 1
                    stats.add(chunk)
                    yield chunk
                if final:
                    done = True
                    return
        finally:
            self._client.stop_stream(cancel_requests=not done)

    def convert_stream(self, source, prompt=None, *, speaker_id: str | None = None, source_sr: int | None = None,
                       prompt_sr: int | None = None, seed: int | None = None,
                       parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                       stats: wire.StreamStats | None = None, model: str = wire.VC_STREAM_MODEL,
                       priority: int | None = None) -> Iterator[wire.StreamChunk]:
        """Streaming voice conversion (gRPC or HTTP): chunks on the official schedule as the server sends them.
        The voice: ``prompt`` audio or a registered ``speaker_id``. ``stats`` gets the first-chunk latency.
        ``priority``: gRPC only (see :meth:`stream_raw`)."""
        return self.stream_raw(model, wire._vc_inputs(self._stream_module, source, prompt, source_sr, prompt_sr, seed,
                                                 speaker_id, encoded and self.protocol == "grpc"),
                               parameters=parameters, stats=stats, priority=priority)

    # -------------------------------------------------------------------------- text to speech

    def tts(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
            instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
            seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
            model: str = TTS_MODEL, priority: int | None = None) -> wire.VCResult:
        """Text to speech, the whole answer (HTTP or gRPC). The voice: ``prompt`` (path, bytes, or samples with
        ``prompt_sr``) with an optional ``prompt_text``, or a registered ``speaker_id``."""
        inputs = wire._tts_inputs(self._module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode, seed,
                             encoded)
        return self.infer_raw(inputs, parameters=parameters, model=model, priority=priority)

    def tts_stream(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
                   instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
                   seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                   stats: wire.StreamStats | None = None, model: str = TTS_STREAM_MODEL,
                   priority: int | None = None) -> Iterator[wire.StreamChunk]:
        """Streaming text to speech (gRPC or HTTP): chunks as they arrive (see :meth:`tts` and
        :meth:`stream_raw`)."""
        inputs = wire._tts_inputs(self._stream_module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode,
                             seed, encoded and self.protocol == "grpc")
        return self.stream_raw(model, inputs, parameters=parameters, stats=stats, priority=priority)

    # ------------------------------------------------------------------- speech tokens, speaker embedding

    def speech_tokens(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                      parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                      model: str = SPEECH_TOKENS_MODEL) -> np.ndarray:
        """The 25 Hz CosyVoice speech tokens (int32 [T]) of ``audio_`` (a path, encoded bytes, or samples with
        ``sample_rate``; at most 30 s: the tokenizer's limit), from the ``speech_tokens`` model."""
        data, sr = wire._payload(audio_, sample_rate, "audio", encoded)
        res = self._infer(model, wire._audio_inputs(self._module, "source", data, sr), parameters, priority=priority)
        return wire._output(res, "speech_tokens", np.int32)

    def speaker_embedding(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                          parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                          model: str = SPEAKER_EMBEDDING_MODEL) -> np.ndarray:
        """The 192-dim CAM++ speaker embedding (float32 [192]) of ``audio_`` (as :meth:`speech_tokens`), from the
        ``speaker_embedding`` model (the audio gets a VC prompt's treatment)."""
        data, sr = wire._payload(audio_, sample_rate, "audio", encoded)
        res = self._infer(model, wire._audio_inputs(self._module, "prompt", data, sr), parameters, priority=priority)
        return wire._output(res, "speaker_embedding", np.float32)

    # ------------------------------------------------------------------------------- speakers

    def register_speaker(self, speaker_id: str, prompt, *, prompt_sr: int | None = None,
                         prompt_text: str | None = None, encoded: bool = False, priority: int | None = None,
                         family: str = "cosyvoice2"):
        """Register (or replace) ``speaker_id`` from prompt audio (and its transcript) with the speakers model of
        ``family`` (``cosyvoice3``: ``cosyvoice3_speakers``); returns its
        :class:`~cosyvoice_triton.speakers.SpeakerPrompt` as the server computed it."""
        audio_, sr = wire._payload(prompt, prompt_sr, "prompt", encoded)
        inputs = wire.build_speaker_inputs(self._module, "register", speaker_id, prompt=audio_, prompt_sr=sr,
                                           prompt_text=prompt_text)
        res = self._infer(wire.speakers_model(family), inputs, priority=priority)
        return wire._speaker_prompt(res, family)

    def get_speaker(self, speaker_id: str, *, family: str = "cosyvoice2"):
        inputs = wire.build_speaker_inputs(self._module, "get", speaker_id)
        return wire._speaker_prompt(self._infer(wire.speakers_model(family), inputs), family)

    def list_speakers(self, *, family: str = "cosyvoice2") -> list[str]:
        return wire._ids(self._infer(wire.speakers_model(family), wire.build_speaker_inputs(self._module, "list")))

    def delete_speaker(self, speaker_id: str, *, family: str = "cosyvoice2") -> None:  # not retried: a lost answer
        # would make it "not found"
        self._infer(wire.speakers_model(family), wire.build_speaker_inputs(self._module, "delete", speaker_id),
                    retry=False)


#: The older names of :class:`CosyVoiceClient` (from when it served voice conversion only), kept as aliases.
VCClient = CosyVoiceClient
TTSClient = CosyVoiceClient
