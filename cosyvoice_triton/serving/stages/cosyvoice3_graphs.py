"""CosyVoice3's DiT estimator as a served graph: the Euler steps of every CosyVoice3 request batched together.

A served CosyVoice3 model runs its folder in process, ``concurrency`` requests at a time per instance
(:mod:`.cosyvoice3`). With tunable ``cosyvoice3_onnx_dir`` the render also serves the exported estimator graphs
(``flow3_estimator`` and ``flow3_estimator_streaming`` of :data:`~cosyvoice_triton.shapes.GRAPHS3`, made by
``export-onnx`` on the CosyVoice3 folder) behind Triton's dynamic batcher, and each instance's flow calls them by BLS
(:class:`GraphEstimator` as the flow's ``estimator_fn``): the requests' Euler steps that arrive together are padded
into one onnxruntime call (:class:`~.graphs.GraphRunner`, policy ``pad``: the DiT masks padding, so each request
gets what it gets alone).

A step whose rows or frames lie outside the graph's range (an utterance and its prompt longer than 3000 mel
frames, 60 s) runs on the instance's own DiT instead, counted in :attr:`GraphEstimator.local_steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from ...errors import CosyVoiceError
from ...shapes import GRAPHS3
from .flow import GraphFn

__all__ = ["ESTIMATOR_GRAPHS", "GraphEstimator", "bls_estimator"]

#: The served estimator graphs: (full attention, chunk-causal attention), as the flow's ``streaming`` picks.
ESTIMATOR_GRAPHS = ("flow3_estimator", "flow3_estimator_streaming")
_SPEC = GRAPHS3[ESTIMATOR_GRAPHS[0]]


class GraphEstimator:
    """An ``estimator_fn`` of the CosyVoice3 flow (:data:`~cosyvoice_triton.models.cfm.EstimatorFn`) that calls
    ``full`` or ``streaming`` (``fn(feeds) -> outputs``, numpy, :data:`GRAPHS3`'s names) as the step's attention
    asks, and ``local`` (the flow's own DiT) for a step outside the graph's range."""

    def __init__(self, full: GraphFn, streaming: GraphFn, local: Callable[..., Tensor]):
        self.full, self.streaming, self.local = full, streaming, local
        self.graph_steps = 0
        self.local_steps = 0
        self._rows, self._frames = _SPEC.axes["batch"], _SPEC.axes["seq_len"]

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool | Tensor = False) -> Tensor:
        if isinstance(streaming, Tensor):
            flags = set(streaming.reshape(-1).tolist())
            if len(flags) != 1:
                raise CosyVoiceError("the estimator graph takes one attention variant per call; rows mixed "
                                     "streaming and full attention")
            streaming = flags.pop()
        rows, frames = x.shape[0], x.shape[-1]
        if not (self._rows.min <= rows <= self._rows.max and self._frames.min <= frames <= self._frames.max):
            self.local_steps += 1
            return self.local(x, mask, mu, t, spks, cond, streaming)
        feeds = {"x": x, "mask": mask, "mu": mu, "t": t.reshape(-1).expand(rows), "spks": spks, "cond": cond}
        feeds = {k: np.ascontiguousarray(v.detach().to("cpu", torch.float32).numpy()) for k, v in feeds.items()}
        out = (self.streaming if streaming else self.full)(feeds)["estimator_out"]
        self.graph_steps += 1
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(x.device, x.dtype)


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
