"""Each stream's flow state, kept by the stage that owns the stream: a non-final chunk computes only its new frames.

Without it every streamed chunk runs the flow graphs over the prompt and every token so far, at each Euler step,
and keeps only the new frames (the official loop). :class:`IncrementalFlow` loads the checkpoint's PyTorch flow in
the streaming stage and gives each stream a :class:`StreamFlow`: the keys/values of every attention layer per Euler
step and CFG row, the causal convs' tails and the settled mel (:mod:`~cosyvoice_triton.models.incremental`, the
library's own code, so the served chunks are the library's). The final chunk has full attention (no cached value
holds there): it runs the graphs, as does every chunk of a stream that left its state (a cap reached).

**Why a store in the stage, not Triton's sequence batcher.** The stream already lives in one place: the decoupled
model that runs its chunk loop in a worker thread (``cosyvoice_vc_stream``, ``cosyvoice_tts_stream``,
``cosyvoice_tts_live``). Implicit state would move the caches through the graphs as past/present tensors: about
1,100 of them at full dims (10 steps x 2 rows x 56 blocks x K and V, plus the encoder's), with a dynamic length,
copied in and out of the backend at every call, and Triton's implicit state is not offered to Python-backend models
at all. Here the state is a Python object beside the loop that uses it, freed with it.

**Bounds.** ``max_stream_bytes`` caps one stream (:func:`~cosyvoice_triton.models.incremental.cache_bytes_per_frame`:
about 4.6 MB per settled mel frame at CosyVoice2-0.5B dims, 40 KB on the tiny demo model); ``budget`` caps all the
streams of the instance. A chunk that would pass either cap runs the graphs and the stream drops its state for good
(it continues, recomputing: never refused for it). The state goes when the stream ends, is cancelled, fails or its
client goes away (the chunk loop's ``finally``), and with the process on a stub restart. A registered speaker's
settled prompt frames are computed once and shared (:class:`~cosyvoice_triton.speaker_state.SpeakerState`); a
stream's bytes count its share of them too (the budget is conservative).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...models.incremental import FlowStreamState, cache_bytes_per_frame, incremental_chunk, window_chunk

log = logging.getLogger(__name__)

__all__ = ["IncrementalFlow", "StateBudget", "StateGauge", "StreamFlow", "build_incremental"]

MB = 1 << 20


class StateBudget:
    """Bytes of stream state held by one model instance, at most ``max_bytes`` (thread-safe).

    ``on_change(streams, nbytes)`` is told of every change, in order, under the budget's lock (a gauge; it must not
    call back into the budget)."""

    def __init__(self, max_bytes: int, on_change: Callable[[int, int], Any] | None = None):
        if int(max_bytes) < 0:
            raise ValueError(f"StateBudget needs max_bytes >= 0, got {max_bytes}")
        self.max_bytes, self.on_change = int(max_bytes), on_change
        self.lock = threading.Lock()
        self.held: dict[int, int] = {}  # stream id -> bytes
        self.peak = 0
        self.refused = 0

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(self.held.values())

    @property
    def streams(self) -> int:
        with self.lock:
            return len(self.held)

    def resize(self, key: int, nbytes: int) -> bool:
        """Let stream ``key`` hold ``nbytes`` (in place of what it held); False (and nothing changes) when that
        would pass the cap."""
        with self.lock:
            total = sum(self.held.values()) - self.held.get(key, 0) + int(nbytes)
            if total > self.max_bytes:
                self.refused += 1
                return False
            self.held[key] = int(nbytes)
            self.peak = max(self.peak, total)
            self._tell(len(self.held), total)  # under the lock: the gauge sees the changes in their order
        return True

    def flow3_states(self, max_stream_bytes: int) -> Callable[[], Any]:
        """A maker of CosyVoice3 stream states (:class:`~cosyvoice_triton.models.cosyvoice3.incremental.
        Flow3StreamState`), each at most ``max_stream_bytes`` and counted here under a key of its own
        (``CosyVoice3.stream_state``)."""
        from ...models.cosyvoice3.incremental import Flow3StreamState

        keys = itertools.count()

        def make() -> Flow3StreamState:
            key = -1 - next(keys)  # apart from IncrementalFlow's keys (>= 0), should both share a budget
            return Flow3StreamState(max_stream_bytes, reserve=lambda n: self.resize(key, n),
                                    release=lambda: self.release(key))

        return make

    def release(self, key: int) -> None:
        with self.lock:
            if self.held.pop(key, None) is None:
                return
            self._tell(len(self.held), sum(self.held.values()))

    def _tell(self, streams: int, nbytes: int) -> None:
        if self.on_change is not None:
            try:
                self.on_change(streams, nbytes)
            except Exception as exc:  # a gauge must never fail a stream
                log.warning("stream state: the gauge failed: %s", exc)


class StateGauge:
    """``cosyvoice_stream_states{model, version}`` and ``cosyvoice_stream_state_bytes{model, version}``: the streams
    holding flow state in a model instance and their bytes (Triton gauges; a :class:`StateBudget`'s ``on_change``)."""

    def __init__(self, pb, model: str, version: str | int):
        labels = {"model": model, "version": str(version)}
        self.families = (
            pb.MetricFamily(name="cosyvoice_stream_states", description="streams holding incremental flow state "
                            "(freed when a stream ends, is cancelled or fails)", kind=pb.MetricFamily.GAUGE),
            pb.MetricFamily(name="cosyvoice_stream_state_bytes", description="bytes of incremental flow state held "
                            "by the streams", kind=pb.MetricFamily.GAUGE))
        self.streams, self.bytes = (f.Metric(labels=labels) for f in self.families)

    def __call__(self, streams: int, nbytes: int) -> None:
        from .metrics import METRIC_LOCK

        with METRIC_LOCK:
            self.streams.set(float(streams))
            self.bytes.set(float(nbytes))


class IncrementalFlow:
    """The PyTorch flow of a streaming stage and the bounds of its streams' states (see the module docstring).

    ``flow``: a loaded :class:`~cosyvoice_triton.models.flow.CausalMaskedDiffWithXvec`; ``speaker_state``: a
    :class:`~cosyvoice_triton.speaker_state.SpeakerState` for registered speakers' prompt frames (None: each stream
    computes them)."""

    def __init__(self, flow, *, max_stream_bytes: int, budget: StateBudget, speaker_state=None,
                 device: str = "cpu"):
        self.flow, self.budget, self.speaker_state = flow, budget, speaker_state
        self.max_stream_bytes, self.device = int(max_stream_bytes), torch.device(device)
        self.bytes_per_frame = cache_bytes_per_frame(flow.config)
        self.ratio, self.lookahead = flow.token_mel_ratio, flow.pre_lookahead_len
        self._ids = iter(range(1 << 62))
        self._id_lock = threading.Lock()

    def open(self, prompt, *, registered: bool = False, window_tokens: int | None = None) -> StreamFlow:
        """The state of a new stream with ``prompt`` (``prompt_tokens`` [Tp], ``prompt_mel`` [Tf, 80],
        ``embedding`` [192]); ``registered``: a registered speaker's, whose settled prompt frames are shared;
        ``window_tokens``: live conversion's flow window (:func:`~cosyvoice_triton.models.incremental.window_chunk`:
        the state forgets frames before it; None: the official schedule, every frame kept)."""
        with self._id_lock:
            key = next(self._ids)
        return StreamFlow(self, key, prompt, registered=registered, window_tokens=window_tokens)

    def tensors(self, prompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = self.device
        return (torch.as_tensor(np.asarray(prompt.prompt_tokens), dtype=torch.int32, device=dev)[None],
                torch.as_tensor(np.asarray(prompt.prompt_mel), dtype=torch.float32, device=dev)[None],
                torch.as_tensor(np.asarray(prompt.embedding), dtype=torch.float32, device=dev)[None])


class StreamFlow:
    """One stream's flow state: :meth:`chunk` per non-final chunk, :meth:`close` when the stream stops."""

    def __init__(self, owner: IncrementalFlow, key: int, prompt, *, registered: bool,
                 window_tokens: int | None = None):
        self.owner, self.key, self.prompt = owner, key, prompt
        self.window_tokens = window_tokens
        self.prompt_t = owner.tensors(prompt)
        self.n_prompt = int(self.prompt_t[0].shape[1])
        self.registered = registered
        self.state: FlowStreamState | None = None  # made at the first chunk (a registered speaker's: a copy)
        self.closed = False
        self.chunks = 0

    def _start(self) -> FlowStreamState:
        o = self.owner
        if self.registered and o.speaker_state is not None and self.window_tokens is None:
            with torch.inference_mode():
                state = o.speaker_state.flow_state(o.flow, self.prompt, self.prompt_t,
                                                   max_cache_bytes=o.max_stream_bytes)
            if state is not None:
                return state
        return FlowStreamState(o.max_stream_bytes)

    def chunk(self, tokens: np.ndarray) -> np.ndarray | None:
        """The mel ``[80, T]`` after the prompt of a non-final chunk, from the state; None when the chunk must run
        the graphs (a cap, an unaligned live chunk, or closed): the state is then dropped for good.

        ``tokens``: every source token so far and the look-ahead ones (the mel covers them all); with
        ``window_tokens``, the chunk's new source tokens and the look-ahead ones (the mel covers the new ones)."""
        if self.closed:
            return None
        o = self.owner
        if self.state is None:
            self.state = self._start()
        settled = (self.n_prompt + len(tokens) - o.lookahead if self.window_tokens is None else
                   max(self.state.tokens, self.n_prompt) + len(tokens) - o.lookahead)
        need = int(self.state.nbytes() + max(0, settled - self.state.tokens) * o.ratio * o.bytes_per_frame)
        if need > o.max_stream_bytes:
            log.info("stream state: a stream reached its cap (%d MiB); it recomputes from here",
                     o.max_stream_bytes // MB)
            self.close()
            return None
        if not o.budget.resize(self.key, need):
            log.info("stream state: the instance's budget (%d MiB) is full; this stream recomputes from here",
                     o.budget.max_bytes // MB)
            self.close()
            return None
        token = torch.as_tensor(np.asarray(tokens), dtype=torch.int32, device=o.device)[None]
        with torch.inference_mode():
            if self.window_tokens is None:
                mel = incremental_chunk(o.flow, self.state, token, *self.prompt_t)
            else:
                mel = window_chunk(o.flow, self.state, token, *self.prompt_t, context_tokens=self.window_tokens)
        if mel is None:  # past the stream's own cap by incremental_chunk's count, or not on the chunk grid
            self.close()
            return None
        o.budget.resize(self.key, self.state.nbytes())  # the real size (never more than reserved)
        self.chunks += 1
        return mel[0].float().cpu().numpy()

    def close(self) -> None:
        """Drop the state and its share of the budget (idempotent)."""
        self.closed, self.state = True, None
        self.owner.budget.release(self.key)


#: The defaults of the config parameters :func:`build_incremental` reads (``MODEL_PARAMS``' declare the same).
DEFAULTS = {"stream_state": True, "stream_state_mb": 2048.0, "stream_state_total_mb": 4096.0,
            "speaker_state_mb": 1024.0, "device": "cpu", "n_timesteps": 0}


def build_incremental(params, model_dir: str | Path, config, *, on_change: Callable[[int, int], Any] | None = None
                      ) -> IncrementalFlow | None:
    """The :class:`IncrementalFlow` of a streaming model's config parameters (``stream_state``,
    ``stream_state_mb``, ``stream_state_total_mb``, ``speaker_state_mb``, ``device``, ``n_timesteps``; absent:
    :data:`DEFAULTS`), or None when ``stream_state`` is off. ``config``: the folder's
    :class:`~cosyvoice_triton.config.ModelConfig`. In process: ``build_incremental({}, model_dir, config)``."""
    params = {**DEFAULTS, **params}
    if not params["stream_state"]:
        return None
    from ...models.checkpoint import load_flow
    from ...speaker_state import SpeakerState

    device = params["device"] or "cpu"
    flow_config = config.flow
    if params["n_timesteps"]:  # the graphs' solver takes this many steps: so must the cached one
        flow_config = replace(flow_config, cfm=replace(flow_config.cfm, n_timesteps=int(params["n_timesteps"])))
    flow = load_flow(Path(model_dir) / "flow.pt", flow_config).to(device)
    speakers = params["speaker_state_mb"]
    return IncrementalFlow(flow, max_stream_bytes=int(params["stream_state_mb"] * MB),
                           budget=StateBudget(int(params["stream_state_total_mb"] * MB), on_change),
                           speaker_state=SpeakerState(int(speakers * MB)) if speakers > 0 else None, device=device)
