"""``make bench-cv3``: CosyVoice3 in the official code and in this library, side by side, at full dims.

    python -m cosyvoice_triton.bench.cosyvoice3 --model-dir models/cosyvoice3-demo-full --official CHECKOUT

The same CosyVoice3 folder (the full-size demo model: Fun-CosyVoice3-0.5B's dims, random weights in the official
layout) and the same inputs (the library's front end on ``--source`` / ``--prompt`` / ``--text``: speech tokens,
prompt mel cut to the tokens, speaker embedding, the LM's text and prompt tokens, written once to
``<out>/inputs.npz``) go through four cases on two sides, each side in a worker process of its own:

* ``official``: the official ``CosyVoice3Model`` as the official ``CosyVoice3`` class builds it (HyperPyYAML on the
  folder's ``cosyvoice3.yaml``, then ``CosyVoice3Model.load`` of ``llm.pt``, ``flow.pt``, ``hift.pt``), driven
  through its ``tts``: the voice-conversion path (``source_speech_token``) and the zero-shot path (text), each
  non-streaming and streaming. The folder's ``CosyVoice-BlankEN`` holds a config and no weights, so the official
  ``Qwen2Encoder``'s ``from_pretrained`` builds the Qwen2 model from that config (``load`` then replaces every
  weight, strictly).
* ``library``: :class:`~cosyvoice_triton.models.cosyvoice3.pipeline.CosyVoice3` in PyTorch fp32
  (``Token2Wav3.token2wav`` / ``token2wav_stream``, the LM's ``generate``).

Cases: ``token2wav`` (voice conversion of the source tokens, non-streaming: the flow's 10 Euler steps of the DiT
and the causal vocoder), ``vc_first_chunk`` (the same streamed: time to the first chunk, and to the end),
``tts`` (zero-shot text to speech, non-streaming: the LM's tokens, then token2wav) and ``tts_first_chunk`` (the
same streamed). Both sides' LM sampling takes the same seeded uniforms (the official ``multinomial`` replaced by the
library's inverse-CDF ``pick`` on them, as the parity oracles do), so the sides decode the same tokens when their
LMs agree (the number of tokens and the waveforms' distance are reported, not assumed). The official vocoder's
noise buffers are redrawn from the library's noise seed, so the waveforms are comparable.
The official streaming loop polls for tokens every 100 ms (``time.sleep(0.1)``); its first chunk includes that.

Rounds interleave the sides (the order rotates), after a warm-up round of the non-streamed cases; medians of the
timed rounds. The DiT
estimator's time is measured by hooks on ``flow.decoder.estimator`` on both sides and the vocoder's by wrapping
``hift.inference``; the estimator's FLOPs (counted by torch at the case's frame count) over its time give its
GFLOP/s, set against an fp32 GEMM ceiling measured with the same threads before and after. Figures, not
assertions: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .. import resources
from .peer import Worker, _emit, _peak_rss_mb, gemm_ceiling, rel_diff

ROOT = resources.checkout() or Path.cwd()
FIXTURES = resources.path("tests/fixtures")
DEFAULT_MODEL_DIR = ROOT / "models" / "cosyvoice3-demo-full"
DEFAULT_OFFICIAL_DEPS = ROOT / "build" / "official-deps3"
MODULE = "cosyvoice_triton.bench.cosyvoice3"
DEFAULT_TEXT = "Good morning."  # random weights often decode to max_len, 20 tokens per text token: a short text
DEFAULT_PROMPT_TEXT = "A short prompt in a clear voice."
CASES = ("token2wav", "vc_first_chunk", "tts", "tts_first_chunk")
SEED = 1986
MAX_DRAWS = 20_000
#: what the warm-up round runs: every kernel of the streamed cases runs in these too
WARM_UP = ("token2wav", "tts")


# ------------------------------------------------------------------------------------------------ both sides

class _Clock:
    """Seconds spent in the DiT estimator and the vocoder during one case (hooks; cleared per case)."""

    def __init__(self, flow, hift):
        self.estimator = self.hift = 0.0
        self.estimator_calls, self.frames = 0, []
        self._t0 = 0.0
        est = flow.decoder.estimator
        est.register_forward_pre_hook(self._pre)
        est.register_forward_hook(self._post)
        original = hift.inference

        def inference(*args, **kw):
            t = time.perf_counter()
            try:
                return original(*args, **kw)
            finally:
                self.hift += time.perf_counter() - t
        hift.inference = inference

    def _pre(self, module, args):
        self._t0 = time.perf_counter()
        self.frames.append(int(args[0].shape[-1]))

    def _post(self, module, args, out):
        self.estimator += time.perf_counter() - self._t0
        self.estimator_calls += 1

    def reset(self) -> None:
        self.estimator = self.hift = 0.0
        self.estimator_calls, self.frames = 0, []

    def figures(self) -> dict:
        return {"estimator_s": self.estimator, "hift_s": self.hift, "estimator_calls": self.estimator_calls,
                "estimator_frames": list(self.frames)}


def lm_draws() -> list[float]:
    """The uniforms both sides' LM sampling consumes, in order (one per step, two when a token repeats)."""
    return np.random.default_rng(SEED).random(MAX_DRAWS).tolist()


def _timed_stream(chunks) -> tuple[list[np.ndarray], float]:
    t0 = time.perf_counter()
    out, first = [], None
    for c in chunks:
        out.append(np.asarray(c, np.float32).reshape(-1))
        if first is None:
            first = time.perf_counter() - t0
    return out, first


# ------------------------------------------------------------------------------------------------ library side

def _prepare_inputs(model, ns, path: Path) -> None:
    from ..frontend.text.cosyvoice3 import zero_shot_prompt_text

    x = model.frontend_vc(ns.source, ns.prompt)
    (seg,) = model.segments("zero_shot", ns.text, prompt_wav=ns.prompt,
                            prompt_text=zero_shot_prompt_text(ns.prompt_text), text_frontend=False)
    p = seg.prompt
    np.savez(path, source_tokens=x.source_tokens, vc_prompt_tokens=x.prompt_tokens, vc_prompt_mel=x.prompt_mel,
             vc_embedding=x.embedding, text_tokens=seg.text_tokens, prompt_text_tokens=seg.lm_prompt_text_tokens,
             llm_prompt_tokens=seg.lm_prompt_speech_tokens, prompt_tokens=p.prompt_tokens, prompt_mel=p.prompt_mel,
             embedding=p.embedding)


def _library(ns, inputs_path: Path):
    from ..family import COSYVOICE3
    from ..frontend.text.cosyvoice3 import zero_shot_prompt_text
    from ..models.cosyvoice3.pipeline import CosyVoice3, Segment
    from ..speakers import SpeakerPrompt

    model = CosyVoice3.from_pretrained(ns.model_dir, threads=ns.threads, onnx_threads=ns.threads,
                                       prompt_cache=False, flow_precision=ns.flow_precision)
    if not inputs_path.is_file():
        _prepare_inputs(model, ns, inputs_path)
    z = dict(np.load(inputs_path))
    t2w = model.token2wav_model
    clock = _Clock(model.flow, model.hift)
    vc_prompt = (z["vc_prompt_tokens"], z["vc_prompt_mel"], z["vc_embedding"])
    tts_prompt = (z["prompt_tokens"], z["prompt_mel"], z["embedding"])
    segment = Segment(text="", text_tokens=z["text_tokens"], lm_prompt_text_tokens=z["prompt_text_tokens"],
                      lm_prompt_speech_tokens=z["llm_prompt_tokens"],
                      prompt=SpeakerPrompt(prompt_tokens=z["prompt_tokens"], prompt_mel=z["prompt_mel"],
                                           embedding=z["embedding"], prompt_text_tokens=z["prompt_text_tokens"],
                                           prompt_text=zero_shot_prompt_text(ns.prompt_text), family=COSYVOICE3))
    tokens_seen: list[int] = []

    def lm_tokens():
        for t in model.speech_tokens(segment, draws=iter(lm_draws())):
            tokens_seen.append(int(t))
            yield t

    def run(case: str) -> tuple[list[np.ndarray], float | None, int | None]:
        tokens_seen.clear()
        if case == "token2wav":
            return [t2w.token2wav(z["source_tokens"], *vc_prompt)], None, None
        if case == "vc_first_chunk":
            chunks, first = _timed_stream(t2w.token2wav_stream(z["source_tokens"].tolist(), *vc_prompt))
            return chunks, first, None
        if case == "tts":
            tokens = np.asarray(list(lm_tokens()), np.int32)
            return [t2w.token2wav(tokens, *tts_prompt)], None, len(tokens)
        chunks, first = _timed_stream(t2w.token2wav_stream(lm_tokens(), *tts_prompt))
        return chunks, first, len(tokens_seen)

    return model.flow, clock, run


def _mel_vs_fp32(ns, inputs_path: Path, flow) -> dict:
    """The quality report's flow-stage errors (mel rel RMS, mean |log-mel error| in dB) of this side's flow at
    ``--flow-precision`` against the same folder's fp32 flow, on the token2wav case's mel (non-streaming), and both
    flows' median time over 3 interleaved runs in this process (``flow_s``)."""
    import math

    import torch

    from ..models.cosyvoice3.config import read_cosyvoice3_yaml
    from ..models.cosyvoice3.flow import load_flow3

    z = dict(np.load(inputs_path))
    ref_flow = load_flow3(Path(ns.model_dir) / "flow.pt", read_cosyvoice3_yaml(ns.model_dir).flow).eval()
    args = (torch.as_tensor(z["source_tokens"][None], dtype=torch.int32),
            torch.as_tensor(z["vc_prompt_tokens"][None], dtype=torch.int32),
            torch.as_tensor(z["vc_prompt_mel"][None]), torch.as_tensor(z["vc_embedding"][None]))
    flows = {"fp32": ref_flow, ns.flow_precision: flow}
    times: dict[str, list[float]] = {name: [] for name in flows}
    mels = {}
    with torch.inference_mode():
        for rep in range(3):  # interleaved, the order alternating: the same background load hits both
            for name in list(flows)[::1 if rep % 2 else -1]:
                t0 = time.perf_counter()
                mels[name] = flows[name].inference(*args, streaming=False, finalize=True)[0][0].numpy()
                times[name].append(time.perf_counter() - t0)
    ref, got = mels["fp32"], mels[ns.flow_precision]
    return {"mel_rel_rms": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            "mel_db": float(np.abs(got - ref).mean()) * 20 / math.log(10), "frames": int(ref.shape[-1]),
            "flow_s": {k: statistics.median(v) for k, v in times.items()}}


# ------------------------------------------------------------------------------------------------ official side

def _official(ns, inputs_path: Path):
    import torch

    if ns.official_deps and Path(ns.official_deps).is_dir():
        sys.path.insert(0, str(Path(ns.official_deps).resolve()))
    from .official import import_official, injected_multinomial, seed_causal_hift_noise, stub_frontend_imports

    stub_frontend_imports()  # the yaml's get_tokenizer names cosyvoice.tokenizer.tokenizer
    model_mod, llm_mod = import_official(ns.official, "cosyvoice.cli.model", "cosyvoice.llm.llm")
    from hyperpyyaml import load_hyperpyyaml
    from transformers import AutoConfig, Qwen2ForCausalLM

    class _FromConfig:
        """``Qwen2ForCausalLM.from_pretrained`` on a folder without weights: the model from its config."""

        @staticmethod
        def from_pretrained(path, **kw):
            return Qwen2ForCausalLM(AutoConfig.from_pretrained(path))

    llm_mod.Qwen2ForCausalLM = _FromConfig
    model_dir = Path(ns.model_dir)
    with open(model_dir / "cosyvoice3.yaml") as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
    model = model_mod.CosyVoice3Model(configs["llm"], configs["flow"], configs["hift"], False)
    model.load(str(model_dir / "llm.pt"), str(model_dir / "flow.pt"), str(model_dir / "hift.pt"))
    seed_causal_hift_noise(model.hift, 0)  # the library's default hift_noise_seed
    z = dict(np.load(inputs_path))
    clock = _Clock(model.flow, model.hift)
    last_tokens = [0]
    token2wav = model.token2wav

    def counting(token, *args, **kw):
        last_tokens[0] = int(token.shape[1])
        return token2wav(token, *args, **kw)
    model.token2wav = counting

    def t(name, dtype=torch.int32):
        return torch.as_tensor(z[name], dtype=dtype)[None]

    vc = {"source_speech_token": t("source_tokens"), "flow_prompt_speech_token": t("vc_prompt_tokens"),
          "prompt_speech_feat": t("vc_prompt_mel", torch.float32), "flow_embedding": t("vc_embedding", torch.float32)}
    tts = {"text": t("text_tokens"), "prompt_text": t("prompt_text_tokens"),
           "llm_prompt_speech_token": t("llm_prompt_tokens"), "flow_prompt_speech_token": t("prompt_tokens"),
           "prompt_speech_feat": t("prompt_mel", torch.float32), "flow_embedding": t("embedding", torch.float32),
           "llm_embedding": t("embedding", torch.float32)}

    def run(case: str) -> tuple[list[np.ndarray], float | None, int | None]:
        model.token_hop_len = 25  # a fresh instance's hop: the official tts grows it on the instance
        kw, stream = (vc, case == "vc_first_chunk") if case in ("token2wav", "vc_first_chunk") else \
            (tts, case == "tts_first_chunk")
        with torch.inference_mode(), injected_multinomial(iter(lm_draws())):
            chunks, first = _timed_stream(o["tts_speech"][0].numpy() for o in model.tts(**kw, stream=stream))
        return chunks, (first if stream else None), (last_tokens[0] if kw is tts else None)

    return model.flow, clock, run


# ------------------------------------------------------------------------------------------------ worker

def worker_main(side: str, ns: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(ns.threads)
    out_dir = Path(ns.out_dir)
    inputs_path = out_dir / "inputs.npz"
    t0 = time.perf_counter()
    if side == "library":
        flow, clock, run = _library(ns, inputs_path)
    elif side == "official":
        flow, clock, run = _official(ns, inputs_path)
    else:
        raise SystemExit(f"bench-cv3: unknown worker side {side!r}")
    estimator = flow.decoder.estimator
    ready = {"load_s": time.perf_counter() - t0, "peak_rss_mb": _peak_rss_mb(),
             "estimator_params": sum(p.numel() for p in estimator.parameters())}
    _emit(ready)
    flops_cache: dict[int, int] = {}
    counted = None
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        if command[0] == "mel_vs_fp32":  # the library's flow against an fp32 one on the token2wav case's mel
            _emit(_mel_vs_fp32(ns, inputs_path, flow))
            continue
        if command[0] == "flops":  # FLOPs of the estimator at the frame counts a case used
            from .vc import estimator_call_flops  # here: it imports the library (the official side never asks)

            frames = [int(f) for f in command[1:]]
            if counted is None:  # torch counts no FLOPs in quantised Linear layers: count them on an fp32 DiT
                counted = estimator if ns.flow_precision == "fp32" else type(estimator)(estimator.dims).eval()
            for f in frames:
                if f not in flops_cache:
                    flops_cache[f] = estimator_call_flops(counted, f)
            _emit({"flops": sum(flops_cache[f] for f in frames)})
            continue
        case = command[1]
        clock.reset()
        t0 = time.perf_counter()
        chunks, first, tokens = run(case)
        seconds = time.perf_counter() - t0
        wave = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        np.save(out_dir / f"{side}_{case}.npy", wave)
        _emit({"seconds": seconds, "first_chunk_s": first, "chunks": len(chunks), "samples": len(wave),
               "tokens": tokens, **clock.figures()})
    _emit({"peak_rss_mb": _peak_rss_mb()})
    return 0


# ------------------------------------------------------------------------------------------------ driver

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(result: dict) -> dict:
    """Per case and side: medians (seconds, first chunk, estimator, vocoder), the estimator's share and GFLOP/s,
    real-time factor; per case the official / library ratio and the waveforms' distance."""
    ceiling = max(result["ceiling_gflops"])
    out: dict = {"ceiling_gflops": ceiling, "cases": {}}
    for case in result["cases"]:
        row: dict = {}
        for side, runs in result["runs"].get(case, {}).items():
            if not runs:
                continue
            last = runs[-1]
            sec = _median([r["seconds"] for r in runs])
            est = _median([r["estimator_s"] for r in runs])
            audio_s = last["samples"] / 24000
            gflops = result["flops"].get(case)
            row[side] = {"seconds": sec, "first_chunk_s": _median([r["first_chunk_s"] for r in runs]),
                         "estimator_s": est, "hift_s": _median([r["hift_s"] for r in runs]),
                         "estimator_share": est / sec if sec else None, "audio_s": audio_s,
                         "rtf": sec / audio_s if audio_s else None, "tokens": last["tokens"],
                         "chunks": last["chunks"], "estimator_calls": last["estimator_calls"],
                         "estimator_gflops": gflops / est / 1e9 if gflops and est else None}
            if row[side]["estimator_gflops"]:
                row[side]["estimator_vs_ceiling"] = row[side]["estimator_gflops"] / ceiling
        if "official" in row and "library" in row:
            o, lib = row["official"], row["library"]
            row["speedup"] = o["seconds"] / lib["seconds"]
            if o["first_chunk_s"] and lib["first_chunk_s"]:
                row["first_chunk_speedup"] = o["first_chunk_s"] / lib["first_chunk_s"]
            row["waveform_rel_diff"] = result["parity"].get(case)
        out["cases"][case] = row
    return out


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(summary: dict, meta: dict) -> str:
    lines = [f"CosyVoice3 at full dims, official code vs library (PyTorch, flow "
             f"{meta.get('flow_precision', 'fp32')}); commit {meta['commit']}; "
             f"{meta['machine']}; {meta['threads']} threads per side; medians of {meta['rounds']} rounds; GEMM "
             f"ceiling {summary['ceiling_gflops']:.0f} GFLOP/s", "",
             "| case | side | seconds | first chunk s | audio s | RTF | DiT s (share) | DiT GFLOP/s (of ceiling) "
             "| vocoder s | tokens | speed-up | max rel. diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, row in summary["cases"].items():
        for side in ("official", "library"):
            r = row.get(side)
            if not r:
                continue
            share = f"{_fmt(r['estimator_s'])} ({_fmt(r['estimator_share'], '.0%')})"
            gf = (f"{_fmt(r['estimator_gflops'], '.0f')} ({_fmt(r.get('estimator_vs_ceiling'), '.0%')})"
                  if r["estimator_gflops"] else "-")
            extra = ["", ""]
            if side == "library" and "speedup" in row:
                sp = f"x{row['speedup']:.2f}"
                if "first_chunk_speedup" in row:
                    sp += f" (first chunk x{row['first_chunk_speedup']:.2f})"
                extra = [sp, _fmt(row.get("waveform_rel_diff"), ".1e")]
            lines.append(f"| {case} | {side} | {_fmt(r['seconds'])} | {_fmt(r['first_chunk_s'])} | "
                         f"{r['audio_s']:.2f} | {_fmt(r['rtf'])} | {share} | {gf} | {_fmt(r['hift_s'])} | "
                         f"{_fmt(r['tokens'], 'd')} | {extra[0]} | {extra[1]} |")
    return "\n".join(lines)


def run_bench(model_dir: str | Path = DEFAULT_MODEL_DIR, *, official: str | Path | None = None,
              official_deps: str | Path = DEFAULT_OFFICIAL_DEPS, source: str | None = None,
              prompt: str | None = None, text: str = DEFAULT_TEXT, prompt_text: str = DEFAULT_PROMPT_TEXT,
              cases: tuple[str, ...] = CASES, rounds: int = 2, threads: int = 2,
              out_dir: str | Path = "build/bench-cv3", flow_precision: str = "fp32") -> dict:
    from ..loadtest.live import commit
    from ..loadtest.setup import machine

    if rounds < 1 or threads < 1:
        raise ValueError(f"bench-cv3: rounds and threads must be >= 1, got {rounds}, {threads}")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise ValueError(f"bench-cv3: unknown case(s) {', '.join(unknown)}; the cases are {', '.join(CASES)}")
    model_dir, out_dir = Path(model_dir), Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "inputs.npz").unlink(missing_ok=True)
    meta = {"commit": commit(), "machine": machine(), "threads": threads, "rounds": rounds,
            "model_dir": str(model_dir), "text": text, "prompt_text": prompt_text, "flow_precision": flow_precision,
            "source": str(source or FIXTURES / "source_en_5s.wav"),
            "prompt": str(prompt or FIXTURES / "prompt_en_3s.wav")}
    print(f"bench-cv3: {model_dir}, {threads} threads per side, {rounds} timed rounds after 1 warm-up; "
          f"{meta['machine']}", flush=True)
    ceilings = [gemm_ceiling(threads)]
    print(f"  GEMM ceiling {ceilings[0]:.1f} GFLOP/s", flush=True)
    common = ["--model-dir", str(model_dir), "--threads", str(threads), "--out-dir", str(out_dir),
              "--source", meta["source"], "--prompt", meta["prompt"], "--text", text, "--prompt-text", prompt_text,
              "--flow-precision", flow_precision]
    runners: dict[str, Worker] = {}
    runs: dict = {c: {} for c in cases}
    result = {"meta": meta, "cases": list(cases), "runs": runs, "ceiling_gflops": ceilings, "ready": {},
              "flops": {}, "notes": []}
    try:
        print("  starting the library worker (writes the inputs)", flush=True)
        runners["library"] = Worker("library", common, log_path=out_dir / "library.log", module=MODULE)
        if official:
            print(f"  starting the official worker ({official})", flush=True)
            runners["official"] = Worker("official", [*common, "--official", str(official), "--official-deps",
                                                      str(official_deps)], log_path=out_dir / "official.log",
                                         module=MODULE)
        else:
            result["notes"].append("official side skipped: no checkout given (OFFICIAL=path / --official)")
        for name, r in runners.items():
            result["ready"][name] = r.ready
            print(f"  {name}: loaded in {r.ready['load_s']:.1f} s, peak RSS {r.ready['peak_rss_mb']:.0f} MB",
                  flush=True)
        names = list(runners)
        warm = [c for c in cases if c in WARM_UP] or list(cases)
        for i in range(rounds + 1):
            label = "warm-up" if i == 0 else f"round {i}"
            for case in (cases if i else warm):
                order = names[i % len(names):] + names[:i % len(names)]
                figures = []
                for name in order:
                    out = runners[name].call(f"run {case}")
                    fc = f", first chunk {out['first_chunk_s']:.2f} s" if out["first_chunk_s"] is not None else ""
                    figures.append(f"{name} {out['seconds']:.2f} s{fc}")
                    if i:
                        runs[case].setdefault(name, []).append(out)
                print(f"  {label} {case}: " + "; ".join(figures), flush=True)
        if flow_precision != "fp32":
            from ..export.quality import BAR

            q = result["quality"] = runners["library"].call("mel_vs_fp32")
            ok = q["mel_rel_rms"] <= BAR.mel_rel_rms and q["mel_db"] <= BAR.mel_db
            result["notes"].append(
                f"library flow {flow_precision} against fp32 (token2wav mel, {q['frames']} frames): mel rel RMS "
                f"{q['mel_rel_rms']:.2e}, mean |log-mel error| {q['mel_db']:.3f} dB: "
                f"{'within' if ok else 'OUTSIDE'} the quality report's flow bar ({BAR.mel_rel_rms:g}, "
                f"{BAR.mel_db:g} dB); the flow alone, median of 3 interleaved runs in one process: fp32 "
                f"{q['flow_s']['fp32']:.2f} s, {flow_precision} {q['flow_s'][flow_precision]:.2f} s "
                f"(x{q['flow_s']['fp32'] / q['flow_s'][flow_precision]:.2f}); the waveforms' difference from the "
                "official fp32 side is the INT8 error carried through the vocoder's phase, not a parity figure")
            print("  " + result["notes"][-1], flush=True)
        for case in cases:
            frames = runs[case].get("library", [{}])[-1].get("estimator_frames", [])
            if frames:
                result["flops"][case] = runners["library"].call("flops " + " ".join(map(str, frames)))["flops"]
    finally:
        for name, r in runners.items():
            try:
                result["ready"].setdefault(name, {})["peak_rss_end_mb"] = r.close()["peak_rss_mb"]
            except Exception as exc:  # a worker that died: the figures so far stay
                result["notes"].append(f"{name}: closing failed ({exc})")
    ceilings.append(gemm_ceiling(threads))
    meta["load_end"] = [round(x, 2) for x in os.getloadavg()]
    result["parity"] = {}
    for case in cases:
        a, b = out_dir / f"library_{case}.npy", out_dir / f"official_{case}.npy"
        if a.is_file() and b.is_file():
            result["parity"][case] = rel_diff(np.load(a), np.load(b))
    summary = summarize(result)
    result["summary"] = summary
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=float))
    table = format_table(summary, meta)
    (out_dir / "report.md").write_text(table + "\n\n" + "\n".join(
        [f"load average at the end: {meta['load_end']}; GEMM ceiling before / after {ceilings[0]:.1f} / "
         f"{ceilings[1]:.1f} GFLOP/s", *result["notes"]]) + "\n")
    print()
    print(table)
    print(f"\n  load average at the end {meta['load_end']}; written: {out_dir / 'report.md'}, result.json")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cosyvoice-triton bench-cv3", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--official", default=None, help="checkout of FunAudioLLM/CosyVoice (else the side is skipped)")
    p.add_argument("--official-deps", default=str(DEFAULT_OFFICIAL_DEPS),
                   help="folder with the official CosyVoice3 dependencies (pip install --target)")
    p.add_argument("--source", default=str(FIXTURES / "source_en_5s.wav"))
    p.add_argument("--prompt", default=str(FIXTURES / "prompt_en_3s.wav"))
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--prompt-text", default=DEFAULT_PROMPT_TEXT, help="the prompt's transcript (the system prompt "
                   "is put before it)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", default="build/bench-cv3")
    p.add_argument("--flow-precision", default="fp32", choices=("fp32", "int8"),
                   help="the library's flow (int8: the DiT blocks on PyTorch's CPU INT8; its mel is also compared "
                   "with the fp32 flow's against the quality report's bar)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        return worker_main(ns.worker, ns)
    run_bench(ns.model_dir, official=ns.official, official_deps=ns.official_deps, source=ns.source,
              prompt=ns.prompt, text=ns.text, prompt_text=ns.prompt_text,
              cases=tuple(c for c in ns.cases.split(",") if c), rounds=ns.rounds, threads=ns.threads,
              out_dir=ns.out_dir, flow_precision=ns.flow_precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
