"""Calibration data and ranges: real speech through the fp32 pipeline, each graph's inputs captured where
the served pipeline feeds them (:func:`collect_feeds`, cached under ``build/``), :class:`FeedReader` over them,
and the activation ranges they give (:func:`calibrate`: minmax, percentile or entropy; :class:`Ranges`). Also the
CPU onnxruntime :func:`session` and the error measures (:func:`rel_rms`) the other passes use."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnxruntime.quantization import CalibrationDataReader

from ..hashing import file_sha256
from ..shapes import GRAPHS
from ..threads import ort_spinning
from .quantize_rules import CALIBRATION_METHODS, N_TIMESTEPS, QDQ_OP_TYPES, QUANTIZED_GRAPHS

log = logging.getLogger(__name__)

def session(model: onnx.ModelProto | str | Path | bytes, threads: int = 1, *, profile: str | None = None,
            spin: bool = False):
    """A CPU onnxruntime session (``threads`` intra-op threads; thread spinning off by default, which keeps
    timings sane on a shared machine)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    opts.intra_op_num_threads = int(threads)
    opts.inter_op_num_threads = 1
    ort_spinning(opts, spin)
    if profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else (
        str(model) if isinstance(model, (str, Path)) else model)
    return ort.InferenceSession(src, sess_options=opts, providers=["CPUExecutionProvider"])


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero, inf when only b is)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    num, den = float(np.linalg.norm(a64 - b64)), float(np.linalg.norm(b64))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def rel_max(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b| in float64."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.size == 0:
        return 0.0
    num, den = float(np.max(np.abs(a64 - b64))), float(np.max(np.abs(b64)))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


@dataclass(frozen=True)
class PairInfo:
    """One voice-conversion pair of the corpus and how it was run."""

    index: int
    source: str  # "voice, wpm, seconds: text"
    prompt: str
    source_seconds: float
    prompt_seconds: float
    streaming: bool
    lookahead: int
    steps: tuple[int, ...]  # Euler steps whose estimator inputs were captured


class FeedReader(CalibrationDataReader):
    """``CalibrationDataReader`` over captured input dicts (one graph call each); supports ``len`` and
    ``set_range`` like onnxruntime's strided calibration expects."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]], name: str = ""):
        self.feeds = list(feeds)
        self.name = name
        self._start, self._end = 0, len(self.feeds)
        self._pos = 0

    def __len__(self) -> int:
        return len(self.feeds)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (dict(f) for f in self.feeds[self._start:self._end])

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._start + self._pos >= self._end:
            return None
        feed = dict(self.feeds[self._start + self._pos])
        self._pos += 1
        return feed

    def rewind(self) -> None:
        self._pos = 0

    def set_range(self, start_index: int, end_index: int) -> None:
        self._start, self._end = max(0, start_index), min(len(self.feeds), end_index)
        self._pos = 0


@dataclass
class PipelineFeeds:
    """Inputs of each graph captured from the real pipeline over corpus pairs (see :func:`collect_feeds`)."""

    split: str
    feeds: dict[str, list[dict[str, np.ndarray]]]
    pairs: list[PairInfo]
    model_dir: str = ""
    seconds: float = 0.0

    def reader(self, graph: str) -> FeedReader:
        if graph not in self.feeds or not self.feeds[graph]:
            raise KeyError(f"no {graph} inputs were captured (have {sorted(self.feeds)})")
        return FeedReader(self.feeds[graph], graph)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"split": self.split, "pairs": len(self.pairs),
                               "utterance_seconds": round(sum(p.source_seconds for p in self.pairs), 1),
                               "graphs": {}}
        for g, fs in self.feeds.items():
            spec = GRAPHS[g]
            first = spec.inputs[0].name
            lengths = [int(f[first].shape[-1]) for f in fs]
            out["graphs"][g] = {"samples": len(fs), "length_min": min(lengths, default=0),
                                "length_max": max(lengths, default=0)}
        return out

    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {}
        for g, fs in self.feeds.items():
            for k, f in enumerate(fs):
                for name, a in f.items():
                    arrays[f"{g}/{k}/{name}"] = a
        meta = {"split": self.split, "model_dir": self.model_dir, "seconds": self.seconds,
                "pairs": [asdict(p) for p in self.pairs], "counts": {g: len(fs) for g, fs in self.feeds.items()}}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> PipelineFeeds:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            feeds: dict[str, list[dict[str, np.ndarray]]] = {g: [{} for _ in range(n)]
                                                             for g, n in meta["counts"].items()}
            for key in z.files:
                if key == "__meta__":
                    continue
                g, k, name = key.split("/", 2)
                feeds[g][int(k)][name] = z[key]
        pairs = [PairInfo(**{**p, "steps": tuple(p["steps"])}) for p in meta["pairs"]]
        return cls(meta["split"], feeds, pairs, meta.get("model_dir", ""), meta.get("seconds", 0.0))


def speech_pairs(n: int, *, split: str = "calibration", seed: int = 0, max_seconds: float = 10.0):
    """``n`` (source, prompt) utterance pairs of a corpus split: source i speaks in the voice of utterance i+1
    (the next one, cyclically), so each utterance is a source once and a prompt once."""
    from .speech_corpus import utterances

    if n < 1:
        raise ValueError(f"need at least one utterance, got {n}")
    utts = utterances(n, split=split, seed=seed, max_seconds=max_seconds)
    return [(utts[i], utts[(i + 1) % n]) for i in range(n)]


def _describe(u) -> str:
    return f"{u.voice} {u.speed_wpm} wpm {u.seconds:.1f} s: {u.text[:40]}"


def euler_steps(index: int, per_utterance: int, n_steps: int = N_TIMESTEPS) -> tuple[int, ...]:
    """The Euler steps captured for pair ``index``: consecutive pairs take the next ``per_utterance`` steps
    in rotation, so a calibration set covers t = 0 to the last step evenly."""
    k = max(1, min(per_utterance, n_steps))
    return tuple(sorted({(index * k + j) % n_steps for j in range(k)}))


def encoder_feed(prompt_tokens: np.ndarray, source_tokens: np.ndarray, embedding: np.ndarray, *,
                 streaming: bool, lookahead: int) -> dict[str, np.ndarray]:
    """``flow_encoder`` inputs of one pair (batch 1): prompt then source tokens."""
    tokens = np.concatenate([np.asarray(prompt_tokens), np.asarray(source_tokens)]).astype(np.int32)[None]
    return {"speech_tokens": tokens, "speech_token_len": np.array([tokens.shape[1]], dtype=np.int32),
            "lookahead_len": np.array([lookahead], dtype=np.int32),
            "speaker_embedding": np.asarray(embedding, dtype=np.float32).reshape(1, -1),
            "streaming": np.array([streaming], dtype=bool)}


def estimator_feed(x, mask, mu, t, spks, cond, streaming) -> dict[str, np.ndarray]:
    """``flow_estimator`` inputs from the solver's tensors (``streaming``: bool or a [B] tensor)."""
    f = lambda a: np.ascontiguousarray(a.detach().cpu().numpy(), dtype=np.float32)
    b = x.shape[0]
    flags = np.asarray(streaming.detach().cpu().numpy() if hasattr(streaming, "detach") else streaming, dtype=bool)
    return {"x": f(x), "mask": f(mask), "mu": f(mu), "t": f(t.reshape(-1).expand(b)), "spks": f(spks),
            "cond": f(cond), "streaming": np.broadcast_to(flags, (b,)).copy()}


def load_pipeline(model_dir: str | Path, threads: int = 0):
    """``CosyVoice2.from_pretrained`` with quiet stand-in warnings and the given torch thread count."""

    from ..pipeline import CosyVoice2

    logging.getLogger("cosyvoice_triton.frontend.speech_models").setLevel(logging.ERROR)
    return CosyVoice2.from_pretrained(model_dir, threads=threads or None)


def collect_feeds(model, n: int = 50, *, split: str = "calibration", seed: int = 0, steps_per_utterance: int = 3,
                  max_seconds: float = 10.0, graphs: Iterable[str] = QUANTIZED_GRAPHS, threads: int = 0,
                  progress: Callable[[str], None] | None = None) -> PipelineFeeds:
    """Run the fp32 PyTorch pipeline over ``n`` corpus pairs and capture the inputs of ``graphs``.

    ``model``: a :class:`~cosyvoice_triton.pipeline.CosyVoice2` or a model folder. Pair i runs with
    ``streaming = i odd`` (chunk-causal attention in encoder and estimator); every fourth pair's encoder call
    also has the 3 look-ahead tokens of a non-final streaming chunk. The estimator's inputs are captured at
    :func:`euler_steps` (``steps_per_utterance`` per pair), HiFT's with the pipeline's seeded noise (seed i).
    """
    import torch

    graphs = [g for g in graphs]
    unknown = [g for g in graphs if g not in GRAPHS]
    if unknown:
        raise ValueError(f"unknown graph(s) {unknown}")
    start = time.perf_counter()
    model_dir = ""
    if isinstance(model, (str, Path)):
        model_dir = str(model)
        model = load_pipeline(model, threads)
    say = progress or log.info
    pairs = speech_pairs(n, split=split, seed=seed, max_seconds=max_seconds)
    feeds: dict[str, list[dict[str, np.ndarray]]] = {g: [] for g in graphs}
    infos: list[PairInfo] = []
    flow, hift = model.flow, model.hift
    for i, (src, prm) in enumerate(pairs):
        t0 = time.perf_counter()
        streaming = i % 2 == 1
        lookahead = flow.pre_lookahead_len if i % 4 == 3 else 0
        steps = euler_steps(i, steps_per_utterance)
        inputs = model.frontend_vc(src.wave, prm.wave, source_sr=src.sample_rate, prompt_sr=prm.sample_rate)
        if "flow_encoder" in feeds:
            feeds["flow_encoder"].append(encoder_feed(inputs.prompt_tokens, inputs.source_tokens, inputs.embedding,
                                                      streaming=streaming, lookahead=lookahead))
        need_flow = "flow_estimator" in feeds or "hift_decoder" in feeds or "hift_source" in feeds
        if need_flow:
            with torch.inference_mode():
                c = flow.condition(*model._tensors(inputs, inputs.source_tokens), streaming=streaming,
                                   finalize=lookahead == 0)
                calls = [0]

                def record(x, mask, mu, t, spks, cond, stream, _steps=steps, _calls=calls):
                    if "flow_estimator" in feeds and _calls[0] in _steps:
                        feeds["flow_estimator"].append(estimator_feed(x, mask, mu, t, spks, cond, stream))
                    _calls[0] += 1
                    return flow.decoder.estimator(x, mask, mu, t, spks, cond, stream)

                mel = flow.decoder(c.mu, c.mask, c.spks, c.cond, streaming=streaming, estimator_fn=record)
                mel, _ = c.crop(mel)
                if "hift_decoder" in feeds or "hift_source" in feeds:
                    gen = torch.Generator().manual_seed(i)
                    noise = hift.draw_noise(1, mel.shape[2], gen)
                    if "hift_source" in feeds:
                        feeds["hift_source"].append({"mel": mel.numpy().astype(np.float32),
                                                     "nsf_noise": noise.numpy().astype(np.float32)})
                    if "hift_decoder" in feeds:
                        source = hift.source_from_f0(hift.f0_predictor(mel), noise)
                        feeds["hift_decoder"].append({"mel": mel.numpy().astype(np.float32),
                                                      "source": source.numpy().astype(np.float32)})
        infos.append(PairInfo(i, _describe(src), _describe(prm), round(src.seconds, 2), round(prm.seconds, 2),
                              streaming, lookahead, steps if "flow_estimator" in feeds else ()))
        say(f"{split} {i + 1}/{n}: source {_describe(src)} | prompt {prm.voice} {prm.seconds:.1f} s | "
            f"{'streaming' if streaming else 'offline'}{', look-ahead' if lookahead else ''} | steps "
            f"{','.join(map(str, steps))} | {time.perf_counter() - t0:.1f} s")
    return PipelineFeeds(split, feeds, infos, model_dir, time.perf_counter() - start)


def feeds_cache_key(model_dir: str | Path, **params: Any) -> str:
    """A short key of the model folder's weights (size + mtime) and the collection parameters."""
    h = hashlib.sha256()
    for name in ("flow.pt", "hift.pt", "speech_tokenizer_v2.onnx", "campplus.onnx"):
        p = Path(model_dir) / name
        st = p.stat() if p.exists() else None
        h.update(f"{name}:{st.st_size if st else 0}:{int(st.st_mtime) if st else 0};".encode())
    h.update(json.dumps(params, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def feeds_cache_path(cache_dir: str | Path, model_dir: str | Path, n: int, *, split: str, seed: int = 0,
                     steps_per_utterance: int = 3, max_seconds: float = 10.0,
                     graphs: Iterable[str] = QUANTIZED_GRAPHS) -> Path:
    """Where :func:`cached_feeds` keeps the captured inputs of these parameters."""
    params = dict(n=n, split=split, seed=seed, steps=steps_per_utterance, max_seconds=max_seconds,
                  graphs=tuple(graphs))
    return Path(cache_dir) / f"{split}-{n}-{feeds_cache_key(model_dir, **params)}.npz"


def cached_feeds(model_dir: str | Path, cache_dir: str | Path | None, n: int, *, split: str, seed: int = 0,
                 steps_per_utterance: int = 3, max_seconds: float = 10.0, graphs: Iterable[str] = QUANTIZED_GRAPHS,
                 threads: int = 0, model=None, progress: Callable[[str], None] | None = None) -> PipelineFeeds:
    """:func:`collect_feeds`, read from / written to ``cache_dir`` (None: no cache)."""
    graphs = tuple(graphs)
    path = None
    if cache_dir is not None:
        path = feeds_cache_path(cache_dir, model_dir, n, split=split, seed=seed,
                                steps_per_utterance=steps_per_utterance, max_seconds=max_seconds, graphs=graphs)
        if path.is_file():
            try:
                got = PipelineFeeds.load(path)
                (progress or log.info)(f"{split} inputs: {len(got.pairs)} pairs from cache {path}")
                return got
            except (OSError, ValueError, KeyError) as exc:
                log.warning("ignoring unreadable cache %s: %s", path, exc)
    got = collect_feeds(model if model is not None else model_dir, n, split=split, seed=seed,
                        steps_per_utterance=steps_per_utterance, max_seconds=max_seconds, graphs=graphs,
                        threads=threads, progress=progress)
    got.model_dir = str(model_dir)
    if path is not None:
        got.save(path)
    return got


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    table = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
             "entropy": CalibrationMethod.Entropy}
    if name not in table:
        raise ValueError(f"calibration method {name!r}: choose from {', '.join(CALIBRATION_METHODS)}")
    return table[name]


@dataclass
class Ranges:
    """Calibrated activation ranges of one graph: tensor name -> (lowest, highest)."""

    method: str
    ranges: dict[str, tuple[float, float]]
    samples: int
    seconds: float
    symmetric: bool = True

    def tensors_data(self):
        from onnxruntime.quantization.calibrate import TensorData, TensorsData

        return TensorsData(_method(self.method), {
            k: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for k, (lo, hi) in self.ranges.items()})

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "samples": self.samples, "seconds": round(self.seconds, 2),
                "symmetric": self.symmetric,
                "ranges": {k: [float(lo), float(hi)] for k, (lo, hi) in self.ranges.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Ranges:
        return cls(d["method"], {k: (float(v[0]), float(v[1])) for k, v in d["ranges"].items()}, int(d["samples"]),
                   float(d.get("seconds", 0.0)), bool(d.get("symmetric", True)))


class _One(CalibrationDataReader):
    def __init__(self, feed: Mapping[str, np.ndarray]):
        self.feed: dict[str, np.ndarray] | None = dict(feed)

    def get_next(self):
        feed, self.feed = self.feed, None
        return feed


def calibrate(model_path: str | Path, reader: CalibrationDataReader, method: str = "minmax", *,
              op_types: Sequence[str] = QDQ_OP_TYPES, symmetric: bool = True, percentile: float = 99.999,
              progress: Callable[[str], None] | None = None) -> Ranges:
    """Activation ranges of the fp32 graph at ``model_path`` over ``reader`` (``symmetric`` as the Q/DQ graphs
    quantize activations; False for the asymmetric U8 of :data:`CPU_INT8`'s static recipe), one sample at a
    time (samples have different lengths; the histogram calibrators would otherwise hold every activation of
    every sample in memory)."""
    from onnxruntime.quantization.calibrate import create_calibrator

    start = time.perf_counter()
    items = list(reader) if isinstance(reader, FeedReader) else list(iter(reader.get_next, None))
    if not items:
        raise ValueError("calibrate: the data reader yielded nothing")
    if method == "percentile" and symmetric:
        ranges = _percentile_ranges(model_path, items, op_types, percentile, progress, start)
        return Ranges(method, ranges, len(items), time.perf_counter() - start, symmetric)
    options: dict[str, Any] = {"symmetric": symmetric}
    if method == "percentile":
        options["percentile"] = percentile
    with tempfile.TemporaryDirectory(prefix="cosyvoice-calib-") as tmp:
        calibrator = create_calibrator(Path(model_path), list(op_types),
                                       augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                                       calibrate_method=_method(method), extra_options=options,
                                       providers=["CPUExecutionProvider"])
        every = max(1, len(items) // 10)
        for k, feed in enumerate(items, 1):
            with contextlib.redirect_stdout(io.StringIO()):  # the histogram collectors print per call
                calibrator.collect_data(_One(feed))
            if progress and (k % every == 0 or k == len(items)):
                progress(f"  {method}: {k}/{len(items)} samples, {time.perf_counter() - start:.1f} s")
        with contextlib.redirect_stdout(io.StringIO()):
            data = calibrator.compute_data()
        del calibrator
    ranges = {}
    for name, td in data.data.items():
        lo, hi = td.range_value
        ranges[name] = (float(np.asarray(lo).reshape(-1)[0]), float(np.asarray(hi).reshape(-1)[0]))
    return Ranges(method, ranges, len(items), time.perf_counter() - start, symmetric)


PERCENTILE_BINS = 8192


def _percentile_ranges(model_path: str | Path, items: Sequence[Mapping[str, np.ndarray]], op_types: Sequence[str],
                       percentile: float, progress: Callable[[str], None] | None, start: float
                       ) -> dict[str, tuple[float, float]]:
    """Symmetric percentile ranges: per tensor the ``percentile`` of |x| over every value of every call, from a
    histogram of :data:`PERCENTILE_BINS` bins over [0, max|x|] (two passes: the max, then the histogram).

    Same definition as onnxruntime's ``PercentileCalibrater(symmetric=True)``, whose re-binning histogram
    collector takes minutes per call on the full-size graphs; this takes about two forward passes per call.
    The tensors are the ones onnxruntime's calibrators select (inputs and outputs of ``op_types`` nodes).
    """
    from onnxruntime.quantization.calibrate import MinMaxCalibrater

    with tempfile.TemporaryDirectory(prefix="cosyvoice-pct-") as tmp:
        selector = MinMaxCalibrater(Path(model_path), list(op_types), str(Path(tmp) / "unused.onnx"))
        model = selector.model
        names, _ = selector.select_tensors_to_calibrate(model)
    inputs = {i.name for i in model.graph.input}
    names = sorted(names)
    outputs = [n for n in names if n not in inputs]
    known = {o.name for o in model.graph.output}
    for n in outputs:
        if n not in known:
            model.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    sess = session(model, 0)
    del model

    def values(feed: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        got = sess.run(outputs, dict(feed))
        yield from zip(outputs, got, strict=True)
        for n in names:
            if n in inputs:
                yield n, feed[n]

    amax = dict.fromkeys(names, 0.0)
    total = len(items) * 2
    for k, feed in enumerate(items, 1):
        for n, a in values(feed):
            amax[n] = max(amax[n], float(np.max(np.abs(a), initial=0.0)))
        if progress and (k % max(1, len(items) // 5) == 0):
            progress(f"  percentile pass 1 (max): {k}/{len(items)} calls, {time.perf_counter() - start:.1f} s")
    hist = {n: np.zeros(PERCENTILE_BINS, dtype=np.int64) for n in names}
    for k, feed in enumerate(items, 1):
        for n, a in values(feed):
            if amax[n] > 0:
                idx = (np.abs(a.ravel()) * (PERCENTILE_BINS / amax[n])).astype(np.int64)
                hist[n] += np.bincount(np.minimum(idx, PERCENTILE_BINS - 1), minlength=PERCENTILE_BINS)
        if progress and (k % max(1, len(items) // 5) == 0 or k == len(items)):
            progress(f"  percentile pass 2 (histogram): {k + len(items)}/{total} passes, "
                     f"{time.perf_counter() - start:.1f} s")
    out = {}
    for n in names:
        counts = hist[n]
        if amax[n] == 0 or counts.sum() == 0:
            out[n] = (0.0, 0.0)
            continue
        cdf = np.cumsum(counts) / counts.sum()
        edge = (int(np.searchsorted(cdf, percentile / 100.0)) + 1) * amax[n] / PERCENTILE_BINS
        t = min(edge, amax[n])
        out[n] = (-t, t)
    return out


#: onnxruntime's entropy calibrator re-bins a histogram of every activation per call (minutes per call on the
#: full-size graphs): it sees at most this many calls, evenly spread over the calibration pairs.
ENTROPY_MAX_CALLS = 50


def _cached_ranges(cache_dir: str | Path | None, fp32_path: Path, calib: PipelineFeeds, graph: str, method: str, *,
                   symmetric: bool, progress: Callable[[str], None] | None = None) -> Ranges:
    """:func:`calibrate`, cached in ``cache_dir`` by the fp32 file, the data and the method."""
    feeds = calib.feeds[graph]
    if method == "entropy" and len(feeds) > ENTROPY_MAX_CALLS:
        step = len(feeds) / ENTROPY_MAX_CALLS
        feeds = [feeds[int(i * step)] for i in range(ENTROPY_MAX_CALLS)]
    size = sum(int(a.size) for f in feeds for a in f.values())
    text = f"{file_sha256(fp32_path)}:{method}:{symmetric}:{len(calib.pairs)}:{calib.split}:{size}"
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"ranges-{graph}-{method}-{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError):
            return Ranges.from_json(json.loads(path.read_text()))
    ranges = calibrate(fp32_path, FeedReader(feeds, graph), method, symmetric=symmetric, progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ranges.to_json()))
    return ranges
