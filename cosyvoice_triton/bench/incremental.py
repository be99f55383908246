"""Streaming token-to-wav with and without the incremental flow, either family.

``python -m cosyvoice_triton.bench.incremental --model-dir DIR [--tokens 125 --prompt-tokens 75 --rounds 3]``
runs the streaming token-to-wav of the folder's family on random tokens (a ``--tokens`` / 25 s answer after a
``--prompt-tokens`` / 25 s prompt), the two paths interleaved round by round, and prints the median seconds of each
(whole stream, each chunk from the end of the one before, and the flow alone where the family's path times it),
their ratio, and the largest difference of the audio.
CosyVoice2: :meth:`~cosyvoice_triton.pipeline.CosyVoice2.token2wav_stream`
(:mod:`~cosyvoice_triton.models.incremental`); CosyVoice3: :meth:`~cosyvoice_triton.models.cosyvoice3.token2wav.
Token2Wav3.token2wav_stream` with and without a :class:`~cosyvoice_triton.models.cosyvoice3.incremental.
Flow3StreamState` (:mod:`~cosyvoice_triton.models.cosyvoice3.incremental`; the vocoder on its bounded window too).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ..family import COSYVOICE3, model_family
from ..threads import configure
from . import load_average


def _inputs(tokens: int, prompt_tokens: int):
    from ..prompt_frontend import VCInputs

    rng = np.random.default_rng(0)
    return VCInputs(source_tokens=rng.integers(0, 6561, tokens).astype(np.int32),
                    prompt_tokens=rng.integers(0, 6561, prompt_tokens).astype(np.int32),
                    prompt_mel=rng.standard_normal((2 * prompt_tokens, 80)).astype(np.float32),
                    embedding=rng.standard_normal(192).astype(np.float32))


def _timed(chunks) -> tuple[np.ndarray, list[float]]:
    """The concatenated chunks and the seconds each took from the end of the one before."""
    out, seconds, last = [], [], time.perf_counter()
    for chunk in chunks:
        now = time.perf_counter()
        out.append(chunk)
        seconds.append(now - last)
        last = now
    return np.concatenate(out), seconds


def _cosyvoice2(model_dir: str, inputs, state_mb: float | None):
    from ..models.incremental import cache_bytes_per_frame
    from ..pipeline import CosyVoice2, StageTimer

    model = CosyVoice2.from_pretrained(model_dir, tts=False)
    if state_mb is not None:
        model.incremental_cache_bytes = int(state_mb * 2**20)

    def stream(incremental: bool) -> tuple[np.ndarray, float, list[float]]:
        model.incremental_stream = incremental
        timer = StageTimer()
        audio, chunk_s = _timed(model.token2wav_stream(inputs, timer=timer))
        return audio, timer.seconds["flow.encoder"] + timer.seconds["flow.solver"], chunk_s

    ends = model.stream_chunk_ends(len(inputs.source_tokens), len(inputs.prompt_tokens))
    return stream, ends, cache_bytes_per_frame(model.config.flow)


def _cosyvoice3(model_dir: str, inputs, state_mb: float | None):
    from ..models.cosyvoice3.incremental import DEFAULT_MAX_BYTES, Flow3StreamState, cache_bytes_per_frame3
    from ..models.cosyvoice3.pipeline import CosyVoice3

    t2w = CosyVoice3.from_pretrained(model_dir, tts=False).token2wav_model

    def stream(incremental: bool) -> tuple[np.ndarray, float, list[float]]:
        cap = DEFAULT_MAX_BYTES if state_mb is None else int(state_mb * 2**20)
        state = Flow3StreamState(cap) if incremental else None
        chunks = t2w.token2wav_stream(inputs.source_tokens.tolist(), inputs.prompt_tokens, inputs.prompt_mel,
                                      inputs.embedding, state=state)
        audio, chunk_s = _timed(chunks)
        return audio, float("nan"), chunk_s

    ends = t2w.stream_chunk_ends(len(inputs.source_tokens), len(inputs.prompt_tokens))
    return stream, ends, cache_bytes_per_frame3(t2w.flow.dims)


def run(model_dir: str, *, tokens: int = 125, prompt_tokens: int = 75, rounds: int = 3, threads: int | None = None,
        state_mb: float | None = None) -> dict:
    configure(threads or None)
    family = model_family(model_dir)
    make = _cosyvoice3 if family == COSYVOICE3 else _cosyvoice2
    stream, ends, per_frame = make(model_dir, _inputs(tokens, prompt_tokens), state_mb)
    times: dict[bool, list[float]] = {True: [], False: []}
    flow: dict[bool, list[float]] = {True: [], False: []}
    chunks: dict[bool, list[list[float]]] = {True: [], False: []}
    audio: dict[bool, np.ndarray] = {}
    for _ in range(rounds):
        for incremental in (False, True):
            start = time.perf_counter()
            audio[incremental], flow_s, chunk_s = stream(incremental)
            times[incremental].append(time.perf_counter() - start)
            flow[incremental].append(flow_s)
            chunks[incremental].append(chunk_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_flow = {k: statistics.median(v) for k, v in flow.items()}
    med_chunks = {k: [statistics.median(c) for c in zip(*v, strict=True)] for k, v in chunks.items()}
    diff = float(np.abs(audio[True] - audio[False]).max() / max(np.abs(audio[False]).max(), 1e-30))
    return {"family": family, "chunk_ends": ends, "recompute_s": med[False], "incremental_s": med[True],
            "ratio": med[False] / med[True], "flow_recompute_s": med_flow[False],
            "flow_incremental_s": med_flow[True], "flow_ratio": med_flow[False] / med_flow[True],
            "chunk_recompute_s": med_chunks[False], "chunk_incremental_s": med_chunks[True],
            "audio_rel_diff": diff, "cache_mb_per_frame": per_frame / 1e6}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tokens", type=int, default=125)
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--state-mb", type=float, default=None,
                    help="cap of one stream's state in MiB (default: the library's; past it a stream recomputes)")
    a = ap.parse_args(argv)
    r = run(a.model_dir, tokens=a.tokens, prompt_tokens=a.prompt_tokens, rounds=a.rounds, threads=a.threads,
          state_mb=a.state_mb)
    print(f"{r['family']}: chunks end at {r['chunk_ends']} (+ final); median of {a.rounds} interleaved rounds; "
          f"load average {load_average()}")
    print(f"whole stream: recompute {r['recompute_s']:.2f} s, incremental {r['incremental_s']:.2f} s, "
          f"{r['ratio']:.2f}x")
    for i, (old, new) in enumerate(zip(r["chunk_recompute_s"], r["chunk_incremental_s"], strict=True)):
        last = i == len(r["chunk_recompute_s"]) - 1
        print(f"chunk {i + 1}{' (final)' if last else '        '}: recompute {old:.2f} s, incremental {new:.2f} s, "
              f"{old / new:.2f}x")
    if not np.isnan(r["flow_ratio"]):
        print(f"flow only:    recompute {r['flow_recompute_s']:.2f} s, incremental {r['flow_incremental_s']:.2f} s, "
              f"{r['flow_ratio']:.2f}x")
    cap = "the library's default" if a.state_mb is None else f"{a.state_mb:g} MiB"
    print(f"audio: largest difference {r['audio_rel_diff']:.2e} of the peak; cached state "
          f"{r['cache_mb_per_frame']:.2f} MB per mel frame, capped at {cap} per stream")


if __name__ == "__main__":
    main()
