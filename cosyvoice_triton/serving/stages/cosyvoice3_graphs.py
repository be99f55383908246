"""CosyVoice3's DiT estimator and vocoder generator as served graphs: every CosyVoice3 request's Euler steps and
vocoder calls batched together.

A served CosyVoice3 model runs its folder in process, ``concurrency`` requests at a time per instance
(:mod:`.cosyvoice3`). With tunable ``cosyvoice3_onnx_dir`` the render also serves the exported estimator graphs
(``flow3_estimator`` and ``flow3_estimator_streaming`` of :data:`~cosyvoice_triton.shapes.GRAPHS3`, made by
``export-onnx`` on the CosyVoice3 folder) behind Triton's dynamic batcher, and each instance's flow calls them by BLS
(:class:`GraphEstimator` as the flow's ``estimator_fn``): the requests' Euler steps that arrive together are padded
into one onnxruntime call (:class:`~.graphs.GraphRunner`, policy ``pad``: the DiT masks padding, so each request
gets what it gets alone).

A step whose rows or frames lie outside the graph's range (an utterance and its prompt longer than 3000 mel
frames, 60 s) runs on the instance's own DiT instead, counted in :attr:`GraphEstimator.local_steps`.

The vocoder's generator (``hift3_decoder``: mel and source to waveform, the bulk of the vocoder's work) is served the
same way (:class:`GraphDecoder` as the vocoder's ``decode_fn``), its calls batched with other requests' of the same
length (policy ``group``: the generator's tail sees padding through its look-ahead). The F0 predictor and the sine
source stay in the instance, in float64 as officially: the exported ``hift3_source`` runs the predictor in float32,
whose rounding the source's phase accumulation turns into ~1e-3 of the waveform, for a small part of the work. A
call longer than the graph's 1500 frames (30 s) runs on the instance's generator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from ...errors import CosyVoiceError
from ...shapes import GRAPHS3
from .flow import GraphFn

__all__ = ["ESTIMATOR_GRAPHS", "VOCODER_GRAPH", "GraphDecoder", "GraphEstimator", "bls_decoder", "bls_estimator"]

#: The served estimator graphs: (full attention, chunk-causal attention), as the flow's ``streaming`` picks.
ESTIMATOR_GRAPHS = ("flow3_estimator", "flow3_estimator_streaming")
#: The served vocoder graph: the generator (the F0 predictor and source run in the instance).
VOCODER_GRAPH = "hift3_decoder"


class _Range:
    """The rows and frames a served graph takes (its spec's ``batch`` axis and ``frames`` axis)."""

    def __init__(self, graph: str, frames: str):
        axes = GRAPHS3[graph].axes
        self.rows, self.frames = axes["batch"], axes[frames]

    def __contains__(self, shape: tuple[int, int]) -> bool:
        rows, frames = shape
        return self.rows.min <= rows <= self.rows.max and self.frames.min <= frames <= self.frames.max


def _feeds(tensors: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(v.detach().to("cpu", torch.float32).numpy()) for k, v in tensors.items()}


def _tensor(out: np.ndarray, like: Tensor) -> Tensor:
    return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(like.device, like.dtype)


class GraphEstimator:
    """An ``estimator_fn`` of the CosyVoice3 flow (:data:`~cosyvoice_triton.models.cfm.EstimatorFn`) that calls
    ``full`` or ``streaming`` (``fn(feeds) -> outputs``, numpy, :data:`GRAPHS3`'s names) as the step's attention
    asks, and ``local`` (the flow's own DiT) for a step outside the graph's range."""

    def __init__(self, full: GraphFn, streaming: GraphFn, local: Callable[..., Tensor]):
        self.full, self.streaming, self.local = full, streaming, local
        self.graph_steps = 0
        self.local_steps = 0
        self._range = _Range(ESTIMATOR_GRAPHS[0], "seq_len")

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool | Tensor = False) -> Tensor:
        if isinstance(streaming, Tensor):
            flags = set(streaming.reshape(-1).tolist())
            if len(flags) != 1:
                raise CosyVoiceError("the estimator graph takes one attention variant per call; rows mixed "
                                     "streaming and full attention")
            streaming = flags.pop()
        rows = x.shape[0]
        if (rows, x.shape[-1]) not in self._range:
            self.local_steps += 1
            return self.local(x, mask, mu, t, spks, cond, streaming)
        feeds = _feeds({"x": x, "mask": mask, "mu": mu, "t": t.reshape(-1).expand(rows), "spks": spks, "cond": cond})
        out = (self.streaming if streaming else self.full)(feeds)["estimator_out"]
        self.graph_steps += 1
        return _tensor(out, x)


def bls_estimator(pb, p: Mapping, flow) -> GraphEstimator | None:
    """The :class:`GraphEstimator` of a served CosyVoice3 model's parameters (``estimator_models``: the two graph
    models, comma separated; empty: None, the DiT in process), calling them by BLS with ``pb`` (the Python
    backend's utils); ``flow``: the loaded CosyVoice3 flow (its DiT for the steps outside the graph's range)."""
    from .triton_io import BlsGraph

    names = [n.strip() for n in str(p.get("estimator_models", "")).split(",") if n.strip()]
    if not names:
        return None
    if len(names) != 2:
        raise CosyVoiceError(f"estimator_models: expected the two estimator models (full,streaming), got {names}")
    timeout = p.get("bls_timeout_us", 0)
    full, streaming = (BlsGraph(pb, model, graph, timeout_us=timeout) for model, graph in zip(names, ESTIMATOR_GRAPHS,
                                                                                               strict=True))
    return GraphEstimator(full, streaming, flow.decoder.estimator)


class GraphDecoder:
    """A ``decode_fn`` of the CosyVoice3 vocoder (``decode_fn(mel, source) -> speech``, the ``finalize=True``
    decode) that calls ``fn`` (``fn(feeds) -> outputs``, numpy, :data:`GRAPHS3`'s ``hift3_decoder``) and ``local``
    (the vocoder's own generator, its ``generate``) for a call outside the graph's range."""

    def __init__(self, fn: GraphFn, local: Callable[..., Tensor]):
        self.fn, self.local = fn, local
        self.graph_calls = 0
        self.local_calls = 0
        self._range = _Range(VOCODER_GRAPH, "mel_frames")

    def __call__(self, mel: Tensor, source: Tensor) -> Tensor:
        if (mel.shape[0], mel.shape[-1]) not in self._range:
            self.local_calls += 1
            return self.local(mel, source)
        out = self.fn(_feeds({"mel": mel, "source": source}))["waveform"]
        self.graph_calls += 1
        return _tensor(out, mel)


def bls_decoder(pb, p: Mapping, hift) -> GraphDecoder | None:
    """The :class:`GraphDecoder` of a served CosyVoice3 model's parameters (``vocoder_model``: the served
    ``hift3_decoder``; empty: None, the generator in process), calling it by BLS with ``pb``; ``hift``: the loaded
    vocoder (its generator for the calls outside the graph's range)."""
    from .triton_io import BlsGraph

    model = str(p.get("vocoder_model", "")).strip()
    if not model:
        return None
    return GraphDecoder(BlsGraph(pb, model, VOCODER_GRAPH, timeout_us=p.get("bls_timeout_us", 0)), hift.generate)
