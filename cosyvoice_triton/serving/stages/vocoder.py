"""``hift``: mel to 24 kHz waveform with seeded NSF noise, the two HiFT graphs as callables.

Per utterance, exactly ``CosyVoice2.token2wav``'s HiFT call (``HiFTGenerator.inference`` with a generator
seeded with ``seed``, no cache): the noise is drawn as :meth:`HiFTGenerator.draw_noise
<cosyvoice_triton.models.hift.HiFTGenerator.draw_noise>` draws it for batch 1 (:func:`nsf_noise`), then
``hift_source(mel, nsf_noise) -> source`` and ``hift_decoder(mel, source) -> waveform``.

HiFT is not padding-invariant (its non-causal convolutions let padding reach the last ~12 frames of an item),
so :class:`HiftRunner` batches only utterances of equal mel length: one source call and one decoder call per
length group. Padding with real context and dropping the tail was the other option; it would need a second
context-sized tail per item and still differ from the solo run in float rounding, so equal lengths it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...errors import CosyVoiceError
from ...models.hift import draw_nsf_noise
from ...shapes import GRAPHS, NSF_HARMONICS, SAMPLES_PER_MEL_FRAME
from .batching import ItemResult, RequestError, chunks_by_rows, group_by, run_per_item
from .flow import GraphFn

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SEED", "HiftRunner", "nsf_noise", "parse_seed"]

DEFAULT_SEED = 0
_SEED_MAX = 2**63 - 1


def nsf_noise(frames: int, seed: int, *, upsample: int = SAMPLES_PER_MEL_FRAME,
              harmonics: int = NSF_HARMONICS) -> np.ndarray:
    """``[1, upsample * frames, harmonics]`` float32: what ``HiFTGenerator.draw_noise(1, frames, generator)``
    returns for a CPU generator seeded with ``seed`` (the same three draws, in order)."""
    gen = torch.Generator().manual_seed(int(seed))
    return draw_nsf_noise(1, frames, upsample=upsample, harmonics=harmonics, generator=gen).numpy()


def parse_seed(value, *, name: str = "seed") -> int:
    """A seed from a tensor (``[1, 1]`` int), a request parameter (int or numeric string) or None (default)."""
    if value is None:
        return DEFAULT_SEED
    if isinstance(value, np.ndarray):
        if value.size != 1 or value.dtype.kind not in "iu":
            raise RequestError(f"{name}: expected one integer, got {value.dtype} of shape {list(value.shape)}")
        value = value.reshape(()).item()
    if isinstance(value, bool):
        raise RequestError(f"{name}: expected an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise RequestError(f"{name}: expected an integer, got {value!r}") from None
    if not isinstance(value, (int, np.integer)):
        raise RequestError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if not 0 <= value <= _SEED_MAX:
        raise RequestError(f"{name}: {value} is outside 0..2**63-1")
    return value


class HiftRunner:
    """Mel ``[80, T]`` + seed -> waveform ``[480 T]`` for a batch of utterances (equal lengths share calls)."""

    def __init__(self, *, max_batch: int | None = None):
        self.max_batch = int(max_batch or min(GRAPHS["hift_source"].max_batch_size,
                                              GRAPHS["hift_decoder"].max_batch_size))
        self.max_frames = min(GRAPHS["hift_source"].axes["mel_frames"].max,
                              GRAPHS["hift_decoder"].axes["mel_frames"].max)
        self.min_frames = max(GRAPHS["hift_source"].axes["mel_frames"].min,
                              GRAPHS["hift_decoder"].axes["mel_frames"].min)

    def check(self, mel: np.ndarray) -> np.ndarray:
        mel = np.asarray(mel)
        if mel.ndim == 3 and mel.shape[0] == 1:
            mel = mel[0]
        if mel.ndim != 2 or mel.shape[0] != 80:
            raise RequestError(f"hift: mel must be one utterance [1, 80, T], got shape {list(mel.shape)}")
        if mel.shape[1] < 1:
            raise RequestError("hift: mel has no frames")
        if mel.shape[1] > self.max_frames:
            raise RequestError(f"hift: {mel.shape[1]} mel frames exceed the maximum {self.max_frames}")
        if not np.isfinite(mel).all():
            raise RequestError("hift: mel has non-finite values")
        return np.ascontiguousarray(mel, dtype=np.float32)

    def run(self, mels: Sequence[np.ndarray], seeds: Sequence[int], source: GraphFn, decoder: GraphFn
            ) -> list[ItemResult[np.ndarray]]:
        """Waveform ``[480 T_i]`` float32 per item (or its error)."""
        results: list[ItemResult[np.ndarray]] = [ItemResult() for _ in mels]
        checked: dict[int, np.ndarray] = {}
        for i, mel in enumerate(mels):
            try:
                checked[i] = self.check(mel)
            except CosyVoiceError as exc:
                results[i] = ItemResult(error=exc)
        good = sorted(checked)
        groups = group_by(checked[i].shape[1] for i in good)
        for members in groups.values():
            members = [good[j] for j in members]
            for chunk in chunks_by_rows(members, [1] * (max(members) + 1), self.max_batch):
                outs = self._run_isolated([checked[i] for i in chunk], [seeds[i] for i in chunk], source, decoder)
                for i, res in zip(chunk, outs, strict=True):
                    results[i] = res
        return results

    def _run_isolated(self, mels: list[np.ndarray], seeds: list[int], source: GraphFn, decoder: GraphFn
                      ) -> list[ItemResult[np.ndarray]]:
        """One group call; if it raises, each item alone, so that one item's failure is its own."""
        try:
            return [ItemResult(w) for w in self._run_group(mels, seeds, source, decoder)]
        except Exception as exc:
            if len(mels) == 1:
                return [ItemResult(error=exc)]
            log.warning("hift: group of %d failed (%s: %s); running the items one by one", len(mels),
                        type(exc).__name__, exc)
        return [r for m, s in zip(mels, seeds, strict=True) for r in self._run_isolated([m], [s], source, decoder)]

    def run_tensors(self, requests: Sequence[Mapping[str, Any]], source: GraphFn, decoder: GraphFn, *,
                    default_seed: int = DEFAULT_SEED) -> list[ItemResult[np.ndarray]]:
        """:meth:`run` on each request's ``mel`` and ``seed`` tensors; the seed falls back to the request
        parameter ``seed`` (``parameters``), then to ``default_seed``."""
        def seed_of(req):
            if req.get("seed") is not None:
                return parse_seed(req["seed"])
            params = req.get("parameters") or {}
            return parse_seed(params["seed"], name="parameter seed") if "seed" in params else int(default_seed)

        seeds = run_per_item(requests, seed_of)
        good = [i for i, r in enumerate(seeds) if r.ok]
        results: list[ItemResult[np.ndarray]] = list(seeds)
        for i in good:
            if requests[i].get("mel") is None:
                results[i] = ItemResult(error=RequestError("hift: missing input 'mel'"))
        good = [i for i in good if requests[i].get("mel") is not None]
        out = self.run([requests[i]["mel"] for i in good], [seeds[i].value for i in good], source, decoder)
        for i, r in zip(good, out, strict=True):
            results[i] = r
        return results

    def _run_group(self, mels: list[np.ndarray], seeds: list[int], source: GraphFn, decoder: GraphFn
                   ) -> list[np.ndarray]:
        frames = mels[0].shape[1]
        real = max(frames, self.min_frames)
        mel = np.stack(mels)
        if real != frames:  # below the graphs' minimum length: pad, and drop what the padding produced
            log.debug("hift: %d frames padded to the graphs' minimum %d", frames, real)
            mel = np.pad(mel, ((0, 0), (0, 0), (0, real - frames)), mode="edge")
        noise = np.concatenate([nsf_noise(real, s) for s in seeds])
        src = source({"mel": mel, "nsf_noise": noise})["source"]
        wave = decoder({"mel": mel, "source": np.ascontiguousarray(src, dtype=np.float32)})["waveform"]
        n = frames * SAMPLES_PER_MEL_FRAME
        return [np.ascontiguousarray(wave[i, :n], dtype=np.float32) for i in range(len(mels))]
