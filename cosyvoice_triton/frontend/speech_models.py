"""The two ONNX graphs CosyVoice2-0.5B ships, run as shipped with onnxruntime.

* ``speech_tokenizer_v2.onnx`` (S3Tokenizer v2, FSQ, 25 Hz): Whisper 128-bin log-mel to speech tokens.
  Inputs ``feats`` float32 ``[1, 128, T]`` and ``feats_length`` int32 ``[1]``; output ``indices`` int32
  ``[1, T_tok]`` with tokens in ``[0, 6561)`` and ``T_tok = speech_token_count(T)`` (two stride-2 convs,
  i.e. ``ceil(T / 4)``). The official front end only ever feeds one utterance per call and refuses audio
  longer than 30 s (3000 frames).
* ``campplus.onnx`` (CAM++ speaker verification model): Kaldi 80-bin fbank, mean-normalised over time,
  to an x-vector. Input ``input`` float32 ``[1, T, 80]``; output ``output`` float32 ``[1, 192]``.

Both wrappers take features (see ``cosyvoice_triton.frontend.features``), check the graph's signature when they
open it and raise :class:`~cosyvoice_triton.errors.CheckpointError` naming the file and the mismatch.

CosyVoice3's ``speech_tokenizer_v3.onnx`` (S3Tokenizer v3: a deeper encoder, the same FSQ head) is read by the
same :class:`SpeechTokenizer` (``version="v3"``). The official code calls both graphs the same way: one
``_extract_speech_token`` for every family (Whisper log-mel with 128 bins at 16 kHz, ``[1, 128, T]`` float32 as
input 0, ``[T]`` int32 as input 1, output 0 flattened into the tokens, at most 30 s), the training code's batched
extractor divides the frame count by 4 for both (25 Hz), and both families' LM and flow take 6561 speech tokens.
That code binds the inputs by position, never by name, so the names of the v3 graph's inputs and output are not
known from it: for v3 they are not checked (dtypes, ranks and the 128 bins are), and the graph's own names are used.

Batching. The official code runs both graphs one utterance at a time and CosyVoice's own training code
uses a *separate* ``speech_tokenizer_v2.batch.onnx`` for padded batches, so a batched call on the shipped
tokenizer is not assumed to be correct. ``SpeechTokenizer`` batches only when the graph declares a
dynamic batch axis on both inputs *and* a probe at load time shows that a padded batch gives exactly the
per-utterance tokens; otherwise it loops. CAM++ has no length input and pools statistics over all frames,
so padding would change the embedding: ``SpeakerEncoder`` only puts utterances of equal length in one
call (when the graph's batch axis is dynamic) and loops otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import AudioError, CheckpointError
from ..threads import ort_spinning
from .features import pad_batch

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ constants

TOKENIZER_FILENAME = "speech_tokenizer_v2.onnx"
TOKENIZER_V3_FILENAME = "speech_tokenizer_v3.onnx"
CAMPPLUS_FILENAME = "campplus.onnx"

SPEECH_TOKEN_VOCAB = 6561  # 3 ** 8: FSQ with 8 dimensions of 3 levels
WHISPER_MEL_BINS = 128
FBANK_BINS = 80
SPEAKER_EMBED_DIM = 192
MEL_FRAMES_PER_TOKEN = 4  # 100 Hz Whisper frames -> 25 Hz tokens
MAX_TOKENIZER_FRAMES = 3000  # 30 s: the official front end refuses longer prompts

#: Metadata key the stand-in graphs carry (``cosyvoice_triton.models.standins``); real releases do not have it.
STANDIN_METADATA_KEY = "cosyvoice_triton.standin"

Batching = Literal["auto", "never", "always"]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of an official graph: name (``None``: not checked), accepted ORT types, rank and fixed
    dims."""

    name: str | None
    types: tuple[str, ...]
    rank: int
    fixed: dict[int, int] = field(default_factory=dict)

    def describe(self) -> str:
        dims = ["?"] * self.rank
        for axis, size in self.fixed.items():
            dims[axis] = str(size)
        return f"{self.name or 'any name'!r} {'|'.join(self.types)} [{', '.join(dims)}]"


# Output dtype: int32 per the published consumers; int64 is accepted too (same values).
TOKENIZER_INPUTS = (
    TensorSpec("feats", ("tensor(float)",), 3, {1: WHISPER_MEL_BINS}),
    TensorSpec("feats_length", ("tensor(int32)",), 1),
)
TOKENIZER_OUTPUTS = (TensorSpec("indices", ("tensor(int32)", "tensor(int64)"), 2),)
# v3: the same inputs and output by position; names unchecked (see the module docstring).
TOKENIZER_V3_INPUTS = tuple(dataclasses.replace(spec, name=None) for spec in TOKENIZER_INPUTS)
TOKENIZER_V3_OUTPUTS = tuple(dataclasses.replace(spec, name=None) for spec in TOKENIZER_OUTPUTS)
#: Speech tokenizer version -> (file name in the model folder, input specs, output specs).
TOKENIZER_VERSIONS = {
    "v2": (TOKENIZER_FILENAME, TOKENIZER_INPUTS, TOKENIZER_OUTPUTS),
    "v3": (TOKENIZER_V3_FILENAME, TOKENIZER_V3_INPUTS, TOKENIZER_V3_OUTPUTS),
}
CAMPPLUS_INPUTS = (TensorSpec("input", ("tensor(float)",), 3, {2: FBANK_BINS}),)
CAMPPLUS_OUTPUTS = (TensorSpec("output", ("tensor(float)",), 2, {1: SPEAKER_EMBED_DIM}),)


def speech_token_count(mel_frames: int | np.ndarray) -> int | np.ndarray:
    """Tokens the v2 tokenizer emits for ``mel_frames`` valid Whisper frames.

    Two ``Conv1d(kernel=3, stride=2, padding=1)`` layers: ``n -> (n - 1) // 2 + 1`` twice, which equals
    ``ceil(n / 4)`` for ``n >= 1`` (and 0 for 0). Whisper's log-mel has ``n_samples // 160`` frames at
    16 kHz, so a clip of ``s`` seconds gives ``ceil(100 s / 4) = ceil(25 s)`` tokens.
    """
    n = np.asarray(mel_frames, dtype=np.int64)
    once = np.where(n > 0, (n - 1) // 2 + 1, 0)
    twice = np.where(once > 0, (once - 1) // 2 + 1, 0)
    return int(twice) if twice.ndim == 0 else twice


# --------------------------------------------------------------------------------- session helpers


def _open_session(path: str | Path, what: str, intra_op_threads: int, providers: Sequence[Any] | None,
                  spinning: bool = False):
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (a CosyVoice model folder has {what})")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: file is empty (expected the {what} ONNX graph)")
    if intra_op_threads < 0:
        raise ValueError(f"intra_op_threads must be >= 0 (0 = onnxruntime default), got {intra_op_threads}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = int(intra_op_threads)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    ort_spinning(options, spinning)  # idle intra-op threads spin only when told (cosyvoice_triton.threads)
    try:
        return ort.InferenceSession(
            str(path), sess_options=options, providers=list(providers or ["CPUExecutionProvider"])
        )
    except Exception as exc:  # onnxruntime raises its own pybind11 types (InvalidProtobuf, Fail, ...)
        raise CheckpointError(
            f"{path}: onnxruntime cannot load it as the {what} graph ({type(exc).__name__}: {exc})"
        ) from exc


def _check_arg(path: Path, kind: str, index: int, arg: Any, spec: TensorSpec, what: str) -> None:
    problems = []
    if spec.name is not None and arg.name != spec.name:
        problems.append("name")
    if arg.type not in spec.types:
        problems.append("type")
    if arg.shape is not None and len(arg.shape) != spec.rank:
        problems.append("rank")
    elif arg.shape is not None:
        problems += [
            f"size of axis {axis}"
            for axis, size in spec.fixed.items()
            if isinstance(arg.shape[axis], int) and arg.shape[axis] != size
        ]
    if problems:
        shape = "[?]" if arg.shape is None else "[" + ", ".join(str(d) for d in arg.shape) + "]"
        raise CheckpointError(
            f"{path}: {kind} #{index} is {arg.name!r} {arg.type} {shape}, wrong {' and '.join(problems)}: "
            f"the official {what} has {spec.describe()}"
        )


def _check_signature(
    path: Path, session: Any, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], what: str
) -> None:
    got_in = session.get_inputs()
    if len(got_in) != len(inputs):
        names = [a.name for a in got_in]
        raise CheckpointError(
            f"{path}: has {len(got_in)} inputs {names}; the official {what} has {len(inputs)}: "
            + ", ".join(s.describe() for s in inputs)
        )
    for i, (arg, spec) in enumerate(zip(got_in, inputs, strict=True)):
        _check_arg(path, "input", i, arg, spec, what)
    got_out = session.get_outputs()
    for i, spec in enumerate(outputs):
        if i >= len(got_out):
            raise CheckpointError(f"{path}: has no output #{i}; the official {what} has {spec.describe()}")
        _check_arg(path, "output", i, got_out[i], spec, what)


def _open_checked(path: Path, filename: str, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                  intra_op_threads: int, providers: Sequence[Any] | None, produces: str,
                  spinning: bool = False) -> tuple[Any, str | None]:
    """Open an official graph, check its signature and read its stand-in note (logged as a warning).

    Returns ``(session, note)``; ``note`` is None for a real model."""
    session = _open_session(path, filename, intra_op_threads, providers, spinning)
    _check_signature(path, session, inputs, outputs, filename)
    note = _standin_note(session)
    if note:
        log.warning("%s is a stand-in with random weights (%s): %s are noise", path, note, produces)
    return session, note


def _dynamic_batch(arg: Any) -> bool:
    """True when axis 0 of a graph input is symbolic (or unknown) rather than a fixed size."""
    shape = arg.shape
    return shape is None or len(shape) == 0 or not isinstance(shape[0], int)


def _standin_note(session: Any) -> str | None:
    try:
        return session.get_modelmeta().custom_metadata_map.get(STANDIN_METADATA_KEY)
    except Exception:  # pragma: no cover - metadata is optional
        return None


def _check_lengths(lengths: Any, batch: int, max_t: int, what: str) -> np.ndarray:
    if lengths is None:
        return np.full(batch, max_t, dtype=np.int64)
    arr = np.asarray(lengths)
    if arr.shape != (batch,):
        raise ValueError(f"{what}: lengths must have shape ({batch},), got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer) and not np.all(arr == np.round(arr)):
        raise ValueError(f"{what}: lengths must be whole numbers of frames, got {arr}")
    arr = arr.astype(np.int64)
    if np.any(arr < 1):
        raise AudioError(f"{what}: item {int(np.argmin(arr))} has {int(arr.min())} frames (audio is empty)")
    if np.any(arr > max_t):
        i = int(np.argmax(arr))
        raise ValueError(f"{what}: item {i} claims {int(arr[i])} frames but the padded array has {max_t}")
    return arr


def _check_finite(feats: np.ndarray, lengths: np.ndarray, time_axis: int, what: str) -> None:
    for i, n in enumerate(lengths):
        valid = feats[i, :, :n] if time_axis == 2 else feats[i, :n, :]
        if not np.all(np.isfinite(valid)):
            raise AudioError(f"{what}: item {i} has non-finite feature values (NaN/inf)")


def _batches(order: Sequence[int], size: int):
    for start in range(0, len(order), size):
        yield list(order[start : start + size])


# ----------------------------------------------------------------------------------- the tokenizer


class SpeechTokenizer:
    """``speech_tokenizer_v2.onnx`` (``version="v3"``: CosyVoice3's ``speech_tokenizer_v3.onnx``): Whisper log-mel
    ``[B, 128, T]`` to 25 Hz speech tokens.

    ``batching``: ``"auto"`` runs one padded call per chunk of ``max_batch_size`` items when the graph has
    a dynamic batch axis and a load-time probe (two utterances of different lengths, padding filled with
    noise) gives exactly the per-item tokens; ``"never"`` always loops (the official behaviour);
    ``"always"`` skips the probe but still needs a dynamic batch axis.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        intra_op_threads: int = 1,
        spinning: bool = False,
        providers: Sequence[Any] | None = None,
        batching: Batching = "auto",
        max_batch_size: int = 16,
        max_frames: int | None = MAX_TOKENIZER_FRAMES,
        version: str = "v2",
    ):
        if version not in TOKENIZER_VERSIONS:
            raise ValueError(f"version must be one of {', '.join(TOKENIZER_VERSIONS)}, got {version!r}")
        if batching not in ("auto", "never", "always"):
            raise ValueError(f"batching must be 'auto', 'never' or 'always', got {batching!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.path = Path(path)
        self.max_batch_size = int(max_batch_size)
        self.max_frames = max_frames
        self.version = version
        filename, inputs, outputs = TOKENIZER_VERSIONS[version]
        self.session, self.standin = _open_checked(self.path, filename, inputs, outputs, intra_op_threads, providers,
                                                   "tokens", spinning)
        feats_arg, length_arg = self.session.get_inputs()
        self._names = (feats_arg.name, length_arg.name, self.session.get_outputs()[0].name)
        dynamic = _dynamic_batch(feats_arg) and _dynamic_batch(length_arg)
        if batching == "always" and not dynamic:
            raise CheckpointError(
                f"{self.path}: batching='always' but the graph's inputs have a fixed batch axis "
                f"(feats {list(feats_arg.shape)}, feats_length {list(length_arg.shape)})"
            )
        if batching == "never" or not dynamic:
            self.batched = False
        elif batching == "always":
            self.batched = True
        else:
            self.batched = self._probe_batching()
        log.info("%s: %s calls", self.path, "batched" if self.batched else "one-utterance")

    # ------------------------------------------------------------------------------------ running

    def _run(self, feats: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        feats_name, length_name, out_name = self._names  # by position, as the official front end binds them
        out = self.session.run(
            [out_name],
            {
                feats_name: np.ascontiguousarray(feats, dtype=np.float32),
                length_name: np.ascontiguousarray(lengths, dtype=np.int32),
            },
        )[0]
        return np.asarray(out)

    def _run_one(self, feats: np.ndarray, n: int) -> np.ndarray:
        out = self._run(feats[None, :, :n], np.array([n]))
        return out.reshape(-1).astype(np.int32)

    def _run_padded(self, items: list[np.ndarray]) -> list[np.ndarray]:
        padded, lengths = pad_batch(items, time_axis=1)
        out = self._run(padded, lengths)
        if out.ndim != 2 or out.shape[0] != len(items):
            raise CheckpointError(
                f"{self.path}: a batched call returned shape {out.shape} for {len(items)} items"
            )
        counts = speech_token_count(lengths)
        return [out[i, : int(c)].astype(np.int32) for i, c in enumerate(counts)]

    def _probe_batching(self) -> bool:
        rng = np.random.default_rng(1234)
        lengths = (23, 150)
        items = [rng.normal(0.0, 0.5, (WHISPER_MEL_BINS, n)).astype(np.float32) for n in lengths]
        try:
            alone = [self._run_one(x, x.shape[1]) for x in items]
            # Padding filled with noise, not zeros: a graph that ignores feats_length must fail the probe.
            noisy = np.asarray(rng.normal(0.0, 0.5, (2, WHISPER_MEL_BINS, max(lengths))), dtype=np.float32)
            for row, x in zip(noisy, items, strict=True):
                row[:, : x.shape[1]] = x
            out = self._run(noisy, np.array(lengths))
            together = [out[i, : int(speech_token_count(n))] for i, n in enumerate(lengths)]
        except Exception as exc:  # a Reshape baked for batch 1 fails here
            log.info("%s: batched probe failed (%s: %s); running one utterance per call",
                     self.path, type(exc).__name__, exc)
            return False
        same = all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(alone, together, strict=True))
        if not same:
            log.info("%s: padded batch differs from per-utterance tokens; running one per call", self.path)
        return same

    def tokenize(
        self, feats: np.ndarray, lengths: np.ndarray | Sequence[int] | None = None
    ) -> list[np.ndarray]:
        """Tokens of each utterance: ``feats [B, 128, T]`` float32 (zero-padded past each valid length),
        ``lengths [B]`` valid frames (``None``: all ``T``). Returns ``B`` int32 arrays of
        ``speech_token_count(lengths[i])`` tokens in ``[0, 6561)``."""
        feats = np.asarray(feats, dtype=np.float32)
        if feats.ndim != 3 or feats.shape[1] != WHISPER_MEL_BINS:
            raise ValueError(f"tokenize: feats must be [B, {WHISPER_MEL_BINS}, T], got shape {feats.shape}")
        batch, _, max_t = feats.shape
        lengths = _check_lengths(lengths, batch, max_t, "tokenize")
        if self.max_frames is not None and batch and int(lengths.max()) > self.max_frames:
            i = int(np.argmax(lengths))
            raise AudioError(
                f"tokenize: item {i} has {int(lengths[i])} mel frames ({lengths[i] / 100:.2f} s); the speech "
                f"tokenizer supports at most {self.max_frames} frames ({self.max_frames / 100:g} s)"
            )
        _check_finite(feats, lengths, 2, "tokenize")
        if not self.batched:
            return [self._run_one(feats[i], int(n)) for i, n in enumerate(lengths)]
        result: list[np.ndarray | None] = [None] * batch
        order = sorted(range(batch), key=lambda i: int(lengths[i]))  # similar lengths share a call
        for chunk in _batches(order, self.max_batch_size):
            outs = self._run_padded([feats[i, :, : int(lengths[i])] for i in chunk])
            for i, tokens in zip(chunk, outs, strict=True):
                result[i] = tokens
        return result  # type: ignore[return-value]


# ------------------------------------------------------------------------------- the speaker model


class SpeakerEncoder:
    """``campplus.onnx``: Kaldi fbank ``[B, T, 80]`` to 192-d speaker embeddings.

    The official front end subtracts the per-utterance mean over time before the graph; so does
    :meth:`embed` (on the valid frames) when ``subtract_mean`` is true, which is harmless for features
    that are already mean-normalised (subtracting a zero mean changes nothing). Utterances of equal
    length share one call when the graph's batch axis is dynamic (``batching="auto"``); everything else
    runs one utterance per call, as CAM++'s statistics pooling would see padding as speech.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        intra_op_threads: int = 1,
        spinning: bool = False,
        providers: Sequence[Any] | None = None,
        batching: Literal["auto", "never"] = "auto",
        max_batch_size: int = 16,
        subtract_mean: bool = True,
    ):
        if batching not in ("auto", "never"):
            raise ValueError(f"batching must be 'auto' or 'never', got {batching!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.path = Path(path)
        self.max_batch_size = int(max_batch_size)
        self.subtract_mean = bool(subtract_mean)
        self.session, self.standin = _open_checked(self.path, CAMPPLUS_FILENAME, CAMPPLUS_INPUTS,
                                                   CAMPPLUS_OUTPUTS, intra_op_threads, providers, "embeddings",
                                                   spinning)
        self.batched = batching == "auto" and _dynamic_batch(self.session.get_inputs()[0])

    def _run(self, feats: np.ndarray) -> np.ndarray:
        out = self.session.run([CAMPPLUS_OUTPUTS[0].name], {"input": np.ascontiguousarray(feats)})[0]
        out = np.asarray(out, dtype=np.float32).reshape(feats.shape[0], -1)
        if out.shape[1] != SPEAKER_EMBED_DIM:
            raise CheckpointError(
                f"{self.path}: returned {out.shape[1]}-d embeddings, expected {SPEAKER_EMBED_DIM}"
            )
        return out

    def embed(self, feats: np.ndarray, lengths: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
        """Embeddings ``[B, 192]`` float32 of ``feats [B, T, 80]`` with ``lengths [B]`` valid frames
        (``None``: all ``T``); frames past an item's length are ignored."""
        feats = np.asarray(feats, dtype=np.float32)
        if feats.ndim != 3 or feats.shape[2] != FBANK_BINS:
            raise ValueError(f"embed: feats must be [B, T, {FBANK_BINS}], got shape {feats.shape}")
        batch, max_t, _ = feats.shape
        lengths = _check_lengths(lengths, batch, max_t, "embed")
        _check_finite(feats, lengths, 1, "embed")
        items = []
        for i, n in enumerate(lengths):
            x = feats[i, : int(n)]
            if self.subtract_mean:
                x = x - x.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32)
            items.append(x)
        result = np.zeros((batch, SPEAKER_EMBED_DIM), dtype=np.float32)
        if not self.batched:
            for i, x in enumerate(items):
                result[i] = self._run(x[None])[0]
            return result
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(int(n), []).append(i)
        for members in groups.values():
            for chunk in _batches(members, self.max_batch_size):
                result[chunk] = self._run(np.stack([items[i] for i in chunk]))
        return result
