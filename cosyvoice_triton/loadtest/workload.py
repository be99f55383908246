"""The load test's audio: real speech from espeak-ng (:mod:`cosyvoice_triton.export.speech_corpus`).

Sources of varied lengths (3-7 s, about 5 s on average) in several languages and voices, and one prompt of 3 s
in another voice. Synthesised once and cached in an ``.npz`` that every Locust process loads. The TTS columns
speak :data:`TTS_TEXTS` in turn in the prompt's voice (zero-shot, with :data:`TTS_PROMPT_TEXT` as its transcript).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["TTS_PROMPT_TEXT", "TTS_TEXTS", "Item", "Workload", "build_workload", "load_workload"]

#: What the TTS columns speak, in turn: English sentences of 6-17 words (the LM's work grows with the text tokens).
TTS_TEXTS = (
    "Hello there, this is a short test.",
    "The weather is lovely today, so we are going for a walk by the river.",
    "Please read the next sentence slowly and clearly.",
    "A streaming voice answers while the rest of the sentence is still being generated.",
    "Thank you for calling, how can I help you today?",
    "Seven large boxes arrived this morning, and two of them were already open.",
)
#: The prompt's transcript for zero-shot TTS. The prompt is cut from longer espeak-ng speech, so this is a
#: stand-in of a plausible length (the LM reads its tokens as context): the demo models have random weights.
TTS_PROMPT_TEXT = "Here is a short sample of my voice."


@dataclass(frozen=True)
class Item:
    source: np.ndarray  # float32 mono
    source_sr: int
    prompt: np.ndarray
    prompt_sr: int
    text: str = ""  # what a TTS column speaks
    prompt_text: str = ""

    @property
    def source_seconds(self) -> float:
        return len(self.source) / self.source_sr


@dataclass(frozen=True)
class Workload:
    sources: tuple[np.ndarray, ...]
    source_rates: tuple[int, ...]
    prompt: np.ndarray
    prompt_sr: int
    descriptions: tuple[str, ...] = ()
    texts: tuple[str, ...] = TTS_TEXTS
    prompt_text: str = TTS_PROMPT_TEXT

    def __len__(self) -> int:
        return len(self.sources)

    def item(self, i: int) -> Item:
        k = i % len(self.sources)
        return Item(self.sources[k], self.source_rates[k], self.prompt, self.prompt_sr,
                    self.texts[i % len(self.texts)] if self.texts else "", self.prompt_text)

    @property
    def source_seconds(self) -> list[float]:
        return [len(s) / r for s, r in zip(self.sources, self.source_rates, strict=True)]

    @property
    def prompt_seconds(self) -> float:
        return len(self.prompt) / self.prompt_sr

    def describe(self) -> str:
        secs = self.source_seconds
        return (f"{len(secs)} espeak-ng sources of {min(secs):.1f}-{max(secs):.1f} s (mean {np.mean(secs):.2f} s), "
                f"prompt {self.prompt_seconds:.1f} s")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f"source_{i}": s for i, s in enumerate(self.sources)}
        np.savez(path, source_rates=np.array(self.source_rates, np.int64), prompt=self.prompt,
                 prompt_sr=np.array(self.prompt_sr, np.int64), descriptions=np.array(self.descriptions, dtype=str),
                 texts=np.array(self.texts, dtype=str), prompt_text=np.array(self.prompt_text, dtype=str), **arrays)
        return path


def load_workload(path: str | Path) -> Workload:
    with np.load(path, allow_pickle=False) as z:
        rates = tuple(int(r) for r in z["source_rates"])
        sources = tuple(z[f"source_{i}"].astype(np.float32) for i in range(len(rates)))
        extra = {}
        if "texts" in z.files:  # written before the TTS columns: the defaults
            extra = {"texts": tuple(str(t) for t in z["texts"]), "prompt_text": str(z["prompt_text"])}
        return Workload(sources, rates, z["prompt"].astype(np.float32), int(z["prompt_sr"]),
                        tuple(str(d) for d in z["descriptions"]), **extra)


def build_workload(n_sources: int = 16, *, min_seconds: float = 3.0, max_seconds: float = 7.0,
                   prompt_seconds: float = 3.0, seed: int = 0) -> Workload:
    """``n_sources`` espeak-ng utterances whose lengths spread evenly over ``min_seconds``-``max_seconds`` (mean
    near the middle: ~5 s by default), and a prompt cut to ``prompt_seconds`` from another utterance.

    Candidates come from both corpus splits (a load test has no held-out concern); for each of ``n_sources``
    evenly spaced target lengths the nearest unused candidate is taken, so lengths vary but the mean is stable.
    """
    from ..export.speech_corpus import utterances

    pool = [u for split in ("heldout", "calibration")
            for u in utterances(3 * n_sources, split=split, seed=seed, min_seconds=min_seconds,
                                max_seconds=max_seconds)]
    step = (max_seconds - min_seconds) / n_sources
    targets = [min_seconds + step * (i + 0.5) for i in range(n_sources)]
    chosen = []
    for t in targets:
        best = min((u for u in pool if not any(u is c for c in chosen)), key=lambda u, t=t: abs(u.seconds - t))
        chosen.append(best)
    order = np.random.default_rng(seed).permutation(len(chosen))  # lengths mixed in the request order
    chosen = [chosen[i] for i in order]
    prompt = utterances(1, split="calibration", seed=seed + 1, min_seconds=prompt_seconds, max_seconds=12.0)[0]
    cut = prompt.wave[: round(prompt_seconds * prompt.sample_rate)].astype(np.float32)
    return Workload(tuple(u.wave.astype(np.float32) for u in chosen), tuple(u.sample_rate for u in chosen), cut,
                    prompt.sample_rate,
                    tuple(f"{u.voice} {u.speed_wpm} wpm {u.seconds:.1f} s: {u.text[:40]}" for u in chosen))


def fixture_workload(fixtures: str | Path, *, n_sources: int = 8, min_seconds: float = 3.0,
                     max_seconds: float = 5.0) -> Workload:
    """Without espeak-ng: the test fixtures' speech (``source_en_5s.wav`` cut to lengths spread over
    ``min_seconds``-``max_seconds``, and ``speech_engb_16k.wav``) with ``prompt_en_3s.wav`` as the prompt."""
    import soundfile as sf

    fixtures = Path(fixtures)
    src, ssr = sf.read(fixtures / "source_en_5s.wav", dtype="float32")
    other, osr = sf.read(fixtures / "speech_engb_16k.wav", dtype="float32")
    prm, psr = sf.read(fixtures / "prompt_en_3s.wav", dtype="float32")
    lengths = np.linspace(min_seconds, min(max_seconds, len(src) / ssr), max(1, n_sources - 1))
    sources = [src[: round(s * ssr)] for s in lengths] + [other]
    rates = [ssr] * len(lengths) + [osr]
    return Workload(tuple(sources), tuple(rates), prm, psr,
                    tuple(f"fixture {len(s) / r:.1f} s" for s, r in zip(sources, rates, strict=True)))


def cached_workload(path: str | Path, *, fixtures: str | Path | None = None, **kwargs) -> Workload:
    """:func:`build_workload`, synthesised once into ``path`` and loaded from there afterwards; without
    espeak-ng, :func:`fixture_workload` of ``fixtures`` (when given) instead."""
    from ..export.speech_corpus import espeak_available

    path = Path(path)
    if path.is_file():
        return load_workload(path)
    if not espeak_available() and fixtures is not None:
        wl = fixture_workload(fixtures)
    else:
        wl = build_workload(**kwargs)
    wl.save(path)
    return wl
