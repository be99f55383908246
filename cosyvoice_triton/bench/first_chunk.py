"""First streamed chunk at concurrency 1, in process: streaming TTS for a registered speaker and streaming VC.

Part of ``make bench-tts``. Each scenario runs ``rounds`` times after one cold call; the best round is the figure
and its breakdown is the stage timer's (:class:`~cosyvoice_triton.pipeline.StageTimer`) up to the first chunk:

- TTS: the speaker's state (LM prefix and flow prompt state: cold on the first call, a lookup after), the LM's
  prefill (measured on its own, with the prefix), the first hop's speech tokens, flow encoder + solver, HiFT;
- VC: the front end (source tokenizer, prompt features: from the prompt cache after the first call), flow, HiFT.

In process there is no transport; the served path adds gRPC framing and the BLS hops (``make bench-live``,
``make loadtest`` measure it). Figures, not assertions.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

TARGET_FIRST_CHUNK_S = 1.5
TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet green forest "
        "behind the old house.")
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."


def _fixtures() -> Path:
    from ..resources import path as resource_path

    return resource_path("tests/fixtures")


def _first(chunks, timer) -> tuple[float, dict[str, float], int]:
    t0 = time.perf_counter()
    first = next(chunks)
    seconds = time.perf_counter() - t0
    stages = dict(timer.seconds)
    chunks.close()
    return seconds, stages, len(first)


def bench_first_chunk(model_dir: Path, *, lm_precision: str = "fp32", rounds: int = 2) -> dict:
    from ..pipeline import CosyVoice2, StageTimer

    model = CosyVoice2.from_pretrained(model_dir, tts=True, lm_precision=lm_precision)
    prompt, source = str(_fixtures() / "prompt_en_3s.wav"), str(_fixtures() / "source_en_5s.wav")
    speaker = model.register_speaker("bench", prompt, prompt_text=PROMPT_TEXT)
    (request,) = model.tts_requests(TEXT, speaker_id="bench")
    hop = model.stream_chunk_ends(10_000, len(speaker.prompt_tokens))[0] + model.flow.pre_lookahead_len

    def tts_round() -> dict:
        timer = StageTimer()
        seconds, stages, samples = _first(model.tts_stream(TEXT, speaker_id="bench", seed=0, timer=timer), timer)
        prefix = model.speaker_state.lm_prefix(model.llm, request.lm_prompt_text_tokens)
        with torch.inference_mode():
            t0 = time.perf_counter()
            next(model.llm.generate(request.text_tokens, request.lm_prompt_text_tokens,
                                    request.lm_prompt_speech_tokens, draws=0, prefix=prefix))
            prefill = time.perf_counter() - t0
        return {"first_chunk_s": seconds, "samples": samples, "prefill_s": prefill,
                "first_hop_tokens": hop, "stages_s": stages}

    def vc_round() -> dict:
        timer = StageTimer()
        t0 = time.perf_counter()
        inputs = model.frontend_vc(source, prompt, timer=timer)
        front = time.perf_counter() - t0
        seconds, stages, samples = _first(model.token2wav_stream(inputs, seed=0, timer=timer), timer)
        return {"first_chunk_s": front + seconds, "frontend_s": front, "samples": samples, "stages_s": stages}

    out = {"lm_precision": lm_precision, "prompt_tokens": len(speaker.prompt_tokens),
           "text_tokens": len(request.text_tokens)}
    for name, run in (("tts", tts_round), ("vc", vc_round)):
        print(f"  first chunk, {name} ({lm_precision}): cold call", flush=True)
        cold = run()
        best = None
        for r in range(rounds):
            got = run()
            print(f"  round {r + 1}/{rounds}: {got['first_chunk_s']:.2f} s", flush=True)
            best = got if best is None or got["first_chunk_s"] < best["first_chunk_s"] else best
        out[name] = {"cold": cold, "best": best}
    return out


def first_chunk_lines(fc: dict, decode_tokens_per_s: float | None) -> list[str]:
    """The breakdown and the two first-chunk targets, met or missed with the reason."""
    tts, vc = fc["tts"]["best"], fc["vc"]["best"]
    st = tts["stages_s"]
    lm_s = st.get("llm", 0.0)
    lines = [f"first streamed chunk at concurrency 1 ({fc['lm_precision']} LM; prompt {fc['prompt_tokens']} speech "
             f"tokens, text {fc['text_tokens']} tokens), best of the rounds:",
             f"  TTS, registered speaker: {tts['first_chunk_s'] * 1e3:.0f} ms (cold call "
             f"{fc['tts']['cold']['first_chunk_s'] * 1e3:.0f} ms)",
             f"    speaker state lookup {st.get('speaker_state', 0) * 1e3:.0f} ms, front end "
             f"{st.get('frontend', 0) * 1e3:.0f} ms, LM {lm_s * 1e3:.0f} ms (prefill {tts['prefill_s'] * 1e3:.0f} ms"
             f" + the first hop's {tts['first_hop_tokens']} tokens), flow encoder "
             f"{st.get('flow.encoder', 0) * 1e3:.0f} ms, solver {st.get('flow.solver', 0) * 1e3:.0f} ms, HiFT "
             f"{st.get('hift', 0) * 1e3:.0f} ms, transport 0 (in process)"]
    vs = vc["stages_s"]
    lines += [f"  VC, repeated prompt (prompt cache): {vc['first_chunk_s'] * 1e3:.0f} ms (cold call "
              f"{fc['vc']['cold']['first_chunk_s'] * 1e3:.0f} ms)",
              f"    front end {vc['frontend_s'] * 1e3:.0f} ms (tokenizer {vs.get('tokenizer', 0) * 1e3:.0f} ms), flow "
              f"encoder {vs.get('flow.encoder', 0) * 1e3:.0f} ms, solver {vs.get('flow.solver', 0) * 1e3:.0f} ms, "
              f"HiFT {vs.get('hift', 0) * 1e3:.0f} ms, transport 0 (in process)"]

    def verdict(what: str, seconds: float, reason: str) -> str:
        met = seconds <= TARGET_FIRST_CHUNK_S
        return (f"target {what} first chunk <= {TARGET_FIRST_CHUNK_S:.1f} s: {'met' if met else 'missed'} "
                f"({seconds:.2f} s)" + ("" if met else f" - {reason}"))

    flow_s = st.get("flow.encoder", 0) + st.get("flow.solver", 0)
    need = tts["first_hop_tokens"] / decode_tokens_per_s if decode_tokens_per_s else float("nan")
    biggest = max((("the LM", lm_s), ("the flow", flow_s), ("HiFT", st.get("hift", 0))), key=lambda x: x[1])
    lines.append(verdict("streaming TTS", tts["first_chunk_s"],
                         f"{biggest[0]} takes {biggest[1]:.2f} s of it; the first hop alone needs "
                         f"{tts['first_hop_tokens']} tokens, {need:.2f} s at the measured batch-1 decode rate"))
    vflow = vs.get("flow.encoder", 0) + vs.get("flow.solver", 0)
    vbig = max((("the front end", vc["frontend_s"]), ("the flow", vflow), ("HiFT", vs.get("hift", 0))),
               key=lambda x: x[1])
    lines.append(verdict("streaming VC", vc["first_chunk_s"], f"{vbig[0]} takes {vbig[1]:.2f} s of it"))
    return lines
