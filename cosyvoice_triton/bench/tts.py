"""``make bench-tts``: what text-to-speech costs at the real dims on this machine.

    python -m cosyvoice_triton.bench.tts [--model-dir models/cosyvoice2-demo-full] [--official PATH]

On a full-size model folder (written once by ``write_demo_model(size="full")`` when its ``llm.pt`` is missing):
the LM's prefill time, time to first token and decode tokens/s at batch 1, 4 and 8 (in-flight
:class:`~cosyvoice_triton.models.llm.BatchDecoder`), and the real-time factor of one utterance of
``--utterance-s`` seconds through the whole path (LM tokens -> flow -> HiFT). With ``--official`` (a checkout of
FunAudioLLM/CosyVoice) the official ``Qwen2LM.inference`` runs on the same weights in the same process for the
LM figures. The two sides run in interleaved rounds, so that load from other processes affects both alike, and
the best round is reported. With ``--lm-precisions fp32,fp32-ort,int8`` (the default) the same LM figures follow
for the fp32 LM on onnxruntime's MatMul (:mod:`~cosyvoice_triton.models.lm_ort`; its rounds interleave with
fp32's, so the two compare under the same load) and for the INT8 LM (:mod:`~cosyvoice_triton.models.lm_quant`),
each with its distance from fp32 on one request (teacher-forced, :func:`~cosyvoice_triton.models.lm_quant.compare`),
and the targets: batch-1 decode >= 25 tokens/s (real time) within the quality bar, batch 8 >= 3x batch 1. A roofline
puts the decode rates against memory bandwidth (:func:`roofline`): the bytes of weights one decode step reads
against a measured copy bandwidth give each batch's tokens/s ceiling and the fraction each precision reaches. Then
the first streamed chunk at concurrency 1 for a registered speaker's TTS and for VC, with the breakdown and the
1.5 s targets (:mod:`.first_chunk`). Figures, not assertions: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..config import LLMConfig, ModelConfig
from ..threads import configure
from .first_chunk import bench_first_chunk, first_chunk_lines

TOKEN_RATE = 25  # speech tokens per second of audio
# A zero-shot request of typical size: 30 text tokens, a prompt of 20 text tokens and 3 s of speech tokens.
TEXT_TOKENS, PROMPT_TEXT_TOKENS, PROMPT_SPEECH_TOKENS = 30, 20, 75
TARGET_BATCH1_VS_OFFICIAL = 1.0
TARGET_BATCH8_VS_BATCH1 = 3.0
TARGET_INT8_BATCH1 = float(TOKEN_RATE)  # tokens/s: real time at batch 1


def ensure_model(model_dir: Path) -> Path:
    """A full-size demo folder with ``llm.pt`` (written once: about 2.5 GB and a minute or two)."""
    from ..models.demo import write_demo_model

    needed = ("cosyvoice2.yaml", "flow.pt", "hift.pt", "llm.pt", "CosyVoice-BlankEN/config.json")
    if not all((model_dir / name).is_file() for name in needed):
        print(f"writing the full-size demo model to {model_dir} (once)", flush=True)
        write_demo_model(model_dir, size="full", seed=0)
    return model_dir


def _inputs(lm, seed: int, text_tokens: int = TEXT_TOKENS):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, lm.text_vocab_size, (text_tokens,), generator=g)
    prompt_text = torch.randint(0, lm.text_vocab_size, (PROMPT_TEXT_TOKENS,), generator=g)
    prompt_speech = torch.randint(0, lm.speech_token_size, (PROMPT_SPEECH_TOKENS,), generator=g)
    return text, prompt_text, prompt_speech


def _ratio(n_tokens: int, text_tokens: int) -> float:
    # min_len = max_len = n_tokens: end-of-speech is masked until n_tokens, which is also the cap
    return (n_tokens + 0.5) / text_tokens


class ProjectLM:
    """The project's LM figures: one measurement per call, so that rounds can interleave with the official."""

    def __init__(self, lm, decode_tokens: int):
        self.lm, self.decode_tokens = lm, decode_tokens
        self.inputs = _inputs(lm, 0)
        self.prompt_positions = sum(len(t) for t in self.inputs) + 2

    @torch.inference_mode()
    def prefill(self) -> float:
        t0 = time.perf_counter()
        self.lm.qwen(inputs_embeds=self.lm.lm_input(*self.inputs))
        return time.perf_counter() - t0

    @torch.inference_mode()
    def first_token(self) -> float:
        t0 = time.perf_counter()
        next(self.lm.generate(*self.inputs, draws=0))
        return time.perf_counter() - t0

    @torch.inference_mode()
    def decode(self, batch: int) -> tuple[int, float]:
        """Tokens after the first of ``batch`` requests decoded together, and their seconds."""
        from ..models.llm import LMRequest

        ratio = _ratio(self.decode_tokens, TEXT_TOKENS)
        decoder = self.lm.batch_decoder()
        for i in range(batch):
            t, pt, ps = _inputs(self.lm, 100 + i)
            decoder.add(LMRequest(t, pt, ps, draws=i, min_token_text_ratio=ratio, max_token_text_ratio=ratio))
        decoder.step()  # prefills every request and samples its first token
        t0, tokens = time.perf_counter(), 0
        while len(decoder):
            tokens += sum(1 for token in decoder.step().values() if token >= 0)
        return tokens, time.perf_counter() - t0


def official_lm(checkout: Path, model_dir: Path, lm):
    """The official ``Qwen2LM`` holding the same ``llm.pt``: the Qwen2 module is built from the folder's config
    (the official ``from_pretrained`` also wants Qwen2 weights there, which ``llm.pt`` overwrites anyway)."""
    from transformers import Qwen2ForCausalLM

    from .official import import_official, official_qwen2lm

    (llm_mod,) = import_official(checkout, "cosyvoice.llm.llm")
    encoder = llm_mod.Qwen2Encoder.__new__(llm_mod.Qwen2Encoder)
    torch.nn.Module.__init__(encoder)
    encoder.model = Qwen2ForCausalLM(lm.llm.model.config)
    model = official_qwen2lm(checkout, encoder, hidden_size=lm.llm.model.config.hidden_size,
                             speech_token_size=lm.speech_token_size)
    model.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    return model.eval()


class OfficialLM:
    """The official ``Qwen2LM.inference`` on the same weights and inputs (its own torch-RNG sampling)."""

    def __init__(self, model, lm, decode_tokens: int):
        self.model, self.decode_tokens = model, decode_tokens
        self.inputs = _inputs(lm, 0)

    def _run(self, n_tokens: int) -> tuple[float, float, int]:
        text, prompt_text, prompt_speech = self.inputs
        row, length = (lambda t: t.to(torch.int32)[None]), (lambda t: torch.tensor([len(t)], dtype=torch.int32))
        ratio = _ratio(n_tokens, len(text))
        gen = self.model.inference(text=row(text), text_len=length(text), prompt_text=row(prompt_text),
                                   prompt_text_len=length(prompt_text), prompt_speech_token=row(prompt_speech),
                                   prompt_speech_token_len=length(prompt_speech), embedding=torch.zeros(1, 0),
                                   min_token_text_ratio=ratio, max_token_text_ratio=ratio)
        t0 = time.perf_counter()
        next(gen)
        t1 = time.perf_counter()
        n = sum(1 for _ in gen)
        return t1 - t0, time.perf_counter() - t1, n

    @torch.inference_mode()
    def prefill(self) -> float:
        m = self.model
        text, prompt_text, prompt_speech = self.inputs
        t0 = time.perf_counter()
        lm_input = torch.cat([m.llm_embedding.weight[None, :1], m.llm.model.model.embed_tokens(
            torch.cat([prompt_text, text])[None]), m.llm_embedding.weight[None, 1:],
            m.speech_embedding(prompt_speech[None])], dim=1)
        masks = torch.tril(torch.ones((1, lm_input.shape[1], lm_input.shape[1]))).to(torch.bool)
        m.llm.forward_one_step(lm_input, masks=masks, cache=None)
        return time.perf_counter() - t0

    def first_token(self) -> float:
        return self._run(1)[0]

    def decode(self, batch: int) -> tuple[int, float]:
        if batch != 1:
            raise ValueError("the official Qwen2LM.inference decodes one request at a time")
        _, seconds, n = self._run(self.decode_tokens)
        return n, seconds


def bench_lm(project: ProjectLM, official: OfficialLM | None, *, batches: tuple[int, ...], rounds: int,
             others: dict[str, ProjectLM] | None = None) -> dict:
    """Interleaved rounds (project, the ``others`` (more of the project's LMs, by name), then official, every figure
    once a round), so that load from other processes affects every side alike; the best round is reported (bursts
    of outside load only ever slow a round down), the median next to it in the JSON."""
    sides = {"project": project, **(others or {})}
    if official is not None:
        sides["official"] = official
    raw: dict[str, dict[str, list]] = {name: {"prefill_s": [], "ttft_s": [], "decode": []} for name in sides}
    for side in sides.values():  # warm-up: the first pass pages in ~2 GB of freshly loaded weights
        side.first_token()
    for r in range(rounds):
        for name, side in sides.items():
            raw[name]["prefill_s"].append(side.prefill())
            raw[name]["ttft_s"].append(side.first_token())
            for batch in (1,) if name == "official" else batches:
                tokens, seconds = side.decode(batch)
                raw[name]["decode"].append((batch, tokens, seconds))
                print(f"  round {r + 1}/{rounds}: {name} batch {batch}: {tokens} tokens in {seconds:.2f} s", flush=True)
    out = {}
    for name, d in raw.items():
        decode = {}
        for batch in sorted({b for b, _, _ in d["decode"]}):
            runs = [(t, s) for b, t, s in d["decode"] if b == batch]
            rates = [t / s for t, s in runs]
            decode[batch] = {"tokens": runs[0][0], "tokens_per_s": max(rates),
                             "median_tokens_per_s": statistics.median(rates), "seconds": [s for _, s in runs]}
        out[name] = {"prefill_s": min(d["prefill_s"]), "ttft_s": min(d["ttft_s"]),
                     "median_prefill_s": statistics.median(d["prefill_s"]),
                     "median_ttft_s": statistics.median(d["ttft_s"]), "decode": decode}
    out["project"]["prompt_positions"] = project.prompt_positions
    return out


def int8_quality(lm, lm8, n_tokens: int, seed: int = 5) -> dict:
    """Another precision's LM (``lm8``: int8, fp32-ort) against fp32 on one bench request of ``n_tokens``
    (teacher-forced on fp32's tokens)."""
    from ..models.lm_quant import BAR, compare

    text, prompt_text, prompt_speech = _inputs(lm, seed)
    draws = np.random.default_rng(seed).random(4 * n_tokens + 8).tolist()
    ratio = _ratio(n_tokens, len(text))
    tokens = list(lm.generate(text, prompt_text, prompt_speech, draws=list(draws), min_token_text_ratio=ratio,
                              max_token_text_ratio=ratio))
    report = compare(lm, lm8, text, prompt_text, prompt_speech, tokens, draws, min_len=len(tokens))
    return {**report.summary(), "meets_bar": report.meets(BAR), "bar": dataclasses.asdict(BAR)}


def twin_lm(lm):
    """A copy of ``lm`` whose modules are new and whose tensors are ``lm``'s (to swap its Linear layers for another
    precision's without a second copy of the weights)."""
    import copy

    memo = {id(t): t for t in (*lm.parameters(), *lm.buffers())}
    return copy.deepcopy(lm, memo)


def decode_step_bytes(lm) -> dict[str, int]:
    """Bytes one batched decode step reads from the weights: ``shared``, once per step whatever the batch (every
    Linear of the trunk and the speech head: weights, biases; an INT8 layer's int8 weights and its per-channel
    scales and zero points), and ``per_token``, once per sequence (the speech embedding row of its last token).
    The KV cache and the activations are left out (a few MB against GB at full dims)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from ..models.lm_ort import OrtLinear

    shared = 0
    for m in (*lm.qwen.modules(), lm.llm_decoder):
        if type(m) is torch.nn.Linear:
            shared += sum(t.nbytes for t in (m.weight, m.bias) if t is not None)
        elif isinstance(m, DynamicLinear):
            w, b = m.weight(), m.bias()
            shared += w.numel() * w.element_size() + (b.nbytes if b is not None else 0)
            if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
                shared += w.q_per_channel_scales().nbytes + w.q_per_channel_zero_points().nbytes
        elif isinstance(m, OrtLinear):  # float32 weights, the bias where the layer has one
            shared += 4 * m.in_features * m.out_features + (4 * m.out_features if m.has_bias else 0)
    per_token = lm.speech_embedding.weight[0].nbytes
    return {"shared": shared, "per_token": per_token}


def copy_bandwidth(nbytes: int = 1 << 30, rounds: int = 3) -> float:
    """Memory copy bandwidth in bytes/s: the best of ``rounds`` NumPy copies of an ``nbytes`` array, counting the
    bytes read and written (STREAM's copy convention); one untimed copy first faults the pages in."""
    src = np.ones(max(nbytes // 4, 1), np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def roofline(bandwidth: float, step_bytes: dict[str, dict[str, int]], rates: dict[str, dict[int, float]]) -> dict:
    """Per precision and batch: bytes read per decode token (``shared / batch + per_token``), the tokens/s
    ceiling that ``bandwidth`` leaves (``bandwidth / bytes per token``) and the fraction of it ``rates``
    (tokens/s) reach."""
    out: dict = {"bandwidth_bytes_per_s": bandwidth, "precisions": {}}
    for name, b in step_bytes.items():
        per_batch = {}
        for batch, rate in rates.get(name, {}).items():
            per_token = b["shared"] / batch + b["per_token"]
            ceiling = bandwidth / per_token
            per_batch[batch] = {"bytes_per_token": per_token, "ceiling_tokens_per_s": ceiling,
                                "tokens_per_s": rate, "fraction": rate / ceiling}
        out["precisions"][name] = {**b, "batches": per_batch}
    return out


def _roofline_lines(r: dict) -> list[str]:
    lines = [f"roofline: memory copy bandwidth {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (NumPy copy, read + "
             "write, best of 3); per decode step the weights are read once (the trunk's Linear layers and the speech "
             "head), plus one speech-embedding row per sequence"]
    for name, p in r["precisions"].items():
        cells = [f"batch {b}: {v['tokens_per_s']:.1f} of {v['ceiling_tokens_per_s']:.1f} tokens/s "
                 f"({v['fraction']:.1%})" for b, v in p["batches"].items()]
        lines.append(f"  {name}: {p['shared'] / 1e6:.1f} MB per step + {p['per_token'] / 1e3:.1f} kB per token; "
                     + "; ".join(cells))
    return lines


def _fp32_ort_lines(ort: dict, fp32: dict, batches: tuple[int, ...]) -> list[str]:
    q, lines = ort["quality"], []
    for b in batches:
        mine, ref = ort["decode"][b], fp32["decode"][b]
        lines.append(f"fp32-ort LM: decode tokens/s, batch {b}: {mine['tokens_per_s']:.1f} ({mine['tokens']} tok), "
                     f"{mine['tokens_per_s'] / ref['tokens_per_s']:.2f}x fp32 (rounds interleaved)")
    lines.append(f"fp32-ort LM: prefill {ort['prefill_s'] * 1e3:.0f} ms ({fp32['prefill_s'] * 1e3:.0f} ms fp32), "
                 f"time to first token {ort['ttft_s'] * 1e3:.0f} ms ({fp32['ttft_s'] * 1e3:.0f} ms fp32)")
    lines.append(f"fp32-ort LM vs fp32 ({q['steps']} steps, teacher-forced): TV max {q['max_tv']:.2e}, same token "
                 f"{q['same_token']:.0%}")
    return lines


def _int8_lines(int8: dict, batches: tuple[int, ...]) -> list[str]:
    decode, q = int8["decode"], int8["quality"]
    lines = [f"int8 LM: decode tokens/s, batch {b}: {decode[b]['tokens_per_s']:.1f} ({decode[b]['tokens']} tok)"
             for b in batches]
    lines.append(f"int8 LM vs fp32 ({q['steps']} steps, teacher-forced): TV max {q['max_tv']:.3f} mean "
                 f"{q['mean_tv']:.3f}, same token {q['same_token']:.0%}; quality bar (TV max <= {q['bar']['max_tv']}, "
                 f"mean <= {q['bar']['mean_tv']}, same token >= {q['bar']['min_same_token']:.0%}): "
                 f"{'met' if q['meets_bar'] else 'missed'}")
    b1 = decode.get(1, {}).get("tokens_per_s")
    if b1:
        fast = b1 >= TARGET_INT8_BATCH1
        lines.append(f"target int8 batch-1 decode >= {TARGET_INT8_BATCH1:.0f} tokens/s within the bar: "
                     f"{'met' if fast and q['meets_bar'] else 'missed'} ({b1:.1f} tokens/s, "
                     f"{'fast enough' if fast else 'too slow'}, bar {'met' if q['meets_bar'] else 'missed'})")
        b8 = decode.get(max(batches), {}).get("tokens_per_s")
        if b8 and max(batches) > 1:
            lines.append(f"target int8 batch {max(batches)} >= {TARGET_BATCH8_VS_BATCH1}x batch 1: "
                         f"{'met' if b8 >= TARGET_BATCH8_VS_BATCH1 * b1 else 'missed'} ({b8 / b1:.2f}x)")
    return lines


@torch.inference_mode()
def bench_rtf(model_dir: Path, lm, *, utterance_s: float) -> dict:
    """One utterance through the whole path: LM tokens (``utterance_s`` x 25), then the non-streaming token2wav."""
    from ..pipeline import CosyVoice2, StageTimer, VCInputs

    tts = CosyVoice2.from_pretrained(model_dir)
    text, prompt_text, prompt_speech = _inputs(lm, 7)
    n_tokens = round(utterance_s * TOKEN_RATE)
    ratio = _ratio(n_tokens, len(text))
    g = np.random.default_rng(7)
    t0 = time.perf_counter()
    tokens = list(lm.generate(text, prompt_text, prompt_speech, draws=7, min_token_text_ratio=ratio,
                              max_token_text_ratio=ratio))
    lm_s = time.perf_counter() - t0
    inputs = VCInputs(source_tokens=np.asarray(tokens, np.int32), prompt_tokens=prompt_speech.numpy().astype(np.int32),
                      prompt_mel=g.normal(-6, 2, (2 * PROMPT_SPEECH_TOKENS, 80)).astype(np.float32),
                      embedding=g.normal(size=192).astype(np.float32))
    timer = StageTimer()
    t1 = time.perf_counter()
    wave = tts.token2wav(inputs, seed=0, timer=timer)
    t2w_s = time.perf_counter() - t1
    audio_s = len(wave) / tts.config.sample_rate
    return {"tokens": len(tokens), "audio_s": audio_s, "lm_s": lm_s, "token2wav_s": t2w_s,
            "stages_s": timer.seconds, "rtf": (lm_s + t2w_s) / audio_s}


def _table(project: dict, official: dict | None, rtf: dict | None, batches: tuple[int, ...]) -> str:
    rows = [("prompt positions", f"{project['prompt_positions']}", "")]
    off = official or {}
    fmt_s = lambda d, k: f"{d[k] * 1e3:.0f} ms" if k in d else "-"
    rows.append(("prefill", fmt_s(project, "prefill_s"), fmt_s(off, "prefill_s")))
    rows.append(("time to first token", fmt_s(project, "ttft_s"), fmt_s(off, "ttft_s")))
    for b in batches:
        p = project["decode"][b]
        o = off.get("decode", {}).get(b)
        rows.append((f"decode tokens/s, batch {b}", f"{p['tokens_per_s']:.1f} ({p['tokens']} tok)",
                     f"{o['tokens_per_s']:.1f} ({o['tokens']} tok)" if o else "-"))
    if rtf:
        rows.append((f"RTF, {rtf['audio_s']:.1f} s utterance", f"{rtf['rtf']:.2f}", ""))
        rows.append(("  LM / token2wav", f"{rtf['lm_s']:.1f} s / {rtf['token2wav_s']:.1f} s", ""))
        for stage, s in rtf["stages_s"].items():
            rows.append((f"  {stage}", f"{s:.1f} s", ""))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'(best of the rounds)':<{width}}  {'project':>22}  {'official':>22}"]
    lines += [f"{a:<{width}}  {b:>22}  {c:>22}" for a, b, c in rows]
    b1 = project["decode"].get(1, {}).get("tokens_per_s")
    b8 = project["decode"].get(max(batches), {}).get("tokens_per_s")
    if b1 and b8:
        lines.append(f"batch {max(batches)} aggregate / batch 1: {b8 / b1:.2f}x (target >= {TARGET_BATCH8_VS_BATCH1}x)")
    o1 = off.get("decode", {}).get(1, {}).get("tokens_per_s")
    if b1 and o1:
        lines.append(f"batch-1 decode, project / official: {b1 / o1:.2f}x (target >= {TARGET_BATCH1_VS_OFFICIAL}x)")
    elif official is None:
        lines.append("official: skipped (pass --official PATH, a checkout of FunAudioLLM/CosyVoice)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("models/cosyvoice2-demo-full"))
    ap.add_argument("--official", type=Path, default=None, help="checkout of the official CosyVoice code")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens per request in the decode figures")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--utterance-s", type=float, default=10.0, help="0 skips the whole-path RTF")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the LM figures (best reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--lm-precisions", default="fp32,fp32-ort,int8",
                    help="fp32, then fp32-ort and / or int8: the LM figures of each")
    ap.add_argument("--bandwidth-mb", type=int, default=1024,
                    help="MiB of the array whose copy measures the memory bandwidth of the roofline (0: no roofline)")
    ap.add_argument("--first-chunk-rounds", type=int, default=2,
                    help="rounds of the first-chunk figures (streaming TTS for a registered speaker, streaming VC); "
                         "0 skips them")
    ap.add_argument("--out-json", type=Path, default=Path("build/bench-tts.json"))
    args = ap.parse_args(argv)
    if args.decode_tokens < 2 or args.repeats < 1:
        ap.error("--decode-tokens must be >= 2 and --repeats >= 1")
    configure(args.threads or None)
    batches = tuple(int(b) for b in args.batches.split(","))
    precisions = [p for p in args.lm_precisions.split(",") if p]
    if not precisions or set(precisions) - {"fp32", "fp32-ort", "int8"} or precisions[0] != "fp32":
        ap.error("--lm-precisions: fp32 first, then fp32-ort and / or int8 if wanted (fp32 is the reference of their "
                 "quality)")

    from ..models.llm import load_llm

    model_dir = ensure_model(args.model_dir)
    config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    if config.llm is None:
        config = dataclasses.replace(config, llm=LLMConfig.full())
    lm = load_llm(model_dir, config)
    print(f"bench-tts: {model_dir}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    off = None
    if args.official is not None:
        off = OfficialLM(official_lm(args.official, model_dir, lm), lm, args.decode_tokens)
    from ..models.lm_quant import quantize_lm

    others, lm_ort = {}, None
    if "fp32-ort" in precisions:  # its rounds interleave with fp32's
        t0 = time.perf_counter()
        lm_ort = quantize_lm(twin_lm(lm), "fp32-ort")
        print(f"fp32-ort LM: built in {time.perf_counter() - t0:.1f} s, {lm_ort.lm_threads} onnxruntime threads per "
              "layer", flush=True)
        others["fp32-ort"] = ProjectLM(lm_ort, args.decode_tokens)
    figures = bench_lm(ProjectLM(lm, args.decode_tokens), off, batches=batches, rounds=args.repeats, others=others)
    project, official, fp32_ort = figures["project"], figures.get("official"), figures.get("fp32-ort")
    del off, others
    step_bytes = {"fp32": decode_step_bytes(lm)}
    if lm_ort is not None:
        fp32_ort["quality"] = int8_quality(lm, lm_ort, args.decode_tokens)
        step_bytes["fp32-ort"] = decode_step_bytes(lm_ort)
        del lm_ort
    int8 = None
    if "int8" in precisions:
        lm8 = quantize_lm(twin_lm(lm), "int8")
        print("int8 LM:", flush=True)
        int8 = bench_lm(ProjectLM(lm8, args.decode_tokens), None, batches=batches, rounds=args.repeats)["project"]
        int8["quality"] = int8_quality(lm, lm8, args.decode_tokens)
        step_bytes["int8"] = decode_step_bytes(lm8)
        del lm8
    roof = None
    if args.bandwidth_mb > 0:
        rates = {name: {b: d["decode"][b]["tokens_per_s"] for b in batches}
                 for name, d in (("fp32", project), ("fp32-ort", fp32_ort), ("int8", int8)) if d is not None}
        roof = roofline(copy_bandwidth(args.bandwidth_mb << 20), step_bytes, rates)
    rtf = bench_rtf(model_dir, lm, utterance_s=args.utterance_s) if args.utterance_s > 0 else None
    first = None
    if args.first_chunk_rounds > 0:
        print("first chunk:", flush=True)
        first = bench_first_chunk(model_dir, rounds=args.first_chunk_rounds)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(_table(project, official, rtf, batches))
    b1 = project["decode"].get(1, {}).get("tokens_per_s")
    if b1:
        print(f"target fp32 batch-1 decode >= {TARGET_INT8_BATCH1:.0f} tokens/s: "
              f"{'met' if b1 >= TARGET_INT8_BATCH1 else 'missed'} ({b1:.1f} tokens/s"
              + ("" if b1 >= TARGET_INT8_BATCH1 else ": the same GEMMs as the official code, bound by the CPU's "
                 "fp32 rate; the INT8 LM is the way up") + ")")
    if fp32_ort is not None:
        print("\n".join(_fp32_ort_lines(fp32_ort, project, batches)))
    if int8 is not None:
        print("\n".join(_int8_lines(int8, batches)))
    if roof is not None:
        print("\n".join(_roofline_lines(roof)))
    if first is not None:
        print("\n".join(first_chunk_lines(first, b1)))
    print(f"peak RSS {peak_gb:.1f} GB")
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps({"project": project, "official": official, "fp32_ort": fp32_ort,
                                         "int8": int8, "roofline": roof, "rtf": rtf,
                                         "first_chunk": first,
                                         "peak_rss_gb": peak_gb, "threads": torch.get_num_threads()},
                                        indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
