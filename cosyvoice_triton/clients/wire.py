"""What the sync and the asyncio clients share: request inputs (:func:`build_inputs`, :func:`build_tts_inputs`,
:func:`build_speaker_inputs`, :class:`JsonFields` for HTTP streams), results (:class:`VCResult`) and stream chunks
(:class:`StreamChunk`, :class:`StreamStats`, the SSE reader), errors (:class:`VCError`, :class:`PriorityError`),
the priority check against a model's config, the connection and the settings both clients hold."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..admin import admin_headers, given_admin_key
from ..errors import AudioError
from ..frontend import audio
from ..shapes import CV3_SPEAKERS_MODEL
from .retry import RetryPolicy

log = logging.getLogger(__name__)

VC_STREAM_MODEL = "cosyvoice_vc_stream"
SPEAKERS_MODEL = "speakers"
#: The speakers model of each model family (CosyVoice3's: rendered with the tunable cosyvoice3_dir)
SPEAKERS_MODELS = {"cosyvoice2": SPEAKERS_MODEL, "cosyvoice3": CV3_SPEAKERS_MODEL}

__all__ = ["DEFAULT_URLS", "PROTOCOLS", "SPEAKERS_MODEL", "SPEAKERS_MODELS", "VC_STREAM_MODEL", "JsonFields", "Pair",
           "PriorityError", "StreamChunk", "StreamStats", "VCError", "VCResult", "build_inputs", "build_speaker_inputs",
           "build_tts_inputs", "config_priority_levels", "connect", "inference_statistics", "load_input",
           "speakers_model"]

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
                     speaker_id: str | None = None, mode: str | None = None, seed: int | None = None,
                     speed: float | None = None) -> list:
    """The ``cosyvoice_tts`` / ``cosyvoice_tts_stream`` input tensors (:data:`~cosyvoice_triton.shapes.TTS_INPUTS`;
    ``speed``: non-streaming answers only)."""
    inputs = [_text(module, "text", text)]
    if prompt is not None:
        inputs += _audio_inputs(module, "prompt", prompt, prompt_sr)
    for name, value in (("prompt_text", prompt_text), ("instruct_text", instruct), ("speaker_id", speaker_id),
                        ("mode", mode)):
        if value is not None:
            inputs.append(_text(module, name, value))
    if seed is not None:
        inputs.append(_tensor(module, "seed", np.array([[int(seed)]], np.int64), "INT64"))
    if speed is not None and speed != 1.0:
        inputs.append(_tensor(module, "speed", np.array([[speed]], np.float32), "FP32"))
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


def speakers_model(family: str) -> str:
    """The speakers model of ``family`` (:data:`SPEAKERS_MODELS`); ValueError for another name."""
    if family not in SPEAKERS_MODELS:
        raise ValueError(f"family must be one of {', '.join(SPEAKERS_MODELS)}, got {family!r}")
    return SPEAKERS_MODELS[family]


def _speaker_prompt(result, family: str = "cosyvoice2"):
    from ..speakers import SpeakerPrompt

    text = result.as_numpy("prompt_text")
    return SpeakerPrompt(prompt_tokens=result.as_numpy("prompt_tokens")[0].astype(np.int32),
                         prompt_mel=result.as_numpy("prompt_mel")[0].astype(np.float32),
                         embedding=result.as_numpy("embedding")[0].astype(np.float32),
                         prompt_text_tokens=result.as_numpy("prompt_text_tokens")[0].astype(np.int32),
                         prompt_text=bytes(text.reshape(-1)[0]).decode("utf-8") if text is not None else "",
                         family=family)


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



class _ClientBase:
    """What both clients hold: the server, protocol and model, timeouts, concurrency, the retry policy and
    retries made, the admin key and the priority levels read with it."""

    def __init__(self, url: str | None, protocol: str, model: str, timeout: float, concurrency: int,
                 retry: RetryPolicy, admin_key: str | None, check_priority: bool):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
        self.protocol, self.model, self.timeout = protocol, model, float(timeout)
        self.url = url or DEFAULT_URLS[protocol]
        self.concurrency = max(1, int(concurrency))
        self.retry, self.retries = retry, 0
        self.admin_key, self.check_priority = admin_key, bool(check_priority)
        self._levels: dict[str, int | None] = {}  # model -> priority levels of its config (None: unreadable)
        self._session = None  # the HTTP streams' session (requests / aiohttp), made on the first one

    @property
    def _stream_module(self):
        """What stream inputs are built with: ``tritonclient.grpc``, or :class:`JsonFields` for HTTP."""
        return JsonFields if self.protocol == "http" else self._module

    def _config_headers(self) -> dict[str, str]:
        """The admin header of the config API (the key given, else ``$COSYVOICE_TRITON_ADMIN_KEY``)."""
        return admin_headers(self.protocol, given_admin_key(self.admin_key))

    def _counted(self, exc: BaseException | None) -> None:
        self.retries += 1
