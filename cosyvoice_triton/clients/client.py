"""Client of the served ``cosyvoice_vc`` ensemble over HTTP or gRPC (``tritonclient``), sync and asyncio.

    with VCClient("127.0.0.1:8000") as client:                       # one connection, reused
        result = client.convert("source.wav", "prompt.wav")           # paths, bytes, or (samples, rate)
        result.write("out.wav")
        results = client.convert_many([("a.wav", "p.wav"), ("b.wav", "p.wav")])   # concurrently

    async with AsyncVCClient("127.0.0.1:8001", protocol="grpc") as client:
        result = await client.convert(samples, prompt, source_sr=16000, prompt_sr=22050)

Audio is decoded here (``soundfile``: wav/flac/ogg from a path or bytes; float or int PCM arrays with their
rate), mixed to mono and sent as float32 samples with their rate (:data:`~cosyvoice_triton.shapes.VC_INPUTS`);
with ``encoded=True`` files are sent as they are (``*_audio_bytes``) and the server decodes them. The server
resamples. A request the server refuses raises
:class:`VCError` carrying the server's own message and status (HTTP 400 / gRPC ``INVALID_ARGUMENT`` for bad
input); ``convert_many`` returns such errors in place of the failed items instead of raising. Calls that failed
for a reason worth another try (server unavailable or overloaded, a timeout, a lost connection) are sent again
with capped, jittered backoff (``retry=``, :mod:`~cosyvoice_triton.clients.retry`; ``retries`` counts them);
bad input never is, nor a stream once it has started.

Streams (``convert_stream``, ``tts_stream``) run over a gRPC stream (``tritonclient``) or, with
``protocol="http"``, over Triton's HTTP ``generate_stream`` endpoint (server-sent events; ``requests`` /
``aiohttp``, as tritonclient has no HTTP streaming call): the same chunks either way. Over HTTP the inputs travel
as JSON fields, so encoded files (``encoded=True``) are decoded here first, and closing a stream early closes its
connection.

The stand-alone speech services: ``speech_tokens(audio)`` (the ``speech_tokens`` model: int32 [T], 25 Hz) and
``speaker_embedding(audio)`` (the ``speaker_embedding`` model: float32 [192], CAM++).

Priorities: every call takes ``priority`` (``None``: the model's default level; 1 is the highest level), passed to
Triton as the request's priority. Triton 2.51 does not refuse a priority beyond a model's ``priority_levels`` (nor
one sent to a model without levels): it serves the request at the model's default level. So the client checks the
priority against the levels the model's config declares (an ensemble: its steps'), once per model, when it can
read the config (a restricted API: it needs the admin key, ``admin_key=`` or ``$COSYVOICE_TRITON_ADMIN_KEY``;
``check_priority=False`` turns the check off), and raises :class:`PriorityError` before sending; without the key
the priority goes as it is. HTTP ``generate_stream`` cannot carry a priority in Triton 2.51 (a ``priority`` field
there becomes a plain request parameter), so an HTTP stream with a priority raises :class:`PriorityError`: use
gRPC.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..admin import admin_headers, given_admin_key
from ..errors import AudioError
from ..frontend import audio
from ..shapes import SPEAKER_EMBEDDING_MODEL, SPEECH_TOKENS_MODEL, TTS_MODEL, TTS_STREAM_MODEL, VC_MODEL
from .retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy, is_retryable

log = logging.getLogger(__name__)

VC_STREAM_MODEL = "cosyvoice_vc_stream"
SPEAKERS_MODEL = "speakers"

__all__ = ["AsyncTTSClient", "AsyncVCClient", "JsonFields", "PriorityError", "StreamChunk", "StreamStats", "TTSClient",
           "VCClient", "VCError", "VCResult", "build_inputs", "build_speaker_inputs", "build_tts_inputs",
           "config_priority_levels", "connect", "inference_statistics", "load_input"]

PROTOCOLS = ("http", "grpc")
DEFAULT_URLS = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")  # Triton's prefix of a step's error (any ensemble)


class VCError(RuntimeError):
    """The server refused or failed a conversion: ``message`` is the server's, ``status`` its code
    (``"400"`` / ``"StatusCode.INVALID_ARGUMENT"`` for bad input), ``invalid_argument`` says which kind."""

    def __init__(self, message: str, status: str | None = None):
        self.message = message
        self.status = status
        super().__init__(f"{message} [{status}]" if status else message)

    @property
    def invalid_argument(self) -> bool:
        return self.status in ("400", "StatusCode.INVALID_ARGUMENT")

    @classmethod
    def from_exception(cls, exc: BaseException) -> VCError:
        if isinstance(exc, VCError):
            return exc
        msg = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
        msg = _ENSEMBLE_PREFIX.sub("", re.sub(r"^\[request id: [^\]]*\] ", "", msg or str(exc)))
        status = exc.status() if callable(getattr(exc, "status", None)) else None
        return cls(msg, None if status is None else str(status))


class PriorityError(VCError, ValueError):
    """A request priority the client refuses before sending (status ``"priority"``): not a whole number >= 1,
    beyond the levels the model's config declares (Triton 2.51 would serve it at the model's default level without
    a word), or on an HTTP stream (Triton 2.51's ``generate_stream`` cannot carry one)."""

    def __init__(self, message: str):
        super().__init__(message, "priority")


def _priority_value(priority) -> int:
    """``priority`` as the number tritonclient sends (0: none, the model's default level)."""
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise PriorityError(f"priority must be a whole number >= 1 (1 is the highest level) or None, got "
                            f"{priority!r}")
    if int(priority) < 1:
        raise PriorityError(f"priority must be >= 1 (1 is the highest level; None: the model's default level), got "
                            f"{int(priority)}")
    return int(priority)


def config_priority_levels(config: Mapping[str, Any], step_levels=None) -> int | None:
    """The priority levels a model config (Triton's JSON form) declares: its ``dynamic_batching.priority_levels``
    (0: none); an ensemble, which has no scheduler of its own and passes the request's priority on to its steps: the
    fewest levels among its steps that have any (``step_levels(model_name)`` gives a step's; ``None``, unknown, when
    a step's is unknown: its config could not be read)."""
    batching = config.get("dynamic_batching")
    if batching is not None:
        return int(batching.get("priority_levels", 0) or 0)
    steps = (config.get("ensemble_scheduling") or {}).get("step") or []
    if not steps or step_levels is None:
        return 0
    levels = [step_levels(step["model_name"]) for step in steps]
    if any(n is None for n in levels):
        return None
    return min((int(n) for n in levels if int(n) > 0), default=0)


def _check_levels(model: str, priority: int, levels: int | None) -> None:
    if not priority or levels is None:
        return
    if levels == 0:
        raise PriorityError(f"priority {priority}: model {model!r} declares no priority levels (rendered without "
                            "priority_levels), so Triton would ignore it; send no priority, or render the repository "
                            "with --set priority_levels=N")
    if priority > levels:
        raise PriorityError(f"priority {priority} is beyond the {levels} priority levels of model {model!r} (1 is the "
                            f"highest, {levels} the lowest); Triton 2.51 would serve it at the model's default level")


def _no_stream_priority(model: str, priority) -> None:
    if priority is not None:
        raise PriorityError(f"{model}: HTTP generate_stream cannot carry a request priority in Triton 2.51 (a "
                            "'priority' field reaches the model as a plain request parameter, not as the request's "
                            "priority); stream over gRPC (protocol='grpc') to give one")


def _config_of(answer) -> dict:
    """A ``get_model_config`` answer (HTTP: the config; gRPC ``as_json``: ``{"config": ...}``) -> the config."""
    return dict(answer.get("config", answer)) if isinstance(answer, Mapping) else {}


def _output(response, name: str, dtype) -> np.ndarray:
    """Output ``name`` of a batch-1 answer, without the batch axis."""
    arr = response.as_numpy(name)
    if arr is None:
        raise VCError(f"the server's answer has no {name} output")
    return np.asarray(arr, dtype).reshape(-1)


@dataclass
class VCResult:
    waveform: np.ndarray  # float32 [N]
    sample_rate: int
    latency_s: float = 0.0
    audio_bytes: bytes | None = None  # when the server encodes (postprocess output_format)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.waveform.shape[0] / self.sample_rate

    def write(self, path: str | os.PathLike) -> Path:
        """Write a 16-bit PCM wav (or the server's encoded bytes when the extension matches their format)."""
        import soundfile

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(path, np.clip(self.waveform, -1.0, 1.0), self.sample_rate, subtype="PCM_16")
        return path


def load_input(x, sample_rate: int | None = None, *, name: str = "audio") -> tuple[np.ndarray, int]:
    """``(float32 mono samples, rate)`` of a path / encoded bytes (decoded here) or samples with their rate.

    Only decoding and layout are checked here; the server validates content (length, NaN, silence, rate)."""
    if isinstance(x, (str, os.PathLike, bytes, bytearray, memoryview)):
        if sample_rate is not None:
            raise AudioError(f"{name}: a file carries its own rate; pass sample_rate only with samples")
        return audio.decode_audio(x, name=name)
    if sample_rate is None:
        raise AudioError(f"{name}: samples need their sample rate")
    return audio.to_mono_float32(x, name=name), int(sample_rate)


def _payload(x, sample_rate, name: str, encoded: bool):
    """What is sent for one utterance: the file's bytes (``encoded``, files only) or decoded samples."""
    if encoded and isinstance(x, (str, os.PathLike, bytes, bytearray, memoryview)):
        if sample_rate is not None:
            raise AudioError(f"{name}: a file carries its own rate; pass sample_rate only with samples")
        data = bytes(x) if isinstance(x, (bytes, bytearray, memoryview)) else Path(x).read_bytes()
        return data, None
    return load_input(x, sample_rate, name=name)


def _tensor(module, name: str, arr: np.ndarray, dtype: str):
    t = module.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def _text(module, name: str, value: str | bytes):
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return _tensor(module, name, np.array([[data]], dtype=object), "BYTES")


def _audio_inputs(module, which: str, x: np.ndarray | bytes, sr: int | None) -> list:
    """One utterance: ``<which>_audio`` + ``<which>_sample_rate``, or ``<which>_audio_bytes`` for file bytes."""
    if isinstance(x, (bytes, bytearray)):
        return [_tensor(module, f"{which}_audio_bytes", np.array([[bytes(x)]], dtype=object), "BYTES")]
    return [_tensor(module, f"{which}_audio", np.ascontiguousarray(x, np.float32)[None], "FP32"),
            _tensor(module, f"{which}_sample_rate", np.array([[sr]], np.int32), "INT32")]


def build_inputs(module, source: np.ndarray | bytes, source_sr: int | None, prompt: np.ndarray | bytes | None,
                 prompt_sr: int | None, seed: int | None = None, *, speaker_id: str | None = None) -> list:
    """The ``cosyvoice_vc`` (or ``cosyvoice_vc_stream``) input tensors for ``tritonclient.http`` or
    ``tritonclient.grpc`` (``module``): each utterance as float32 samples with their rate, or as an encoded file's
    ``bytes`` (rate None); ``speaker_id`` (a registered speaker) instead of the prompt."""
    inputs = _audio_inputs(module, "source", source, source_sr)
    if prompt is not None:
        inputs += _audio_inputs(module, "prompt", prompt, prompt_sr)
    if speaker_id is not None:
        inputs.append(_text(module, "speaker_id", speaker_id))
    if seed is not None:
        inputs.append(_tensor(module, "seed", np.array([[int(seed)]], np.int64), "INT64"))
    return inputs


def build_tts_inputs(module, text: str | bytes, *, prompt: np.ndarray | bytes | None = None,
                     prompt_sr: int | None = None, prompt_text: str | None = None, instruct: str | None = None,
                     speaker_id: str | None = None, mode: str | None = None, seed: int | None = None) -> list:
    """The ``cosyvoice_tts`` / ``cosyvoice_tts_stream`` input tensors (:data:`~cosyvoice_triton.shapes.TTS_INPUTS`)."""
    inputs = [_text(module, "text", text)]
    if prompt is not None:
        inputs += _audio_inputs(module, "prompt", prompt, prompt_sr)
    for name, value in (("prompt_text", prompt_text), ("instruct_text", instruct), ("speaker_id", speaker_id),
                        ("mode", mode)):
        if value is not None:
            inputs.append(_text(module, name, value))
    if seed is not None:
        inputs.append(_tensor(module, "seed", np.array([[int(seed)]], np.int64), "INT64"))
    return inputs


def build_speaker_inputs(module, action: str, speaker_id: str | None = None, *,
                         prompt: np.ndarray | bytes | None = None, prompt_sr: int | None = None,
                         prompt_text: str | None = None) -> list:
    """The ``speakers`` model's input tensors (``action``: register, get, list, delete)."""
    inputs = [_text(module, "action", action)]
    if speaker_id is not None:
        inputs.append(_text(module, "speaker_id", speaker_id))
    if prompt is not None:
        inputs += _audio_inputs(module, "prompt", prompt, prompt_sr)
    if prompt_text is not None:
        inputs.append(_text(module, "prompt_text", prompt_text))
    return inputs


@dataclass
class StreamChunk:
    """One streamed response: ``waveform`` float32 [n], its ``index`` in the stream, and ``elapsed_s`` since the
    request was sent (the first chunk's is the first-chunk latency)."""

    waveform: np.ndarray
    sample_rate: int
    index: int
    elapsed_s: float


@dataclass
class StreamStats:
    """Filled in while a stream is consumed: first-chunk latency, total time, chunks and samples so far."""

    first_chunk_s: float | None = None
    total_s: float = 0.0
    chunks: int = 0
    samples: int = 0
    sample_rate: int = 0

    def add(self, chunk: StreamChunk) -> None:
        if self.first_chunk_s is None:
            self.first_chunk_s = chunk.elapsed_s
        self.total_s = chunk.elapsed_s
        self.chunks += 1
        self.samples += len(chunk.waveform)
        self.sample_rate = chunk.sample_rate

    @property
    def rtf(self) -> float:
        """Seconds of work per second of audio (so far)."""
        return self.total_s / max(self.samples / max(self.sample_rate, 1), 1e-9)


def _chunk(result, t0: float, index: int) -> StreamChunk:
    wave = result.as_numpy("waveform")
    sr = result.as_numpy("sample_rate")
    if wave is None or sr is None:
        raise VCError("a streamed response has no waveform / sample_rate output")
    idx = result.as_numpy("chunk_index")
    return StreamChunk(np.asarray(wave, np.float32).reshape(-1), int(np.asarray(sr).reshape(-1)[0]),
                       index if idx is None else int(np.asarray(idx).reshape(-1)[0]), time.perf_counter() - t0)


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


class JsonFields:
    """Stands in for a ``tritonclient`` module in the input builders (:func:`build_inputs`,
    :func:`build_tts_inputs`, ...): each ``InferInput`` keeps its array, and :meth:`body` makes the flat JSON of
    Triton's ``generate`` / ``generate_stream`` endpoints (one request, batch 1) from them."""

    class InferInput:
        def __init__(self, name: str, shape: Sequence[int], datatype: str):
            self._name, self.datatype, self.array = name, datatype, None

        def name(self) -> str:
            return self._name

        def set_data_from_numpy(self, array: np.ndarray, binary_data: bool = True) -> None:
            self.array = np.asarray(array)

    @staticmethod
    def body(inputs: Sequence[InferInput], parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``{name: value}``: a one-element tensor as a scalar, others as a flat list, BYTES as UTF-8 text;
        ``parameters`` join as fields (Triton passes fields that name no input on as request parameters)."""
        out: dict[str, Any] = {}
        for t in inputs:
            arr = t.array
            if arr.dtype == object:
                item = arr.reshape(-1)[0]
                try:
                    out[t.name()] = item.decode("utf-8") if isinstance(item, (bytes, bytearray)) else str(item)
                except UnicodeDecodeError:
                    raise AudioError(f"{t.name()}: binary data cannot travel as a JSON field of HTTP generate_stream; "
                                     "send samples (encoded=False) or use protocol='grpc'") from None
            else:
                out[t.name()] = arr.reshape(-1)[0].item() if arr.size == 1 else arr.reshape(-1).tolist()
        for k, v in (parameters or {}).items():
            if k in out:
                raise VCError(f"request parameter {k!r} has the name of an input", "client")
            out[k] = v
        return out


class _Events:
    """Server-sent events (``data: {...}`` lines, a blank line between events) from bytes as they arrive."""

    def __init__(self):
        self.buffer, self.data = b"", []

    def feed(self, data: bytes) -> list[dict]:
        self.buffer += data
        events = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                self.data.append(line[5:].strip())
            elif not line and self.data:
                events.append(json.loads(b"\n".join(self.data)))
                self.data = []
        return events

    def close(self) -> list[dict]:
        return self.feed(b"\n\n")


class _SSEChunks:
    """The chunks of one ``generate_stream`` answer from its bytes as they arrive (``feed``, then ``close``),
    counted into ``stats``; an error event raises :class:`VCError`."""

    def __init__(self, model: str, stats: StreamStats, t0: float):
        self.model, self.stats, self.t0 = model, stats, t0
        self.events, self.index = _Events(), 0

    def feed(self, data: bytes) -> Iterator[StreamChunk]:
        return self._chunks(self.events.feed(data))

    def close(self) -> Iterator[StreamChunk]:
        return self._chunks(self.events.close())

    def _chunks(self, events: list[dict]) -> Iterator[StreamChunk]:
        for event in events:  # in order: the chunks before an error event are given out before it raises
            chunk = _event_chunk(event, self.t0, self.index, self.model)
            if chunk is not None:
                self.index += 1
                self.stats.add(chunk)
                yield chunk


def _event_chunk(event: Mapping[str, Any], t0: float, index: int, model: str) -> StreamChunk | None:
    """The chunk of one generate_stream event (None for an event without audio); an error event raises."""
    if "error" in event:
        raise VCError(f"{model}: {event['error']}", "stream")
    if "waveform" not in event:
        return None
    if "sample_rate" not in event:
        raise VCError("a streamed event has a waveform but no sample_rate")
    idx = event.get("chunk_index")
    return StreamChunk(np.asarray(event["waveform"], np.float32).reshape(-1), int(np.ravel(event["sample_rate"])[0]),
                       index if idx is None else int(np.ravel(idx)[0]), time.perf_counter() - t0)


def _http_refusal(model: str, status: int, body: bytes) -> VCError:
    """A ``generate_stream`` answer other than 200: Triton's message (an SSE error event or JSON) and the status."""
    text = body.decode("utf-8", "replace")
    events = _Events().feed(body + b"\n\n") if text.lstrip().startswith("data:") else []
    message = next((e["error"] for e in events if "error" in e), None)
    if message is None:
        try:
            message = json.loads(text).get("error", text)
        except (ValueError, AttributeError):
            message = text.strip() or f"HTTP {status}"
    return VCError(f"{model}: {message}", str(status))


def _stream_url(url: str, model: str) -> str:
    return f"{url if '://' in url else 'http://' + url}/v2/models/{model}/generate_stream"


def _speaker_prompt(result):
    from ..speakers import SpeakerPrompt

    text = result.as_numpy("prompt_text")
    return SpeakerPrompt(prompt_tokens=result.as_numpy("prompt_tokens")[0].astype(np.int32),
                         prompt_mel=result.as_numpy("prompt_mel")[0].astype(np.float32),
                         embedding=result.as_numpy("embedding")[0].astype(np.float32),
                         prompt_text_tokens=result.as_numpy("prompt_text_tokens")[0].astype(np.int32),
                         prompt_text=bytes(text.reshape(-1)[0]).decode("utf-8") if text is not None else "")


def _ids(result) -> list[str]:
    ids = result.as_numpy("speaker_ids")
    return [] if ids is None else [bytes(x).decode("utf-8") for x in ids.reshape(-1)]


def _result(response, latency: float) -> VCResult:
    wave = response.as_numpy("waveform")
    sr = response.as_numpy("sample_rate")
    if wave is None or sr is None:
        raise VCError("the server's answer has no waveform / sample_rate output")
    extra = None
    try:
        extra = response.as_numpy("audio_bytes")
    except Exception:
        extra = None
    return VCResult(np.asarray(wave, np.float32).reshape(-1), int(np.asarray(sr).reshape(-1)[0]), latency,
                    bytes(extra.reshape(-1)[0]) if extra is not None and extra.size else None)


Pair = tuple[Any, Any] | Mapping[str, Any]


def _pair_args(pair: Pair) -> dict[str, Any]:
    if isinstance(pair, Mapping):
        return dict(pair)
    source, prompt = pair
    return {"source": source, "prompt": prompt}


def connect(url: str, protocol: str, *, timeout: float, concurrency: int = 1, verbose: bool = False):
    """A synchronous ``tritonclient`` connection: ``(module, InferenceServerClient)`` for ``protocol``; HTTP with
    ``concurrency`` pooled connections and ``timeout`` seconds to connect and per call (gRPC takes its deadline
    per call)."""
    if protocol == "http":
        import tritonclient.http as module

        return module, module.InferenceServerClient(url, concurrency=concurrency, connection_timeout=timeout,
                                                    network_timeout=timeout, verbose=verbose)
    import tritonclient.grpc as module

    return module, module.InferenceServerClient(url, verbose=verbose)


def inference_statistics(client, protocol: str, model: str = "") -> dict:
    """Triton's per-model statistics (all models when ``model`` is empty) of a synchronous client, as a dict.
    The statistics API is restricted: the request carries the admin header
    (:func:`~cosyvoice_triton.admin.admin_headers`)."""
    if protocol == "http":
        return client.get_inference_statistics(model, headers=admin_headers("http"))
    return client.get_inference_statistics(model, headers=admin_headers("grpc"), as_json=True)


def _vc_inputs(module, source, prompt, source_sr, prompt_sr, seed, speaker_id, encoded) -> list:
    src, s_sr = _payload(source, source_sr, "source", encoded)
    if prompt is None:
        if speaker_id is None:
            raise AudioError("prompt: give the prompt audio or a registered speaker_id")
        return build_inputs(module, src, s_sr, None, None, seed, speaker_id=speaker_id)
    prm, p_sr = _payload(prompt, prompt_sr, "prompt", encoded)
    return build_inputs(module, src, s_sr, prm, p_sr, seed, speaker_id=speaker_id)


def _tts_inputs(module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode, seed, encoded) -> list:
    prm, p_sr = (None, None) if prompt is None else _payload(prompt, prompt_sr, "prompt", encoded)
    return build_tts_inputs(module, text, prompt=prm, prompt_sr=p_sr, prompt_text=prompt_text, instruct=instruct,
                            speaker_id=speaker_id, mode=mode, seed=seed)


class VCClient:
    """Synchronous client; one connection (pool) reused for every call. Not for use from several threads
    at once: ``convert_many`` runs requests concurrently itself. ``admin_key`` (default
    ``$COSYVOICE_TRITON_ADMIN_KEY``) lets it read model configs to check request priorities (``check_priority``)."""

    def __init__(self, url: str | None = None, *, protocol: str = "http", model: str = VC_MODEL,
                 timeout: float = 300.0, concurrency: int = 8, verbose: bool = False,
                 retry: RetryPolicy = DEFAULT_RETRY, admin_key: str | None = None, check_priority: bool = True):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
        self.protocol, self.model, self.timeout = protocol, model, float(timeout)
        self.url = url or DEFAULT_URLS[protocol]
        self.concurrency = max(1, int(concurrency))
        self.retry, self.retries = retry, 0
        self.admin_key, self.check_priority = admin_key, bool(check_priority)
        self._levels: dict[str, int | None] = {}  # model -> priority levels of its config (None: unreadable)
        self._module, self._client = connect(self.url, protocol, timeout=self.timeout, concurrency=self.concurrency,
                                             verbose=verbose)
        self._session = None  # requests.Session of the HTTP streams, made on the first one

    # ------------------------------------------------------------------------------------- basics

    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready()) and bool(self._client.is_model_ready(self.model))
        except Exception:
            return False

    def statistics(self, model: str = "") -> dict:
        """Triton's per-model statistics (all models when ``model`` is empty), as a dict."""
        return inference_statistics(self._client, self.protocol, model)

    def _model_config(self, model: str) -> dict:
        headers = admin_headers(self.protocol, given_admin_key(self.admin_key))
        if self.protocol == "http":
            return _config_of(self._client.get_model_config(model, headers=headers))
        return _config_of(self._client.get_model_config(model, headers=headers, as_json=True))

    def priority_levels(self, model: str | None = None) -> int | None:
        """The priority levels ``model`` (default: this client's) declares (:func:`config_priority_levels`), read
        once from its config; ``None`` when the config cannot be read (no admin key, refused)."""
        model = model or self.model
        if model not in self._levels:
            levels = None
            if given_admin_key(self.admin_key):
                try:
                    levels = config_priority_levels(self._model_config(model), self.priority_levels)
                except Exception as exc:  # not checkable: the priority goes as it is
                    log.info("priority levels of %s unknown (%s: %s)", model, type(exc).__name__, exc)
            self._levels[model] = levels
        return self._levels[model]

    def validate_priority(self, model: str, priority) -> int:
        """The priority to send for ``model`` (0: none); :class:`PriorityError` for one that is not a whole number
        >= 1 or that the model's config does not allow (checked when the config can be read)."""
        value = _priority_value(priority)
        if value and self.check_priority:
            _check_levels(model, value, self.priority_levels(model))
        return value

    def close(self) -> None:
        self._client.close()
        if self._session is not None:
            self._session.close()

    @property
    def _stream_module(self):
        """What stream inputs are built with: ``tritonclient.grpc``, or :class:`JsonFields` for HTTP."""
        return JsonFields if self.protocol == "http" else self._module

    def __enter__(self) -> VCClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------------------------- conversion

    def _inputs(self, source, prompt, source_sr, prompt_sr, seed, encoded=False):
        src, s_sr = _payload(source, source_sr, "source", encoded)
        prm, p_sr = _payload(prompt, prompt_sr, "prompt", encoded)
        return build_inputs(self._module, src, s_sr, prm, p_sr, seed)

    def infer_raw(self, inputs: Sequence, *, parameters: Mapping[str, Any] | None = None,
                  model: str | None = None, priority: int | None = None) -> VCResult:
        """Send prepared ``tritonclient`` inputs (for tests of malformed requests); raises :class:`VCError`."""
        t0 = time.perf_counter()
        res = self._infer(model or self.model, inputs, parameters, priority=priority)
        return _result(res, time.perf_counter() - t0)

    def _counted(self, exc: BaseException | None) -> None:
        self.retries += 1

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
            raise VCError.from_exception(exc) from exc
        raise AssertionError("unreachable: tenacity raises the last error")

    def convert(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                seed: int | None = None, parameters: Mapping[str, Any] | None = None,
                encoded: bool = False, priority: int | None = None) -> VCResult:
        """Convert ``source`` into the voice of ``prompt``: paths, encoded bytes, or samples with ``*_sr``.
        ``encoded=True`` sends files as they are (the server decodes them) instead of decoding them here.
        ``priority``: the request's priority level (1 highest; None: the model's default)."""
        return self.infer_raw(self._inputs(source, prompt, source_sr, prompt_sr, seed, encoded),
                              parameters=parameters, priority=priority)

    def convert_many(self, pairs: Iterable[Pair], *, seed: int | None = None,
                     priority: int | None = None) -> list[VCResult | VCError]:
        """Many conversions in flight at once (up to ``concurrency``); results in order, a failed one as its
        :class:`VCError`. Each pair: ``(source, prompt)`` or a dict of :meth:`convert`'s arguments."""
        jobs = [_pair_args(p) for p in pairs]
        out: list[VCResult | VCError | None] = [None] * len(jobs)
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
                    out[i] = exc if isinstance(exc, VCError) else VCError(str(exc), "client")
                    continue
                inputs_of[i] = inputs
                pending[i] = (self._submit(inputs, job.get("parameters"), level), time.perf_counter())
            for i, (handle, t0) in pending.items():
                try:
                    res = handle.get_result() if self.protocol == "http" else handle.result()
                    if isinstance(res, Exception):
                        raise res
                    out[i] = _result(res, time.perf_counter() - t0)
                except Exception as exc:
                    out[i] = VCError.from_exception(exc)
                    if is_retryable(exc) and self.retry.attempts > 1:  # tried once: the rest of the policy, alone
                        self._counted(exc)
                        try:
                            out[i] = self.infer_raw(inputs_of[i], parameters=jobs[i].get("parameters"),
                                                    priority=jobs[i].get("priority", priority))
                        except VCError as again:
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
                   stats: StreamStats | None = None, priority: int | None = None) -> Iterator[StreamChunk]:
        """Chunks of a decoupled model as they arrive: over a gRPC stream, or over HTTP ``generate_stream``
        (``inputs`` built with :attr:`_stream_module`: :class:`JsonFields`). Closing the generator early (``break``)
        cancels the request (gRPC) or closes the connection (HTTP). An error raises :class:`VCError` with the
        server's message: before the first chunk with its status (HTTP 400, ``StatusCode.INVALID_ARGUMENT``...),
        mid-stream on HTTP with status ``"stream"`` (an SSE error event carries no code). ``priority``: gRPC only
        (:class:`PriorityError` over HTTP, raised here, before anything is sent)."""
        if self.protocol == "http":
            _no_stream_priority(model, priority)
            return self._http_stream(model, inputs, parameters, stats)
        return self._grpc_stream(model, inputs, parameters, stats, self.validate_priority(model, priority))

    def _http_stream(self, model, inputs, parameters, stats) -> Iterator[StreamChunk]:
        import requests

        body = JsonFields.body(inputs, parameters)
        stats = stats if stats is not None else StreamStats()
        if self._session is None:
            self._session = requests.Session()
        t0 = time.perf_counter()
        try:
            response = self._session.post(_stream_url(self.url, model), json=body, stream=True,
                                          timeout=(min(self.timeout, 60.0), self.timeout))
        except requests.RequestException as exc:
            raise VCError(f"{model}: {exc}", "connection") from exc
        with response:
            if response.status_code != 200:
                raise _http_refusal(model, response.status_code, response.content)
            reader = _SSEChunks(model, stats, t0)
            try:
                for data in response.iter_content(chunk_size=None):
                    yield from reader.feed(data)
                yield from reader.close()
            except requests.RequestException as exc:
                raise VCError(f"{model}: the stream broke off: {exc}", "connection") from exc

    def _grpc_stream(self, model, inputs, parameters, stats, priority: int = 0) -> Iterator[StreamChunk]:
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        done, stats = False, stats if stats is not None else StreamStats()
        t0 = time.perf_counter()
        try:
            self._client.async_stream_infer(model, list(inputs), parameters=parameters, priority=priority,
                                            enable_empty_final_response=True)
            index = 0
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout)
                except queue.Empty:
                    raise VCError(f"{model}: no streamed response within {self.timeout:g} s", "timeout") from None
                if error is not None:
                    done = True  # an error is the stream's last response
                    raise VCError.from_exception(error)
                final = _is_final(result)
                if result.as_numpy("waveform") is not None:
                    chunk = _chunk(result, t0, index)
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
                       stats: StreamStats | None = None, model: str = VC_STREAM_MODEL,
                       priority: int | None = None) -> Iterator[StreamChunk]:
        """Streaming voice conversion (gRPC or HTTP): chunks on the official schedule as the server sends them.
        The voice: ``prompt`` audio or a registered ``speaker_id``. ``stats`` gets the first-chunk latency.
        ``priority``: gRPC only (see :meth:`stream_raw`)."""
        return self.stream_raw(model, _vc_inputs(self._stream_module, source, prompt, source_sr, prompt_sr, seed,
                                                 speaker_id, encoded and self.protocol == "grpc"),
                               parameters=parameters, stats=stats, priority=priority)

    # -------------------------------------------------------------------------- text to speech

    def tts(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
            instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
            seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
            model: str = TTS_MODEL, priority: int | None = None) -> VCResult:
        """Text to speech, the whole answer (HTTP or gRPC). The voice: ``prompt`` (path, bytes, or samples with
        ``prompt_sr``) with an optional ``prompt_text``, or a registered ``speaker_id``."""
        inputs = _tts_inputs(self._module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode, seed,
                             encoded)
        return self.infer_raw(inputs, parameters=parameters, model=model, priority=priority)

    def tts_stream(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
                   instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
                   seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                   stats: StreamStats | None = None, model: str = TTS_STREAM_MODEL,
                   priority: int | None = None) -> Iterator[StreamChunk]:
        """Streaming text to speech (gRPC or HTTP): chunks as they arrive (see :meth:`tts` and
        :meth:`stream_raw`)."""
        inputs = _tts_inputs(self._stream_module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode,
                             seed, encoded and self.protocol == "grpc")
        return self.stream_raw(model, inputs, parameters=parameters, stats=stats, priority=priority)

    # ------------------------------------------------------------------- speech tokens, speaker embedding

    def speech_tokens(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                      parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                      model: str = SPEECH_TOKENS_MODEL) -> np.ndarray:
        """The 25 Hz CosyVoice speech tokens (int32 [T]) of ``audio_`` (a path, encoded bytes, or samples with
        ``sample_rate``; at most 30 s: the tokenizer's limit), from the ``speech_tokens`` model."""
        data, sr = _payload(audio_, sample_rate, "audio", encoded)
        res = self._infer(model, _audio_inputs(self._module, "source", data, sr), parameters, priority=priority)
        return _output(res, "speech_tokens", np.int32)

    def speaker_embedding(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                          parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                          model: str = SPEAKER_EMBEDDING_MODEL) -> np.ndarray:
        """The 192-dim CAM++ speaker embedding (float32 [192]) of ``audio_`` (as :meth:`speech_tokens`), from the
        ``speaker_embedding`` model (the audio gets a VC prompt's treatment)."""
        data, sr = _payload(audio_, sample_rate, "audio", encoded)
        res = self._infer(model, _audio_inputs(self._module, "prompt", data, sr), parameters, priority=priority)
        return _output(res, "speaker_embedding", np.float32)

    # ------------------------------------------------------------------------------- speakers

    def register_speaker(self, speaker_id: str, prompt, *, prompt_sr: int | None = None,
                         prompt_text: str | None = None, encoded: bool = False, priority: int | None = None):
        """Register (or replace) ``speaker_id`` from prompt audio (and its transcript); returns its
        :class:`~cosyvoice_triton.speakers.SpeakerPrompt` as the server computed it."""
        audio_, sr = _payload(prompt, prompt_sr, "prompt", encoded)
        res = self._infer(SPEAKERS_MODEL, build_speaker_inputs(self._module, "register", speaker_id, prompt=audio_,
                                                               prompt_sr=sr, prompt_text=prompt_text),
                          priority=priority)
        return _speaker_prompt(res)

    def get_speaker(self, speaker_id: str):
        return _speaker_prompt(self._infer(SPEAKERS_MODEL, build_speaker_inputs(self._module, "get", speaker_id)))

    def list_speakers(self) -> list[str]:
        return _ids(self._infer(SPEAKERS_MODEL, build_speaker_inputs(self._module, "list")))

    def delete_speaker(self, speaker_id: str) -> None:  # not retried: a lost answer would make it "not found"
        self._infer(SPEAKERS_MODEL, build_speaker_inputs(self._module, "delete", speaker_id), retry=False)


class AsyncVCClient:
    """asyncio client (``tritonclient.http.aio`` / ``tritonclient.grpc.aio``); one session reused. Priorities as
    :class:`VCClient`."""

    def __init__(self, url: str | None = None, *, protocol: str = "http", model: str = VC_MODEL,
                 timeout: float = 300.0, concurrency: int = 8, retry: RetryPolicy = DEFAULT_RETRY,
                 admin_key: str | None = None, check_priority: bool = True):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
        self.protocol, self.model, self.timeout = protocol, model, float(timeout)
        self.url = url or DEFAULT_URLS[protocol]
        self.concurrency = max(1, int(concurrency))
        self.retry, self.retries = retry, 0
        self.admin_key, self.check_priority = admin_key, bool(check_priority)
        self._levels: dict[str, int | None] = {}
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
        self._session = None  # aiohttp.ClientSession of the HTTP streams, made on the first one

    async def close(self) -> None:
        await self._client.close()
        if self._session is not None:
            await self._session.close()

    @property
    def _stream_module(self):
        return JsonFields if self.protocol == "http" else self._module

    async def __aenter__(self) -> AsyncVCClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def statistics(self, model: str = "") -> dict:
        if self.protocol == "http":
            return await self._client.get_inference_statistics(model, headers=admin_headers("http"))
        return await self._client.get_inference_statistics(model, headers=admin_headers("grpc"), as_json=True)

    async def _model_config(self, model: str) -> dict:
        headers = admin_headers(self.protocol, given_admin_key(self.admin_key))
        if self.protocol == "http":
            return _config_of(await self._client.get_model_config(model, headers=headers))
        return _config_of(await self._client.get_model_config(model, headers=headers, as_json=True))

    async def priority_levels(self, model: str | None = None) -> int | None:
        """See :meth:`VCClient.priority_levels`."""
        model = model or self.model
        if model not in self._levels:
            levels = None
            if given_admin_key(self.admin_key):
                try:
                    config = await self._model_config(model)
                    steps = [st["model_name"] for st in (config.get("ensemble_scheduling") or {}).get("step") or []]
                    known = {m: await self.priority_levels(m) for m in dict.fromkeys(steps)}
                    levels = config_priority_levels(config, known.__getitem__)
                except Exception as exc:
                    log.info("priority levels of %s unknown (%s: %s)", model, type(exc).__name__, exc)
            self._levels[model] = levels
        return self._levels[model]

    async def validate_priority(self, model: str, priority) -> int:
        """See :meth:`VCClient.validate_priority`."""
        value = _priority_value(priority)
        if value and self.check_priority:
            _check_levels(model, value, await self.priority_levels(model))
        return value

    async def convert(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                      seed: int | None = None, parameters: Mapping[str, Any] | None = None,
                      encoded: bool = False, priority: int | None = None) -> VCResult:
        src, s_sr = _payload(source, source_sr, "source", encoded)
        prm, p_sr = _payload(prompt, prompt_sr, "prompt", encoded)
        inputs = build_inputs(self._module, src, s_sr, prm, p_sr, seed)
        t0 = time.perf_counter()
        res = await self._infer(self.model, inputs, parameters, priority=priority)
        return _result(res, time.perf_counter() - t0)

    async def convert_many(self, pairs: Iterable[Pair], *, seed: int | None = None,
                           priority: int | None = None) -> list[VCResult | VCError]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(job):
            async with sem:
                try:
                    return await self.convert(**{"seed": seed, "priority": priority, **job})
                except VCError as exc:
                    return exc
                except Exception as exc:
                    return VCError(str(exc), "client")

        return list(await asyncio.gather(*(one(_pair_args(p)) for p in pairs)))

    def _counted(self, exc: BaseException | None) -> None:
        self.retries += 1

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
            raise VCError.from_exception(exc) from exc
        raise AssertionError("unreachable: tenacity raises the last error")

    async def stream_raw(self, model: str, inputs: Sequence, *, parameters: Mapping[str, Any] | None = None,
                         stats: StreamStats | None = None, priority: int | None = None) -> AsyncIterator[StreamChunk]:
        """Chunks of a decoupled model as they arrive (``tritonclient.grpc.aio`` stream, or HTTP
        ``generate_stream`` with ``aiohttp``); closing the generator early cancels the call (gRPC: the request on
        the server too) or closes the connection (HTTP). Errors and ``priority`` as :meth:`VCClient.stream_raw`
        (checked when the iteration starts)."""
        if self.protocol == "http":
            _no_stream_priority(model, priority)
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

        stats = stats if stats is not None else StreamStats()
        t0 = time.perf_counter()
        call = self._client.stream_infer(requests(), stream_timeout=self.timeout)
        done, index = False, 0
        try:
            async for result, error in call:
                if error is not None:
                    done = True
                    raise VCError.from_exception(error)
                if result.as_numpy("waveform") is not None:
                    chunk = _chunk(result, t0, index)
                    index += 1
                    stats.add(chunk)
                    yield chunk
                if _is_final(result):
                    break
            done = True
        finally:
            if not done:
                call.cancel()

    async def _http_stream(self, model, inputs, parameters, stats) -> AsyncIterator[StreamChunk]:
        import aiohttp

        body = JsonFields.body(inputs, parameters)
        stats = stats if stats is not None else StreamStats()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                sock_connect=min(self.timeout, 60.0), sock_read=self.timeout))
        t0 = time.perf_counter()
        try:
            async with self._session.post(_stream_url(self.url, model), json=body) as response:
                if response.status != 200:
                    raise _http_refusal(model, response.status, await response.read())
                reader = _SSEChunks(model, stats, t0)
                async for data in response.content.iter_any():
                    for chunk in reader.feed(data):
                        yield chunk
                for chunk in reader.close():
                    yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise VCError(f"{model}: {type(exc).__name__}: {exc}", "connection") from exc

    def convert_stream(self, source, prompt=None, *, speaker_id: str | None = None, source_sr: int | None = None,
                       prompt_sr: int | None = None, seed: int | None = None,
                       parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                       stats: StreamStats | None = None, model: str = VC_STREAM_MODEL,
                       priority: int | None = None) -> AsyncIterator[StreamChunk]:
        """``async for chunk in client.convert_stream(...)``: see :meth:`VCClient.convert_stream`."""
        if self.protocol == "http":
            _no_stream_priority(model, priority)
        return self.stream_raw(model, _vc_inputs(self._stream_module, source, prompt, source_sr, prompt_sr, seed,
                                                 speaker_id, encoded and self.protocol == "grpc"),
                               parameters=parameters, stats=stats, priority=priority)

    async def tts(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
                  instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
                  seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                  model: str = TTS_MODEL, priority: int | None = None) -> VCResult:
        inputs = _tts_inputs(self._module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode, seed,
                             encoded)
        t0 = time.perf_counter()
        res = await self._infer(model, inputs, parameters, priority=priority)
        return _result(res, time.perf_counter() - t0)

    def tts_stream(self, text: str, *, prompt=None, prompt_sr: int | None = None, prompt_text: str | None = None,
                   instruct: str | None = None, speaker_id: str | None = None, mode: str | None = None,
                   seed: int | None = None, parameters: Mapping[str, Any] | None = None, encoded: bool = False,
                   stats: StreamStats | None = None, model: str = TTS_STREAM_MODEL,
                   priority: int | None = None) -> AsyncIterator[StreamChunk]:
        if self.protocol == "http":
            _no_stream_priority(model, priority)
        inputs = _tts_inputs(self._stream_module, text, prompt, prompt_sr, prompt_text, instruct, speaker_id, mode,
                             seed, encoded and self.protocol == "grpc")
        return self.stream_raw(model, inputs, parameters=parameters, stats=stats, priority=priority)

    async def speech_tokens(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                            parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                            model: str = SPEECH_TOKENS_MODEL) -> np.ndarray:
        """See :meth:`VCClient.speech_tokens`."""
        data, sr = _payload(audio_, sample_rate, "audio", encoded)
        res = await self._infer(model, _audio_inputs(self._module, "source", data, sr), parameters,
                                priority=priority)
        return _output(res, "speech_tokens", np.int32)

    async def speaker_embedding(self, audio_, *, sample_rate: int | None = None, encoded: bool = False,
                                parameters: Mapping[str, Any] | None = None, priority: int | None = None,
                                model: str = SPEAKER_EMBEDDING_MODEL) -> np.ndarray:
        """See :meth:`VCClient.speaker_embedding`."""
        data, sr = _payload(audio_, sample_rate, "audio", encoded)
        res = await self._infer(model, _audio_inputs(self._module, "prompt", data, sr), parameters,
                                priority=priority)
        return _output(res, "speaker_embedding", np.float32)

    async def register_speaker(self, speaker_id: str, prompt, *, prompt_sr: int | None = None,
                               prompt_text: str | None = None, encoded: bool = False, priority: int | None = None):
        audio_, sr = _payload(prompt, prompt_sr, "prompt", encoded)
        return _speaker_prompt(await self._infer(SPEAKERS_MODEL, build_speaker_inputs(
            self._module, "register", speaker_id, prompt=audio_, prompt_sr=sr, prompt_text=prompt_text),
            priority=priority))

    async def get_speaker(self, speaker_id: str):
        return _speaker_prompt(await self._infer(SPEAKERS_MODEL, build_speaker_inputs(self._module, "get",
                                                                                      speaker_id)))

    async def list_speakers(self) -> list[str]:
        return _ids(await self._infer(SPEAKERS_MODEL, build_speaker_inputs(self._module, "list")))

    async def delete_speaker(self, speaker_id: str) -> None:
        await self._infer(SPEAKERS_MODEL, build_speaker_inputs(self._module, "delete", speaker_id), retry=False)


#: One client class serves VC, TTS and speakers; these names read better in TTS code.
TTSClient = VCClient
AsyncTTSClient = AsyncVCClient
