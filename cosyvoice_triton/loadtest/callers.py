"""One voice conversion per call, for each column and protocol; what the Locust users (and the runner's warm-up)
call. Nothing here imports Locust or gevent: under Locust, gRPC needs ``grpc.experimental.gevent.init_gevent()``
before the first channel, which the locustfile does.
"""

from __future__ import annotations

from typing import Protocol

from . import COLUMNS, PROTOCOLS
from .workload import Item

__all__ = ["Converter", "IntegratedConverter", "PlainConverter", "make_converter"]


class Converter(Protocol):
    def convert(self, item: Item, seed: int = 0) -> float:
        """Convert ``item``; return the seconds of audio produced (raises on failure)."""

    def close(self) -> None: ...


class IntegratedConverter:
    """One request to the ``cosyvoice_vc`` ensemble (:class:`cosyvoice_triton.clients.client.VCClient`)."""

    def __init__(self, url: str, protocol: str = "http", *, timeout: float = 600.0, model_dir: str = ""):
        from ..clients.client import VCClient

        self.client = VCClient(url, protocol=protocol, timeout=timeout, concurrency=1)

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


def make_converter(column: str, protocol: str, url: str, *, timeout: float = 600.0, model_dir: str = "") -> Converter:
    """The converter of ``column`` over ``protocol``; ``model_dir``: the served model's folder (the plain client's
    front end reads its mel settings)."""
    if column not in COLUMNS:
        raise ValueError(f"column must be one of {COLUMNS}, got {column!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    cls = IntegratedConverter if column == "integrated" else PlainConverter
    return cls(url, protocol, timeout=timeout, model_dir=model_dir)
