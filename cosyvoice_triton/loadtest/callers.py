"""One request per call, for each column and protocol; what the Locust users (and the runner's warm-up) call:
a voice conversion (plain or integrated), or one of the TTS column's requests (streaming TTS, offline TTS,
streaming VC). Nothing here imports Locust or gevent: under Locust, gRPC needs
``grpc.experimental.gevent.init_gevent()`` before the first channel, which the locustfile does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from . import COLUMNS, PROTOCOLS, TTS_COLUMNS
from .workload import Item

__all__ = ["Converter", "IntegratedConverter", "Outcome", "PlainConverter", "StreamConverter", "TTSConverter",
           "make_converter", "outcome"]


@dataclass(frozen=True)
class Outcome:
    """What one request produced: seconds of audio, and for a stream when its first chunk arrived (seconds after
    the request was sent) and how many audio chunks came."""

    audio_s: float
    first_chunk_s: float | None = None
    chunks: int = 1


def outcome(x: float | Outcome) -> Outcome:
    return x if isinstance(x, Outcome) else Outcome(float(x))


class Converter(Protocol):
    def convert(self, item: Item, seed: int = 0) -> float | Outcome:
        """Run ``item``; return the seconds of audio produced, or an :class:`Outcome` (raises on failure)."""

    def close(self) -> None: ...


class IntegratedConverter:
    """One request to the ``cosyvoice_vc`` ensemble (:class:`cosyvoice_triton.clients.client.CosyVoiceClient`)."""

    def __init__(self, url: str, protocol: str = "http", *, timeout: float = 600.0, model_dir: str = ""):
        from ..clients.client import CosyVoiceClient

        self.client = CosyVoiceClient(url, protocol=protocol, timeout=timeout, concurrency=1, **_no_retry())

    def convert(self, item: Item, seed: int = 0) -> float:
        result = self.client.convert(item.source, item.prompt, source_sr=item.source_sr, prompt_sr=item.prompt_sr,
                                     seed=seed)
        return result.seconds

    def close(self) -> None:
        self.client.close()


class PlainConverter:
    """Client-side preprocessing and one network call per stage (:class:`~.clients.plain.PlainPipeline`)."""

    def __init__(self, url: str, protocol: str = "http", *, timeout: float = 600.0, model_dir: str = ""):
        from ..clients.plain import PlainPipeline

        self.pipeline = PlainPipeline(url, protocol=protocol, timeout_s=timeout, model_dir=model_dir or None)

    def convert(self, item: Item, seed: int = 0) -> float:
        wave, sr = self.pipeline.convert(item.source, item.source_sr, item.prompt, item.prompt_sr, seed=seed)
        return len(wave) / sr

    def close(self) -> None:
        self.pipeline.close()


class StreamConverter:
    """One gRPC stream: ``tts_stream`` (``cosyvoice_tts_stream``: the item's text, zero-shot in the prompt's voice)
    or ``vc_stream`` (``cosyvoice_vc_stream``: the item's source in the prompt's voice), consumed to the end; the
    first-chunk latency and the chunk count come from :class:`~cosyvoice_triton.clients.client.StreamStats`."""

    def __init__(self, url: str, protocol: str = "grpc", *, column: str = "tts_stream", timeout: float = 600.0,
                 model_dir: str = ""):
        from ..clients.client import CosyVoiceClient

        if protocol != "grpc":
            raise ValueError(f"{column}: streaming is measured over gRPC, got {protocol!r}")
        self.column = column
        self.client = CosyVoiceClient(url, protocol="grpc", timeout=timeout, concurrency=1, **_no_retry())

    def convert(self, item: Item, seed: int = 0) -> Outcome:
        from ..clients.client import StreamStats

        stats = StreamStats()
        if self.column == "tts_stream":
            chunks = self.client.tts_stream(item.text, prompt=item.prompt, prompt_sr=item.prompt_sr,
                                            prompt_text=item.prompt_text or None, seed=seed, stats=stats)
        else:
            chunks = self.client.convert_stream(item.source, item.prompt, source_sr=item.source_sr,
                                                prompt_sr=item.prompt_sr, seed=seed, stats=stats)
        for _ in chunks:
            pass
        if not stats.chunks or not stats.sample_rate:
            raise RuntimeError(f"{self.column}: the stream ended without audio")
        return Outcome(stats.samples / stats.sample_rate, float(stats.first_chunk_s), stats.chunks)

    def close(self) -> None:
        self.client.close()


class TTSConverter:
    """Offline text to speech: one request to ``cosyvoice_tts``, the whole answer at once (HTTP or gRPC)."""

    def __init__(self, url: str, protocol: str = "grpc", *, timeout: float = 600.0, model_dir: str = ""):
        from ..clients.client import CosyVoiceClient

        self.client = CosyVoiceClient(url, protocol=protocol, timeout=timeout, concurrency=1, **_no_retry())

    def convert(self, item: Item, seed: int = 0) -> Outcome:
        result = self.client.tts(item.text, prompt=item.prompt, prompt_sr=item.prompt_sr,
                                 prompt_text=item.prompt_text or None, seed=seed)
        return Outcome(result.seconds, None, 1)

    def close(self) -> None:
        self.client.close()


def _no_retry() -> dict:
    """A load test counts every request the server answers: the client must not retry on its own (where the
    client has a retry policy)."""
    import inspect

    from ..clients import client as mod

    if "retry" not in inspect.signature(mod.VCClient).parameters:
        return {}
    from ..clients.retry import NO_RETRY

    return {"retry": NO_RETRY}


def make_converter(column: str, protocol: str, url: str, *, timeout: float = 600.0, model_dir: str = "") -> Converter:
    """The converter of ``column`` over ``protocol``; ``model_dir``: the served model's folder (the plain client's
    front end reads its mel settings)."""
    if column not in (*COLUMNS, *TTS_COLUMNS):
        raise ValueError(f"column must be one of {COLUMNS + TTS_COLUMNS}, got {column!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if column in ("tts_stream", "vc_stream"):
        return StreamConverter(url, protocol, column=column, timeout=timeout, model_dir=model_dir)
    if column == "tts":
        return TTSConverter(url, protocol, timeout=timeout, model_dir=model_dir)
    cls = IntegratedConverter if column == "integrated" else PlainConverter
    return cls(url, protocol, timeout=timeout, model_dir=model_dir)
