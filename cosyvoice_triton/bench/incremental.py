"""Streaming token-to-wav with and without the incremental flow (:mod:`~cosyvoice_triton.models.incremental`).

``python -m cosyvoice_triton.bench.incremental --model-dir DIR [--tokens 125 --prompt-tokens 75 --rounds 3]``
runs :meth:`~cosyvoice_triton.pipeline.CosyVoice2.token2wav_stream` on random tokens (a ``--tokens`` / 25 s
answer after a ``--prompt-tokens`` / 25 s prompt), the two paths interleaved round by round, and prints the
median seconds of each (whole stream and flow only), their ratio, and the largest difference of the audio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ..models.incremental import cache_bytes_per_frame
from ..pipeline import CosyVoice2, StageTimer, VCInputs
from ..threads import configure


def run(model_dir: str, *, tokens: int = 125, prompt_tokens: int = 75, rounds: int = 3, threads: int | None = None
        ) -> dict:
    configure(threads or None)
    model = CosyVoice2.from_pretrained(model_dir, tts=False)
    rng = np.random.default_rng(0)
    inputs = VCInputs(source_tokens=rng.integers(0, 6561, tokens).astype(np.int32),
                      prompt_tokens=rng.integers(0, 6561, prompt_tokens).astype(np.int32),
                      prompt_mel=rng.standard_normal((2 * prompt_tokens, 80)).astype(np.float32),
                      embedding=rng.standard_normal(192).astype(np.float32))
    times: dict[bool, list[float]] = {True: [], False: []}
    flow: dict[bool, list[float]] = {True: [], False: []}
    audio: dict[bool, np.ndarray] = {}
    for _ in range(rounds):
        for incremental in (False, True):
            model.incremental_stream = incremental
            timer = StageTimer()
            start = time.perf_counter()
            audio[incremental] = np.concatenate(list(model.token2wav_stream(inputs, timer=timer)))
            times[incremental].append(time.perf_counter() - start)
            flow[incremental].append(timer.seconds["flow.encoder"] + timer.seconds["flow.solver"])
    med = {k: statistics.median(v) for k, v in times.items()}
    med_flow = {k: statistics.median(v) for k, v in flow.items()}
    diff = float(np.abs(audio[True] - audio[False]).max() / max(np.abs(audio[False]).max(), 1e-30))
    return {"chunk_ends": model.stream_chunk_ends(tokens, prompt_tokens), "recompute_s": med[False],
            "incremental_s": med[True], "ratio": med[False] / med[True], "flow_recompute_s": med_flow[False],
            "flow_incremental_s": med_flow[True], "flow_ratio": med_flow[False] / med_flow[True],
            "audio_rel_diff": diff, "cache_mb_per_frame": cache_bytes_per_frame(model.config.flow) / 1e6}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tokens", type=int, default=125)
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    r = run(a.model_dir, tokens=a.tokens, prompt_tokens=a.prompt_tokens, rounds=a.rounds, threads=a.threads)
    print(f"chunks end at {r['chunk_ends']} (+ final); median of {a.rounds} interleaved rounds")
    print(f"whole stream: recompute {r['recompute_s']:.2f} s, incremental {r['incremental_s']:.2f} s, "
          f"{r['ratio']:.2f}x")
    print(f"flow only:    recompute {r['flow_recompute_s']:.2f} s, incremental {r['flow_incremental_s']:.2f} s, "
          f"{r['flow_ratio']:.2f}x")
    print(f"audio: largest difference {r['audio_rel_diff']:.2e} of the peak; cached state "
          f"{r['cache_mb_per_frame']:.2f} MB per mel frame")


if __name__ == "__main__":
    main()
