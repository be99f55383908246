"""Speech metrics of the Python stages, exported through Triton's custom metrics API next to Triton's own.

Triton's ``triton_python_backend_utils`` (``MetricFamily`` / ``Metric``: counters, gauges, histograms) is handed in
as ``pb``, so this module runs in process with a stand-in (``tests/pb_standin.py``). A model creates its
:class:`SpeechMetrics` in ``initialize()`` and calls it per request; the families (:data:`FAMILIES`) are shared by
every model (Triton merges a family registered twice by name), each series labelled ``model`` and ``version``.

========================================  =========  ============================================================
family                                    kind       what (labels beyond model, version)
========================================  =========  ============================================================
``cosyvoice_audio_in_seconds_total``      counter    seconds of input audio of the requests served (``input``:
                                                     source / prompt)
``cosyvoice_audio_out_seconds_total``     counter    seconds of audio answered
``cosyvoice_real_time_factor``            histogram  per request: wall time / seconds of audio answered
``cosyvoice_first_chunk_seconds``         histogram  streamed requests: start to the first audio chunk
``cosyvoice_rejects_total``               counter    requests answered with an error (``reason``: :data:`REASONS`)
``cosyvoice_fallbacks_total``             counter    graph requests served once more on the fallback graph after
                                                     an engine error (``graph``; ``outcome``: served / failed)
``cosyvoice_graph_cache_total``           counter    graph requests looked up in the graph model's result cache
                                                     (``result``: hit / miss; :class:`GraphCacheMetrics`)
========================================  =========  ============================================================

Which model records what (the pipeline's numbers, not each graph's): ``preprocess`` the audio in and
``postprocess`` the audio out of ``cosyvoice_vc`` (an ensemble runs no Python of its own: its real-time factor is
Triton's ``nv_inference_request_duration_us`` over ``postprocess``'s audio out, a recording rule in
``deploy/prometheus/rules.yml``); the streaming orchestrators ``cosyvoice_vc_stream`` / ``cosyvoice_tts_stream``
and ``cosyvoice_tts`` record everything of their requests (``cosyvoice_tts`` serves through
``cosyvoice_tts_stream``, so its requests are counted under both); ``speakers`` its rejects. The inner stages
(``flow``, ``hift``, the graphs) record nothing: a failure there is counted by the stream model that called them
(as ``internal``), and for ``cosyvoice_vc`` only by Triton's ``nv_inference_request_failure``. The LM engine's own
gauges stay in ``cosyvoice_llm{what}`` (``ensemble/cosyvoice_tts_stream/model.py``). The one exception is
``cosyvoice_fallbacks_total``: the graph models of the local flavor (``model_repository/graph/model.py``,
:class:`FallbackMetrics`) count the requests their :class:`~.graphs.GraphRunner` sent to its fallback (a request
served there succeeded, so no other metric sees it). Likewise ``cosyvoice_graph_cache_total``
(:class:`GraphCacheMetrics`, not in :data:`FAMILIES`: only the graph models with a result cache, tunable
``graph_cache_mb``, create it): the requests their runner answered from its cache (``hit``) or looked up and ran
(``miss``); a refused request is neither.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import AudioError, CosyVoiceError, LLMError, SpeakerError, TextError

log = logging.getLogger(__name__)

__all__ = ["AUDIO_IN", "AUDIO_OUT", "CACHE_RESULTS", "FALLBACKS", "FALLBACK_OUTCOMES", "FAMILIES", "FIRST_CHUNK",
           "GRAPH_CACHE", "METRIC_LOCK", "REASONS", "REJECTS", "RTF", "FallbackMetrics", "Family", "GraphCacheMetrics",
           "SpeechMetrics", "audio_seconds", "reject_reason", "streaming"]


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    description: str
    labels: tuple[str, ...] = ("model", "version")
    buckets: tuple[float, ...] = ()


AUDIO_IN = Family("cosyvoice_audio_in_seconds_total", "counter",
                  "seconds of input audio in the requests served (label input: source or prompt)",
                  ("model", "version", "input"))
AUDIO_OUT = Family("cosyvoice_audio_out_seconds_total", "counter", "seconds of audio answered")
RTF = Family("cosyvoice_real_time_factor", "histogram",
             "per request: wall time over the seconds of audio answered (below 1: faster than real time)",
             buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0))
FIRST_CHUNK = Family("cosyvoice_first_chunk_seconds", "histogram",
                     "streamed requests: seconds from the start of the request to its first audio chunk",
                     buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0))
REJECTS = Family("cosyvoice_rejects_total", "counter",
                 "requests answered with an error, by reason (bad_*: the client's input; busy: queue full or "
                 "waited too long; cancelled: the client went away; internal: the server's fault)",
                 ("model", "version", "reason"))
FALLBACKS = Family("cosyvoice_fallbacks_total", "counter",
                   "graph requests whose call failed for a reason not their input's (engine error, out of memory) "
                   "and were run once more on the fallback graph (outcome: served or failed)",
                   ("model", "version", "graph", "outcome"))
FAMILIES: tuple[Family, ...] = (AUDIO_IN, AUDIO_OUT, RTF, FIRST_CHUNK, REJECTS, FALLBACKS)
#: Outcomes of a fallback (a series each, created at zero).
FALLBACK_OUTCOMES = ("served", "failed")
#: The graph models' result cache (tunable ``graph_cache_mb``); created by :class:`GraphCacheMetrics` only.
GRAPH_CACHE = Family("cosyvoice_graph_cache_total", "counter",
                     "graph requests looked up in the graph model's cache of successful answers (result: hit, "
                     "answered without running the graph; miss, run)", ("model", "version", "result"))
#: Results of a cache lookup (a series each, created at zero).
CACHE_RESULTS = ("hit", "miss")

#: Every reject reason (a series each, created at zero so that rates and alerts see them from the start).
REASONS = ("bad_audio", "bad_text", "bad_speaker", "bad_request", "busy", "cancelled", "internal")

#: How the message of a full LM queue starts (``lm_engine.BUSY``) and StreamWorkers' refusal (after the model's
#: name), and a cancelled stream's: read at the start only, so text a client sent (quoted further on) never counts.
_BUSY = re.compile(r"TTS busy: |[\w.-]+: too many concurrent streams")
_CANCELLED = re.compile(r"(?i)([\w.-]+: )?(the client )?cancel")


def reject_reason(error: BaseException | str) -> str:
    """The :data:`REASONS` entry of an exception, or of an error message (a decoupled BLS answer keeps only that)."""
    if isinstance(error, str):
        if _BUSY.match(error):
            return "busy"
        if error.startswith("internal error"):
            return "internal"
        return "cancelled" if _CANCELLED.match(error) else "bad_request"
    name = type(error).__name__
    if name in ("EngineBusy",):
        return "busy"
    if name in ("JobCancelled", "StreamCancelled", "GeneratorExit"):
        return "cancelled"
    for kind, reason in ((AudioError, "bad_audio"), ((TextError, LLMError), "bad_text"), (SpeakerError, "bad_speaker"),
                         (CosyVoiceError, "bad_request")):
        if isinstance(error, kind):
            return reason
    return "bad_request" if getattr(error, "invalid_argument", False) else "internal"


def audio_seconds(tensors: Mapping[str, Any], which: str) -> float:
    """Seconds of the ``which`` (source / prompt) utterance of a request's tensors: ``{which}_audio`` samples over
    ``{which}_sample_rate``, or the header of ``{which}_audio_bytes``; 0 when absent or unreadable."""
    samples, rate, encoded = (tensors.get(f"{which}_{n}") for n in ("audio", "sample_rate", "audio_bytes"))
    try:
        if samples is not None and rate is not None:
            return float(np.asarray(samples).size) / float(np.asarray(rate).reshape(-1)[0])
        if encoded is not None:
            import soundfile as sf

            data = np.asarray(encoded, dtype=object).reshape(-1)[0]
            info = sf.info(io.BytesIO(bytes(data)))
            return float(info.frames) / float(info.samplerate)
    except Exception:
        return 0.0
    return 0.0


def _waveform_seconds(chunk: Any, rate: float) -> float:
    """Seconds of one streamed chunk: a waveform at ``rate``, or response tensors (``waveform`` and, when given,
    its own ``sample_rate``)."""
    if isinstance(chunk, Mapping):
        wave, own = chunk.get("waveform"), chunk.get("sample_rate")
        rate = rate if own is None else float(np.asarray(own).reshape(-1)[0])
    else:
        wave = chunk
    return 0.0 if wave is None else float(np.asarray(wave).size) / rate


#: Every metric update of this process goes through this lock: the stub's metric calls travel over the Python
#: backend's shared-memory channel to the server, and stream models update metrics from several threads at once
#: (their request threads and the LM gauge reporter); the channel is not documented as thread-safe.
METRIC_LOCK = threading.Lock()


class _Series:
    """A Triton metric whose failures are logged (once) instead of failing the request being counted."""

    def __init__(self, metric, name: str):
        self.metric, self.name, self.warned = metric, name, False

    def _call(self, op: str, value: float) -> None:
        try:
            with METRIC_LOCK:
                getattr(self.metric, op)(value)
        except Exception as exc:
            if not self.warned:
                self.warned = True
                log.warning("metric %s: %s(%r) failed (%s); further failures are not logged", self.name, op, value,
                            exc)

    def increment(self, value: float) -> None:
        self._call("increment", value)

    def observe(self, value: float) -> None:
        self._call("observe", value)


class SpeechMetrics:
    """The speech series of one model version (see the module docstring).

    Args:
        pb: ``triton_python_backend_utils`` (or a stand-in with its ``MetricFamily``).
        model, version: the labels (``args["model_name"]``, ``args["model_version"]`` in ``initialize()``).
        inputs: the utterances whose seconds in are counted (``("source", "prompt")``, ``("prompt",)``, or none).
        audio_out: count seconds out and (``timed``: the model knows a request's wall time) the real-time factor;
        first_chunk: the first-chunk latency.
    """

    def __init__(self, pb, model: str, version: str | int, *, inputs: Sequence[str] = (), audio_out: bool = False,
                 timed: bool = True, first_chunk: bool = False, clock: Callable[[], float] = time.monotonic):
        self.model, self.version, self.inputs, self.clock = model, str(version), tuple(inputs), clock
        # the families are kept: Triton wants a family to outlive its metrics
        self.families = {f.name: pb.MetricFamily(name=f.name, description=f.description,
                                                 kind=getattr(pb.MetricFamily, f.kind.upper()))
                         for f in FAMILIES}
        base = {"model": model, "version": self.version}

        def metric(family: Family, **labels: str):
            kwargs = {"buckets": list(family.buckets)} if family.kind == "histogram" else {}
            return _Series(self.families[family.name].Metric(labels={**base, **labels}, **kwargs), family.name)

        self.rejects = {r: metric(REJECTS, reason=r) for r in REASONS}
        self.audio_in = {i: metric(AUDIO_IN, input=i) for i in self.inputs}
        self.audio_out = metric(AUDIO_OUT) if audio_out else None
        self.rtf = metric(RTF) if audio_out and timed else None
        self.first_chunk = metric(FIRST_CHUNK) if first_chunk else None

    # ------------------------------------------------------------------------------------------ record

    def served(self, tensors: Mapping[str, Any] | None = None, *, out_seconds: float | None = None,
               elapsed_s: float | None = None) -> None:
        """One request answered: its audio in (from its request ``tensors``), ``out_seconds`` of audio out, and its
        real-time factor when ``elapsed_s`` is given."""
        if tensors is not None:
            for which, m in self.audio_in.items():
                seconds = audio_seconds(tensors, which)
                if seconds > 0:
                    m.increment(seconds)
        if self.audio_out is not None and out_seconds is not None:
            self.audio_out.increment(max(float(out_seconds), 0.0))
            if self.rtf is not None and elapsed_s is not None and out_seconds > 0:
                self.rtf.observe(float(elapsed_s) / float(out_seconds))

    def rejected(self, error: BaseException | str) -> str:
        """One request answered with ``error`` (an exception or the message); returns the reason counted."""
        reason = reject_reason(error)
        self.rejects[reason].increment(1.0)
        return reason

    def results(self, tensors: Iterable[Mapping[str, Any]], results: Sequence[Any],
                out_seconds: Callable[[Mapping[str, Any], Any], float] | None = None) -> None:
        """A stage's batch: the request tensors and their :class:`~.batching.ItemResult`; ``out_seconds(tensors,
        value)`` gives a served request's audio out."""
        for t, r in zip(tensors, results, strict=True):
            if r.ok:
                self.served(t, out_seconds=None if out_seconds is None else out_seconds(t, r.value))
            else:
                self.rejected(r.error)

    def stream(self, chunks: Iterable[Any], tensors: Mapping[str, Any] | None, *, sample_rate: float,
               first_chunk: bool = True, start: float | None = None) -> Iterator[Any]:
        """``chunks`` passed through (each a waveform at ``sample_rate`` or response tensors: ``waveform`` and
        optionally ``sample_rate``), timed from ``start`` (default: now): the first chunk's latency
        (``first_chunk``), the audio out and real-time factor at the end; an error, or the consumer stopping early
        (the client went away), is counted as a reject and re-raised."""
        start = self.clock() if start is None else start
        out, first = 0.0, True
        try:
            for chunk in chunks:
                if first and first_chunk and self.first_chunk is not None:
                    self.first_chunk.observe(self.clock() - start)
                first = False
                out += _waveform_seconds(chunk, sample_rate)
                yield chunk
        except BaseException as exc:
            self.rejected(exc)
            raise
        self.served(tensors, out_seconds=out, elapsed_s=self.clock() - start)


class FallbackMetrics:
    """``cosyvoice_fallbacks_total`` of one graph model version: a series per outcome, created at zero; pass
    :meth:`record` as the runner's ``on_fallback``."""

    def __init__(self, pb, model: str, version: str | int, graph: str):
        self.family = pb.MetricFamily(name=FALLBACKS.name, description=FALLBACKS.description,
                                      kind=pb.MetricFamily.COUNTER)
        labels = {"model": model, "version": str(version), "graph": graph}
        self.series = {o: _Series(self.family.Metric(labels={**labels, "outcome": o}), FALLBACKS.name)
                       for o in FALLBACK_OUTCOMES}

    def record(self, outcome: str) -> None:
        self.series[outcome].increment(1.0)


class GraphCacheMetrics:
    """``cosyvoice_graph_cache_total`` of one graph model version: a series per result (hit, miss), created at
    zero; pass :meth:`record` as the runner's ``on_cache``."""

    def __init__(self, pb, model: str, version: str | int):
        self.family = pb.MetricFamily(name=GRAPH_CACHE.name, description=GRAPH_CACHE.description,
                                      kind=pb.MetricFamily.COUNTER)
        labels = {"model": model, "version": str(version)}
        self.series = {r: _Series(self.family.Metric(labels={**labels, "result": r}), GRAPH_CACHE.name)
                       for r in CACHE_RESULTS}

    def record(self, result: str, n: int = 1) -> None:
        self.series[result].increment(float(n))


def streaming(tensors: Mapping[str, Any]) -> bool:
    """Whether a ``cosyvoice_tts_stream`` request asks for chunks (``stream`` absent or true) or one per segment."""
    s = tensors.get("stream")
    return s is None or bool(np.asarray(s).reshape(-1)[0])
