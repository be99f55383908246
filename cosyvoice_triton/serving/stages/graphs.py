"""One exported graph as a batched stage: requests of different lengths in, one call per batch, exact results.

:class:`GraphRunner` runs a graph of :data:`~cosyvoice_triton.shapes.GRAPHS` on onnxruntime (the file from
``build/onnx/<precision>``) or, for the four neural graphs, on its PyTorch module (``runtime="torch"``, e.g. on
CUDA where there is a GPU but no TensorRT); CosyVoice3's graphs (:data:`~cosyvoice_triton.shapes.GRAPHS3`) run on
onnxruntime. :meth:`GraphRunner.run_items` takes the requests of one Triton
``execute()`` (each a dict of the graph's inputs with its own batch and lengths) and batches them the way
the graph allows without changing any result:

* ``pad``: the graph masks padding (``speech_tokenizer`` with ``whisper_mel_len``, ``flow_encoder`` with
  ``speech_token_len``, ``flow_estimator`` and ``flow3_estimator[_streaming]`` with ``mask``), so every request is
  zero-padded to the longest and all go in one call (chunked by the graph's maximum batch).
* ``group``: the graph sees padding (``speaker_encoder`` pools over all frames; HiFT's non-causal convolutions
  reach ~12 frames into it), so only requests of equal lengths share a call.

Outputs are split per request and cropped to the request's own lengths (from the spec's axis names).
``speech_tokenizer`` is ``pad`` only when a probe at load time shows that a padded batch gives the per-item
tokens (the shipped graph is not ours); otherwise it is ``group``.

**Fallback.** A request whose call fails for a reason that is not its input's (the runtime's error, out of memory;
its input passed the checks) is served once more on the graph's fallback: the fp32 graph of the same export
(``<onnx_dir>/fp32/<graph>.onnx`` next to ``<onnx_dir>/<precision>/<graph>.onnx``; a CosyVoice3 export's
``<onnx_dir>/<graph>.onnx``) when the primary is a reduced precision, else, for a primary on CUDA, the same graph on
the CPU; built on first use. Each such request is counted in :data:`FALLBACK_COUNTS` by graph and outcome
(``served`` / ``failed``) and handed to the runner's ``on_fallback(outcome)`` when set: the served graph model
(``model_repository/graph/model.py``) exports it as the counter ``cosyvoice_fallbacks_total``
(:class:`~.metrics.FallbackMetrics`). In a versioned repository (``render.py --version``) a version's graph is
``<graph>/<N>/model.onnx``; the render puts the fp32 file of a reduced-precision version beside it as
``fallback.onnx``, which the graph model passes as ``fallback``.

**Result cache** (``cache_mb`` > 0; the served prompt-side graphs: tunable ``graph_cache_mb``). :meth:`run_items`
answers a request whose inputs it has answered before from the stored outputs (copies), without running it; the
other requests are batched and run as without the cache. The key (:func:`result_key`) is a BLAKE2b digest of the
graph's name and every input's name, dtype, shape and bytes (after the request's checks). Only successful answers of
the graph itself are stored: a refused request (its input failed the checks), a failed call and an answer served on
the fallback graph are never kept, so a later identical request is checked and run again. The store is a
:class:`~cosyvoice_triton.prompt_cache.PromptCache` (a thread-safe LRU bounded by bytes); ``on_cache(result, n)``
(result ``hit`` / ``miss``) is told the counts of each :meth:`run_items` call (the metrics export).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ...errors import CosyVoiceError
from ...frontend.speech_models import speech_token_count
from ...prompt_cache import PromptCache
from ...shapes import ALL_GRAPHS, GraphSpec
from .batching import ItemResult, RequestError, chunks_by_rows, group_by, pad_to

log = logging.getLogger(__name__)

__all__ = ["BATCH_POLICY", "FALLBACK_COUNTS", "RUNTIMES", "GraphRunner", "axis_sizes",
           "check_request", "check_values", "fallback_counts", "result_key"]

#: How each graph batches requests of different lengths (see the module docstring).
BATCH_POLICY: Mapping[str, str] = {
    "speech_tokenizer": "auto",  # pad if the load-time probe passes, else group
    "speaker_encoder": "group",
    "flow_encoder": "pad",
    "flow_estimator": "pad",
    "hift_source": "group",
    "hift_decoder": "group",
    # CosyVoice3's (shapes.GRAPHS3): the DiT masks padding in its attention and zeroes it before its causal conv
    "flow3_estimator": "pad",
    "flow3_estimator_streaming": "pad",
    "hift3_source": "group",
    "hift3_decoder": "group",
}
RUNTIMES = ("onnxruntime", "torch")
#: Requests served once more on a fallback graph, by ``(graph, outcome)``; outcome ``served`` or ``failed``.
FALLBACK_COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()
_FALLBACK_LOCK = threading.Lock()
_REDUCED = ("fp16", "int8", "int8_cpu")


def fallback_counts() -> dict[tuple[str, str], int]:
    """A copy of :data:`FALLBACK_COUNTS` (this process's graphs)."""
    with _FALLBACK_LOCK:
        return dict(FALLBACK_COUNTS)


def _count_fallback(graph: str, outcome: str) -> None:
    with _FALLBACK_LOCK:
        FALLBACK_COUNTS[(graph, outcome)] += 1
_TORCH_GRAPHS = ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder")


def axis_sizes(spec: GraphSpec, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Axis sizes of one request from its input shapes (checking rank, fixed dims, consistency and each axis's
    min/max of the spec); raises :class:`RequestError` naming the tensor, the axis, the value and the limit."""
    sizes: dict[str, int] = {}
    first: dict[str, str] = {}
    for t in spec.inputs:
        if feeds.get(t.name) is None:
            raise RequestError(f"{spec.name}: missing input {t.name!r}")
        shape = np.shape(feeds[t.name])
        if len(shape) != len(t.shape):
            raise RequestError(f"{spec.name}: input {t.name!r} has shape {list(shape)}, expected rank "
                               f"{len(t.shape)} ({t.dim_names()})")
        for got, d in zip(shape, t.shape, strict=True):
            if isinstance(d, int):
                if got != d:
                    raise RequestError(f"{spec.name}: input {t.name!r} has shape {list(shape)}, expected "
                                       f"{t.dim_names()}")
                continue
            axis, factor = (d, 1) if isinstance(d, str) else d
            if got % factor:
                raise RequestError(f"{spec.name}: input {t.name!r} dim {got} is not a multiple of {factor}")
            n = got // factor
            if sizes.setdefault(axis, n) != n:
                raise RequestError(f"{spec.name}: input {t.name!r} has {axis} = {n}, input {first[axis]!r} has "
                                   f"{sizes[axis]}")
            first.setdefault(axis, t.name)
            r = spec.axes.get(axis)
            if r is not None and n > r.max:
                raise RequestError(f"{spec.name}: input {t.name!r} axis {axis} = {n} exceeds the maximum {r.max}")
            if r is not None and n < r.min and axis != "batch":  # a batch below the minimum is still exact
                raise RequestError(f"{spec.name}: input {t.name!r} axis {axis} = {n} is below the minimum {r.min}")
    return sizes


def _cast(spec: GraphSpec, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for t in spec.inputs:
        x = np.asarray(feeds[t.name])
        if x.dtype != np.dtype(t.dtype):
            raise RequestError(f"{spec.name}: input {t.name!r} is {x.dtype}, expected {t.dtype}")
        out[t.name] = np.ascontiguousarray(x)
    return out


def check_values(spec: GraphSpec, feeds: Mapping[str, np.ndarray], sizes: Mapping[str, int]) -> None:
    """Per-request value checks (after :func:`axis_sizes` and the dtype check): floats finite, lengths within
    their axis (``length_of``), integers within their range (``values``); raises :class:`RequestError`."""
    for t in spec.inputs:
        x = feeds[t.name]
        if x.dtype.kind == "f":
            finite = np.isfinite(x)
            if not finite.all():
                bad = int(finite.size - np.count_nonzero(finite))
                raise RequestError(f"{spec.name}: input {t.name!r} has {bad} NaN/Inf value(s); inputs must be "
                                   "finite")
            continue
        if x.dtype.kind not in "iu" or x.size == 0:
            continue
        lo, hi = int(x.min()), int(x.max())
        if t.values is not None and (lo < t.values[0] or hi > t.values[1]):
            v = lo if lo < t.values[0] else hi
            raise RequestError(f"{spec.name}: input {t.name!r} has value {v} outside {t.values[0]}..{t.values[1]}")
        if t.length_of is not None:
            n = sizes[t.length_of]
            if lo < 1 or hi > n:
                v = lo if lo < 1 else hi
                raise RequestError(f"{spec.name}: input {t.name!r} = {v} is not a length within 1..{n} (the "
                                   f"request's {t.length_of} axis)")


def result_key(graph: str, spec: GraphSpec, feeds: Mapping[str, np.ndarray]) -> str:
    """Hex BLAKE2b digest of a request to ``graph``: its name, then each input of ``spec`` (name, dtype, shape,
    bytes of the C-contiguous array), in the spec's order."""
    h = hashlib.blake2b(digest_size=32)
    h.update(graph.encode("utf-8") + b"\x1e")
    for t in spec.inputs:
        x = np.ascontiguousarray(feeds[t.name])
        h.update(f"{t.name}\x1f{x.dtype.str}\x1f{x.shape}\x1e".encode())
        h.update(memoryview(x).cast("B") if x.size else b"")
        h.update(b"\x1d")
    return h.hexdigest()


def check_request(spec: GraphSpec, feeds: Mapping[str, np.ndarray], *, max_batch: int | None = None
                  ) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """One request checked against the spec before it may share a batch: ``(axis sizes, contiguous feeds)``.
    Every failure is a :class:`RequestError` of this request alone."""
    sizes = axis_sizes(spec, feeds)
    cast = _cast(spec, feeds)
    if max_batch is not None and sizes["batch"] > max_batch:
        raise RequestError(f"{spec.name}: batch {sizes['batch']} exceeds the maximum {max_batch}")
    check_values(spec, cast, sizes)
    return sizes, cast


class GraphRunner:
    """One graph of :data:`ALL_GRAPHS`: ``run`` (one call) and ``run_items`` (a batch of requests).

    Args:
        name: the graph.
        onnx_path: the ONNX file (``runtime="onnxruntime"``).
        runtime: ``"onnxruntime"`` or ``"torch"`` (the four neural graphs, from ``model_dir``'s checkpoints).
        model_dir: the CosyVoice2 folder (``runtime="torch"``).
        device: ``"cpu"`` or ``"cuda"`` (torch device; onnxruntime uses its CUDA provider when available).
        intra_op_threads: onnxruntime intra-op threads (0: its default).
        policy: ``"pad"``, ``"group"`` or ``"auto"`` (default: :data:`BATCH_POLICY`).
        fallback: the ONNX file a request is served once more on when its call fails for a reason that is not its
            input's; ``"auto"`` (default): see the module docstring; None: no fallback.
        on_fallback: called with ``"served"`` or ``"failed"`` for every request sent to the fallback (the metrics
            export); its own failure is logged, never the request's.
        cache_mb: MiB of the result cache of :meth:`run_items` (0: none; see the module docstring).
        on_cache: called as ``on_cache("hit" | "miss", n)`` after each :meth:`run_items` call with a count > 0 (the
            metrics export); its own failure is logged, never the requests'.
    """

    def __init__(self, name: str, *, onnx_path: str | Path | None = None, runtime: str = "onnxruntime",
                 model_dir: str | Path | None = None, device: str = "cpu", intra_op_threads: int = 1,
                 policy: str | None = None, fallback: str | Path | None = "auto",
                 on_fallback: Callable[[str], None] | None = None, cache_mb: float = 0.0,
                 on_cache: Callable[[str, int], None] | None = None):
        if name not in ALL_GRAPHS:
            raise ValueError(f"unknown graph {name!r} (one of {', '.join(ALL_GRAPHS)})")
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        self.name, self.spec, self.runtime, self.device = name, ALL_GRAPHS[name], runtime, device
        self.max_batch = self.spec.max_batch_size
        self._session = self._module = None
        if runtime == "torch":
            if name not in _TORCH_GRAPHS:
                raise ValueError(f"{name}: runtime 'torch' exists for {', '.join(_TORCH_GRAPHS)} only; "
                                 "the shipped graphs run on onnxruntime")
            if model_dir is None:
                raise ValueError(f"{name}: runtime 'torch' needs model_dir")
            self._load_torch(Path(model_dir))
        else:
            if onnx_path is None:
                raise ValueError(f"{name}: runtime 'onnxruntime' needs onnx_path")
            self._load_onnx(Path(onnx_path), intra_op_threads)
        policy = policy or BATCH_POLICY[name]
        if policy not in ("pad", "group", "auto"):
            raise ValueError(f"{name}: policy must be pad, group or auto, got {policy!r}")
        self.policy = self._probe() if policy == "auto" else policy
        self.fallback_path = self._fallback_path(onnx_path, fallback) if runtime == "onnxruntime" else None
        self._fallback: GraphRunner | None = None
        self.on_fallback = on_fallback
        self._threads = intra_op_threads
        if cache_mb < 0:
            raise ValueError(f"{name}: cache_mb must be >= 0 (0: no result cache), got {cache_mb}")
        # bounded by bytes; the entry bound is only a backstop (an entry is at least a few hundred bytes)
        self.cache = PromptCache(max_entries=1 << 20, max_bytes=int(cache_mb * (1 << 20))) if cache_mb > 0 else None
        self.on_cache = on_cache
        log.info("%s: %s on %s, %s batching%s", name, runtime, device, self.policy,
                 f"; fallback {self.fallback_path}" if self.fallback_path else "")

    def _fallback_path(self, onnx_path, fallback) -> Path | None:
        if fallback is None:
            return None
        if fallback != "auto":
            return Path(fallback)
        path = Path(onnx_path)
        if path.parent.name in _REDUCED:
            # CosyVoice2's precision folders sit beside fp32/; a CosyVoice3 export keeps its fp32 graphs at its root
            for fp32 in (path.parent.parent / "fp32" / path.name, path.parent.parent / path.name):
                if fp32.is_file():
                    return fp32
        if self.device.startswith("cuda"):
            return path  # the same graph, on the CPU
        return None

    # ------------------------------------------------------------------------------------------ load

    def _load_onnx(self, path: Path, threads: int) -> None:
        import onnxruntime as ort

        if not path.is_file():
            raise FileNotFoundError(f"{self.name}: {path} not found (run `make export` first)")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        providers = ["CPUExecutionProvider"]
        if self.device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self._session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        names = {i.name for i in self._session.get_inputs()}
        want = {t.name for t in self.spec.inputs}
        if names != want:
            raise ValueError(f"{path}: inputs {sorted(names)} are not the spec's {sorted(want)} for {self.name}")

    def _load_torch(self, model_dir: Path) -> None:
        import torch

        from ...export.onnx_export import load_source_models

        flow = self.name.startswith("flow")
        models = load_source_models(model_dir, flow=flow, hift=not flow)
        self._module = models.wrapper(self.name).to(torch.device(self.device)).eval()

    # ------------------------------------------------------------------------------------------- run

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call on an already batched input (spec names and dtypes), checked as :func:`check_request`
        checks a request; outputs by spec name."""
        _, feeds = check_request(self.spec, feeds, max_batch=self.max_batch)
        return self._call(feeds)

    def _call(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is not None:
            outs = self._session.run([t.name for t in self.spec.outputs], feeds)
        else:
            import torch

            dev = torch.device(self.device)
            with torch.inference_mode():
                res = self._module(*[torch.from_numpy(feeds[t.name]).to(dev) for t in self.spec.inputs])
            res = res if isinstance(res, (tuple, list)) else (res,)
            outs = [r.detach().cpu().numpy() for r in res]
        return {t.name: np.asarray(o).astype(t.dtype, copy=False) for t, o in zip(self.spec.outputs, outs,
                                                                                    strict=True)}

    def _output_sizes(self, sizes: dict[str, int], feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
        if self.name == "speech_tokenizer":  # the one output-only axis: tokens of the item's frames
            sizes = {**sizes, "tokens": int(speech_token_count(sizes["whisper_frames"]))}
        return sizes

    def run_items(self, items: Sequence[Mapping[str, np.ndarray]]) -> list[ItemResult[dict[str, np.ndarray]]]:
        """Each item: one request's inputs (batch b_i >= 1, its own lengths). Returns, per item, its outputs
        (batch b_i, cropped to its lengths) or the error of that item alone."""
        results: list[ItemResult] = [ItemResult() for _ in items]
        sizes: list[dict[str, int] | None] = []
        feeds: list[dict[str, np.ndarray] | None] = []
        for i, item in enumerate(items):
            try:
                s, f = check_request(self.spec, item, max_batch=self.max_batch)
                sizes.append(s)
                feeds.append(f)
            except RequestError as exc:
                results[i] = ItemResult(error=exc)
                sizes.append(None)
                feeds.append(None)
        good = [i for i, s in enumerate(sizes) if s is not None]
        keys: dict[int, str] = {}
        if self.cache is not None:
            good = self._cached(good, feeds, results, keys)
        fell_back: set[int] = set()
        if self.policy == "pad":
            groups = [good]
        else:  # equal lengths (every non-batch axis) per call
            groups = list(group_by(tuple(sorted((k, v) for k, v in sizes[i].items() if k != "batch"))
                                   for i in good).values())
            groups = [[good[j] for j in g] for g in groups]
        rows = [s["batch"] if s else 0 for s in sizes]
        for group in groups:
            for chunk in chunks_by_rows(group, rows, self.max_batch):
                for i, res in zip(chunk, self._run_isolated(chunk, feeds, sizes, fell_back), strict=True):
                    results[i] = res
        if self.cache is not None:
            for i, key in keys.items():  # the graph's own successful answers only
                if results[i].ok and i not in fell_back:
                    self.cache.put(key, results[i].value)
        return results

    def _cached(self, good: list[int], feeds: list, results: list, keys: dict[int, str]) -> list[int]:
        """Answer the checked requests ``good`` found in the cache (into ``results``); the others' keys go into
        ``keys``; returns the indices still to run."""
        todo = []
        for i in good:
            key = result_key(self.name, self.spec, feeds[i])
            entry = self.cache.get(key)
            if entry is None:
                keys[i] = key
                todo.append(i)
            else:  # copies: the stored arrays are read-only and shared
                results[i] = ItemResult({k: np.array(v, copy=True) for k, v in entry.items()})
        for result, n in (("hit", len(good) - len(todo)), ("miss", len(todo))):
            if n:
                self._notify("on_cache", self.on_cache, result, n)
        return todo

    def _notify(self, what: str, callback: Callable | None, *args) -> None:
        """Tell a metrics callback (``on_cache`` / ``on_fallback``); its failure is logged, never the requests'."""
        if callback is None:
            return
        try:
            callback(*args)
        except Exception as exc:
            log.warning("%s: %s%r failed: %s: %s", self.name, what, args, type(exc).__name__, exc)

    def _run_isolated(self, chunk: list[int], feeds: list, sizes: list, fell_back: set[int] | None = None
                      ) -> list[ItemResult[dict[str, np.ndarray]]]:
        """One call for the chunk; if it raises, each item alone, so that one item's failure is its own. The items
        sent to the fallback graph are added to ``fell_back``."""
        try:
            outs = self._run_chunk([feeds[i] for i in chunk], [sizes[i] for i in chunk])
            return [ItemResult(out) for out in outs]
        except Exception as exc:
            if len(chunk) == 1:
                log.error("%s: call failed: %s: %s", self.name, type(exc).__name__, exc)
                if fell_back is not None:
                    fell_back.add(chunk[0])
                return [self._fall_back(chunk[0], feeds, sizes, exc)]
            log.warning("%s: batched call of %d requests failed (%s: %s); running them one by one", self.name,
                        len(chunk), type(exc).__name__, exc)
        return [r for i in chunk for r in self._run_isolated([i], feeds, sizes, fell_back)]

    def _fall_back(self, i: int, feeds: list, sizes: list, exc: Exception) -> ItemResult[dict[str, np.ndarray]]:
        """Serve item ``i`` once more on the fallback graph, unless its own input is at fault or there is none."""
        if isinstance(exc, CosyVoiceError) or self.fallback_path is None:
            return ItemResult(error=exc)
        try:
            if self._fallback is None:
                self._fallback = GraphRunner(self.name, onnx_path=self.fallback_path, device="cpu",
                                             intra_op_threads=self._threads, policy=self.policy, fallback=None)
            out = self._fallback._run_chunk([feeds[i]], [sizes[i]])[0]
        except Exception as again:
            self._counted("failed")
            log.error("%s: fallback %s failed too: %s: %s", self.name, self.fallback_path, type(again).__name__,
                      again)
            return ItemResult(error=exc)
        self._counted("served")
        log.warning("%s: served on the fallback %s after %s: %s", self.name, self.fallback_path,
                    type(exc).__name__, exc)
        return ItemResult(out)

    def _counted(self, outcome: str) -> None:
        _count_fallback(self.name, outcome)
        self._notify("on_fallback", self.on_fallback, outcome)

    def _run_chunk(self, feeds: list[dict[str, np.ndarray]], sizes: list[dict[str, int]]
                   ) -> list[dict[str, np.ndarray]]:
        spec = self.spec
        if len(feeds) == 1:
            out = self._call(feeds[0])
            return [self._crop(out, sizes[0], feeds[0])]
        top = {k: max(s[k] for s in sizes) for k in sizes[0] if k != "batch"}
        batched = {}
        for t in spec.inputs:
            parts = [pad_to(f[t.name], spec.resolve(t, {**top, "batch": s["batch"]})) for f, s in
                     zip(feeds, sizes, strict=True)]
            batched[t.name] = np.concatenate(parts, axis=0)
        out = self._call(batched)
        res, start = [], 0
        for f, s in zip(feeds, sizes, strict=True):
            b = s["batch"]
            res.append(self._crop({k: v[start:start + b] for k, v in out.items()}, s, f))
            start += b
        return res

    def _crop(self, out: dict[str, np.ndarray], sizes: dict[str, int], feeds: Mapping[str, np.ndarray]
              ) -> dict[str, np.ndarray]:
        sizes = self._output_sizes(sizes, feeds)
        cropped = {}
        for t in self.spec.outputs:
            shape = self.spec.resolve(t, sizes)
            cropped[t.name] = np.ascontiguousarray(out[t.name][tuple(slice(0, n) for n in shape)])
        return cropped

    # ----------------------------------------------------------------------------------------- probe

    def _probe(self) -> str:
        """``pad`` when two items of different lengths, padded with noise, give their solo outputs."""
        rng = np.random.default_rng(1234)
        spec = self.spec
        if self.name != "speech_tokenizer":
            return "group"
        items = []
        for n in (23, 150):
            items.append({"whisper_mel": rng.normal(0, 0.5, (1, 128, n)).astype(np.float32),
                          "whisper_mel_len": np.array([n], np.int32)})
        try:
            alone = [self.run(x)["speech_tokens"] for x in items]
            mel = rng.normal(0, 0.5, (2, 128, 150)).astype(np.float32)
            mel[0, :, :23] = items[0]["whisper_mel"][0]
            mel[1] = items[1]["whisper_mel"][0]
            out = self.run({"whisper_mel": mel, "whisper_mel_len": np.array([23, 150], np.int32)})["speech_tokens"]
        except Exception as exc:
            log.info("%s: padded probe failed (%s); batching equal lengths only", spec.name, exc)
            return "group"
        same = all(np.array_equal(out[i, : a.shape[1]], a[0]) for i, a in enumerate(alone))
        return "pad" if same else "group"

