"""What another streaming schedule costs and gives: first chunk and distance from the official schedule's output.

    python -m cosyvoice_triton.bench.stream_schedule [--model-dir DIR] [--profile 10,5,100] [--tokens 200]

On a model folder (default: a tiny demo folder, written once), the speech tokens of a voice conversion (random
tokens and prompt by default, seeded) are streamed with the official schedule and with each ``--profile``
(``FIRST_HOP,GROWTH,MAX_HOP``: :class:`~cosyvoice_triton.streaming.StreamSchedule`). Printed per schedule: the
hops, the tokens the first chunk waits for (its hop and pad plus the flow's look-ahead) and that in seconds of
speech (25 tokens/s), the seconds the first chunk takes here once its tokens are there (flow + HiFT), and the
log-mel distance of the whole output from the official schedule's output (mean absolute difference of the
CosyVoice log-mels, natural log; the same seed). Figures from this machine, not assertions.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ..streaming import StreamSchedule

TOKEN_RATE = 25


def parse_profile(text: str) -> StreamSchedule:
    try:
        first, growth, max_hop = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a profile is FIRST_HOP,GROWTH,MAX_HOP (integers), got {text!r}") from None
    return StreamSchedule(first, growth, max_hop)


def measure(model, inputs, schedules: list[StreamSchedule], *, seed: int = 0) -> list[dict]:
    """One row per schedule (the first is the reference of the log-mel distance)."""
    from ..frontend.features import cosyvoice_mel

    rows, ref_mel = [], None
    n_prompt, lookahead = len(inputs.prompt_tokens), model.flow.pre_lookahead_len
    for schedule in schedules:
        t0 = time.perf_counter()
        chunks = model.token2wav_stream(inputs, seed=seed, schedule=schedule)
        first = next(chunks)
        first_s = time.perf_counter() - t0
        wave = np.concatenate([first, *chunks])
        mel = cosyvoice_mel(wave, sample_rate=model.config.sample_rate, config=model.config.mel)
        if ref_mel is None:
            ref_mel = mel
        frames = min(mel.shape[-1], ref_mel.shape[-1])
        ends = model.stream_chunk_ends(len(inputs.source_tokens), n_prompt, schedule=schedule)
        wait = schedule.first_chunk(n_prompt) + lookahead if ends else len(inputs.source_tokens)
        rows.append({"schedule": (schedule.first_hop, schedule.growth, schedule.max_hop), "chunk_ends": ends,
                     "first_chunk_tokens": wait, "first_chunk_audio_s": wait / TOKEN_RATE,
                     "first_chunk_compute_s": first_s, "samples": int(wave.size),
                     "log_mel_distance": float(np.abs(mel[..., :frames] - ref_mel[..., :frames]).mean())})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("build/demo-tiny"))
    ap.add_argument("--profile", type=parse_profile, action="append", default=None,
                    help="FIRST_HOP,GROWTH,MAX_HOP (repeatable; default: 10,5,100 and 5,5,100)")
    ap.add_argument("--tokens", type=int, default=200, help="speech tokens to stream")
    ap.add_argument("--prompt-tokens", type=int, default=63)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from ..models.demo import write_demo_model
    from ..pipeline import CosyVoice2, VCInputs

    if not (args.model_dir / "flow.pt").is_file():
        write_demo_model(args.model_dir, size="tiny", seed=0)
    model = CosyVoice2.from_pretrained(args.model_dir, tts=False)
    g = np.random.default_rng(args.seed)
    vocab = model.config.flow.vocab_size
    inputs = VCInputs(source_tokens=g.integers(0, vocab, args.tokens).astype(np.int32),
                      prompt_tokens=g.integers(0, vocab, args.prompt_tokens).astype(np.int32),
                      prompt_mel=g.normal(-6, 2, (2 * args.prompt_tokens, 80)).astype(np.float32),
                      embedding=g.normal(size=192).astype(np.float32))
    profiles = args.profile or [StreamSchedule(10, 5, 100), StreamSchedule(5, 5, 100)]
    model.token2wav_stream(inputs, seed=args.seed).__next__()  # warm-up
    rows = measure(model, inputs, [StreamSchedule(), *profiles], seed=args.seed)
    print(f"{args.model_dir}: {args.tokens} speech tokens after a prompt of {args.prompt_tokens} (loaded machine: "
          "the seconds are indicative)")
    print(f"{'first,growth,max':>17} {'first chunk waits for':>24} {'first chunk compute':>20} "
          f"{'log-mel distance':>17}  chunk ends")
    for r in rows:
        print(f"{','.join(map(str, r['schedule'])):>17} {r['first_chunk_tokens']:>6} tok = "
              f"{r['first_chunk_audio_s']:5.2f} s speech {r['first_chunk_compute_s']:>17.3f} s "
              f"{r['log_mel_distance']:>17.4f}  {r['chunk_ends']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
