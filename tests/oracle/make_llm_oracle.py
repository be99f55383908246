"""Regenerate the CosyVoice2 LM oracle (tests/fixtures/llm_oracle) from a checkout of the official code.

    python tests/oracle/make_llm_oracle.py --official /tmp/cosyvoice_official --out DIR --size tiny|full \
        [--flow-hift [WEIGHTS_DIR]]

Writes, in the official layout, a random ``llm.pt`` and ``CosyVoice-BlankEN/`` (Qwen2 ``config.json`` and the
``model.safetensors`` that the official ``Qwen2Encoder.from_pretrained`` needs), reloads ``llm.pt`` strictly through
the official loader (``CosyVoice2Model.load``), then records what the official ``Qwen2LM.inference`` does with every
``multinomial`` draw replaced by :func:`pick` on injected uniforms: per-step log-probabilities, the token sequences,
the draws each step used. With ``--flow-hift`` (tiny only) it also records the official text -> waveform zero-shot
path (``CosyVoice2Model.tts``, non-streaming and streaming) on the tiny flow and HiFT of the flow oracle
(tests/oracle/make_flow_oracle.py: regenerated with the project's seeded code, or the ``flow.pt`` / ``hift.pt`` /
``cosyvoice2.yaml`` of WEIGHTS_DIR), and how far float32 rounding of HiFT's input moves that waveform.

See tests/oracle/README.md for how the committed files were made. The weight generation
(:func:`random_llm_state_dict`) does not need the official code: tests regenerate the full-size ``llm.pt`` with it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import itertools
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

SPEECH_TOKEN_SIZE = 6561  # cosyvoice2.yaml llm.speech_token_size; eos = 6561, stop ids 6561..6563
WEIGHT_SEED = {"tiny": 20250611, "full": 20250612}
INPUT_SEED = 4242
HIFT_SEED = 1234
# Logit scale of the random llm_decoder: logits = W h + b with h RMS-normalised, W ~ N(0, (LOGIT_STD / sqrt(H))^2),
# so the logits are ~N(0, LOGIT_STD^2): neither uniform nor one-hot; the top-25 / top-p 0.8 nucleus holds a few
# to 25 tokens. EOS gets EOS_BIAS on top, which lets it into the nucleus now and then, and FAVOURITES random speech
# tokens get FAVOURITE_BIAS, so that the nucleus often repeats a recent token and the repetition-aware fallback
# (a second draw from the whole distribution) runs too.
LOGIT_STD = 2.5
EOS_BIAS = 6.0
FAVOURITES = 8
FAVOURITE_BIAS = 7.0
LOGP_STEPS = {"tiny": 16, "full": 10}  # per-step log-probabilities kept per case (the first steps)

# Qwen2.5-0.5B, as CosyVoice2-0.5B/CosyVoice-BlankEN/config.json has it.
QWEN_FULL = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
# Tiny: same structure (GQA 2:1, tied embeddings, q/k/v bias), small enough to commit. The text vocabulary is cut to
# 2048 ids; text token ids of the cases stay below it.
QWEN_TINY = {**QWEN_FULL, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 3,
             "max_window_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
             "bos_token_id": 0, "eos_token_id": 0}

# (name, mode, text length, prompt text length, prompt speech token count). Modes as the official front end feeds the
# LM: zero_shot (frontend_zero_shot: prompt text + prompt speech tokens), cross_lingual (frontend_cross_lingual: both
# removed), instruct (frontend_instruct2: the instruct text in place of the prompt text, no prompt speech tokens).
CASES = {
    "tiny": [("zero_shot_a", "zero_shot", 7, 5, 20), ("zero_shot_b", "zero_shot", 13, 9, 37),
             ("zero_shot_short", "zero_shot", 3, 4, 11), ("cross_lingual", "cross_lingual", 10, 0, 0),
             ("instruct", "instruct", 8, 6, 0)],
    "full": [("zero_shot_a", "zero_shot", 9, 6, 25), ("cross_lingual", "cross_lingual", 6, 0, 0)],
}
# text -> waveform (tiny): text, prompt text and prompt speech token lengths; the prompt mel has 2 frames a token.
TTS_CASE = {"text": 24, "prompt_text": 5, "prompt_tokens": 25}


def qwen_config(size: str) -> dict:
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', not {size!r}")
    return dict(QWEN_TINY if size == "tiny" else QWEN_FULL)


def write_blank_en_config(folder: Path, size: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(qwen_config(size), indent=2) + "\n")
    return path


def _state_shapes(config: dict, speech_token_size: int) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the official Qwen2LM state_dict (llm.model.* is the transformers Qwen2ForCausalLM)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        qwen = Qwen2ForCausalLM(Qwen2Config(**config))
    shapes = {f"llm.model.{k}": tuple(v.shape) for k, v in qwen.state_dict().items()}
    hidden, n_out = config["hidden_size"], speech_token_size + 3
    shapes.update({"llm_embedding.weight": (2, hidden), "llm_decoder.weight": (n_out, hidden),
                   "llm_decoder.bias": (n_out,), "speech_embedding.weight": (n_out, hidden)})
    return shapes


def random_llm_state_dict(config: dict, *, seed: int, speech_token_size: int = SPEECH_TOKEN_SIZE
                          ) -> dict[str, torch.Tensor]:
    """Seeded random weights in the official ``llm.pt`` format (float32; deterministic on CPU for one torch).

    Every tensor is non-constant: embeddings N(0, 1); linear weights N(0, 1/fan_in); q/k/v biases N(0, 0.02^2);
    RMSNorm weights 1 + N(0, 0.1^2); ``llm_decoder`` scaled to logits of std :data:`LOGIT_STD` with bias
    N(0, 0.5^2), :data:`EOS_BIAS` added at the end-of-speech id and :data:`FAVOURITE_BIAS` at a few speech ids.
    The tied ``lm_head`` shares ``embed_tokens``.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = _state_shapes(config, speech_token_size)
    hidden = config["hidden_size"]
    tied = "llm.model.lm_head.weight" if config.get("tie_word_embeddings") else None
    state: dict[str, torch.Tensor] = {}
    for key in sorted(shapes):
        if key == tied:
            continue
        shape = shapes[key]
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if key == "llm_decoder.weight":
            x *= LOGIT_STD / hidden**0.5
        elif key == "llm_decoder.bias":
            x *= 0.5
            x[speech_token_size] += EOS_BIAS
            x[torch.randperm(speech_token_size, generator=gen)[:FAVOURITES]] += FAVOURITE_BIAS
        elif key.endswith(("embedding.weight", "embed_tokens.weight")):
            pass
        elif key.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif key.endswith(".bias"):
            x *= 0.02
        elif len(shape) == 2:
            x /= shape[1] ** 0.5
        else:
            raise AssertionError(f"no rule for {key} {shape}")
        state[key] = x
    if tied:
        state[tied] = state["llm.model.model.embed_tokens.weight"]
    return {k: state[k] for k in shapes}  # the module's key order


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over key, shape and bytes of every tensor, in key order."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().contiguous().cpu()
        h.update(f"{key}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def write_llm(out: Path, size: str) -> tuple[dict[str, torch.Tensor], float]:
    """``llm.pt`` + ``CosyVoice-BlankEN/{config.json, model.safetensors}`` under ``out``; returns the state."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    config = qwen_config(size)
    state = random_llm_state_dict(config, seed=WEIGHT_SEED[size])
    torch.save(state, out / "llm.pt")
    blank = out / "CosyVoice-BlankEN"
    write_blank_en_config(blank, size)
    qwen = {k.removeprefix("llm.model."): v.contiguous() for k, v in state.items()
            if k.startswith("llm.model.") and k != "llm.model.lm_head.weight"}
    save_file(qwen, str(blank / "model.safetensors"), metadata={"format": "pt"})
    return state, time.perf_counter() - start


# ------------------------------------------------------------------------------------------- injected draws
def pick(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw: the first index whose float64 cumulative probability exceeds ``u * total``."""
    c = torch.cumsum(probs.detach().flatten().to(torch.float64), 0)
    i = int(torch.searchsorted(c, torch.tensor([u * float(c[-1])], dtype=torch.float64), right=True))
    return min(i, c.numel() - 1)


@contextlib.contextmanager
def injected_multinomial(draws: Iterator[float], log: list, before=None):
    """Replace ``Tensor.multinomial`` / ``torch.multinomial`` (1 sample) by :func:`pick` on the next draw
    (``before(probs)``: called first, e.g. to choose that draw)."""
    original_method, original_fn = torch.Tensor.multinomial, torch.multinomial

    def multinomial(probs, num_samples, replacement=False, *, generator=None, out=None):
        if num_samples != 1 or probs.dim() != 1:
            raise AssertionError(f"oracle draw injection handles one sample from a 1-D tensor, got {num_samples} "
                                 f"from {tuple(probs.shape)}")
        if before is not None:
            before(probs)
        u = next(draws)
        index = pick(probs, u)
        log.append((u, index, probs.numel()))
        return torch.tensor([index], dtype=torch.long, device=probs.device)

    torch.Tensor.multinomial = multinomial
    torch.multinomial = multinomial
    try:
        yield
    finally:
        torch.Tensor.multinomial, torch.multinomial = original_method, original_fn


def case_draws(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).random(n)


# ------------------------------------------------------------------------------------------- official models
def build_official(official: Path, out: Path, size: str, flow_hift: Path | None):
    """``CosyVoice2Model`` of the official code, loaded through ``CosyVoice2Model.load`` (strict)."""
    from cosyvoice_triton.bench.official import import_official, official_qwen2lm

    (model_mod,) = import_official(official, "cosyvoice.cli.model")
    llm = official_qwen2lm(official, out / "CosyVoice-BlankEN", hidden_size=qwen_config(size)["hidden_size"])
    if flow_hift is None:
        flow, hift = _NoModule(), _NoModule()
        model = model_mod.CosyVoice2Model(llm, flow, hift)
        model.llm.load_state_dict(torch.load(out / "llm.pt", map_location="cpu", weights_only=True), strict=True)
        model.llm.eval()
        return model
    from cosyvoice_triton.bench.official import official_vc_model

    vc = official_vc_model(official, flow_hift)  # the official modules, built from the folder's cosyvoice2.yaml
    model = model_mod.CosyVoice2Model(llm, vc.flow, vc.hift)
    model.load(str(out / "llm.pt"), str(flow_hift / "flow.pt"), str(flow_hift / "hift.pt"))
    return model


class _NoModule(torch.nn.Module):
    """Stand-in flow/HiFT for the LM-only run at full size (CosyVoice2Model's constructor only keeps them)."""

    input_frame_rate = 25


# ------------------------------------------------------------------------------------------- references
def lm_inputs(rng: np.random.Generator, vocab: int, n_text: int, n_prompt_text: int, n_prompt_speech: int):
    text = rng.integers(0, vocab, size=n_text).astype(np.int32)
    prompt_text = rng.integers(0, vocab, size=n_prompt_text).astype(np.int32)
    prompt_speech = rng.integers(0, SPEECH_TOKEN_SIZE, size=n_prompt_speech).astype(np.int32)
    return text, prompt_text, prompt_speech


def run_official_lm(llm, text, prompt_text, prompt_speech, draws: np.ndarray, logp_steps: int) -> dict:
    """One official ``Qwen2LM.inference`` run with injected draws; what each step saw and drew."""
    steps: list[dict] = []
    original = llm.sampling_ids

    def sampling_ids(weighted_scores, decoded_tokens, sampling, ignore_eos=True):
        steps.append({"logp": weighted_scores.detach().clone(), "ignore_eos": bool(ignore_eos), "n_draws": len(log)})
        steps[-1]["sampled"] = top = original(weighted_scores, decoded_tokens, sampling, ignore_eos=ignore_eos)
        return top

    log: list = []
    t = lambda a: torch.as_tensor(a, dtype=torch.int32)[None]
    llm.sampling_ids = sampling_ids
    start = time.perf_counter()
    try:
        with injected_multinomial(iter(draws.tolist()), log):
            tokens = list(llm.inference(
                text=t(text), text_len=torch.tensor([len(text)], dtype=torch.int32),
                prompt_text=t(prompt_text), prompt_text_len=torch.tensor([len(prompt_text)], dtype=torch.int32),
                prompt_speech_token=t(prompt_speech),
                prompt_speech_token_len=torch.tensor([len(prompt_speech)], dtype=torch.int32),
                embedding=torch.zeros(1, 0), sampling=25))
    finally:
        del llm.sampling_ids
    seconds = time.perf_counter() - start
    bounds = [s["n_draws"] for s in steps] + [len(log)]
    step_draws = np.diff(bounds).astype(np.int32)
    n_steps = len(steps)
    sampled = np.asarray([s["sampled"] for s in steps], np.int32)
    if not np.array_equal(sampled[: len(tokens)], tokens):
        raise AssertionError("inference() yielded other tokens than its sampling steps picked")
    stop = -1 if n_steps == len(tokens) else int(sampled[-1])  # -1: max_len reached without a stop token
    return {
        "tokens": np.asarray(tokens, np.int32), "n_steps": np.int32(n_steps), "stop_token": np.int32(stop),
        "step_draws": step_draws, "draws_used": np.int32(len(log)),
        "logp": torch.stack([s["logp"] for s in steps[:logp_steps]]).float().numpy(),
        "ignore_eos": np.asarray([s["ignore_eos"] for s in steps], bool),
        "seconds": seconds,
    }


def make_lm_references(model, size: str, out: Path) -> dict:
    config = qwen_config(size)
    rng = np.random.default_rng(INPUT_SEED)
    summary = {}
    for i, (name, mode, n_text, n_ptext, n_pspeech) in enumerate(CASES[size]):
        text, prompt_text, prompt_speech = lm_inputs(rng, config["vocab_size"], n_text, n_ptext, n_pspeech)
        max_len = int(n_text * 20)
        draws = case_draws(INPUT_SEED + 1 + i, 2 * max_len + 2)
        r = run_official_lm(model.llm, text, prompt_text, prompt_speech, draws, LOGP_STEPS[size])
        seconds = r.pop("seconds")
        np.savez(out / f"lm_{name}.npz", mode=np.array(mode), text=text, prompt_text=prompt_text,
                 prompt_speech_token=prompt_speech, draws=draws, min_len=np.int32(n_text * 2),
                 max_len=np.int32(max_len), **r)
        summary[name] = {"mode": mode, "text_len": n_text, "prompt_text_len": n_ptext,
                         "prompt_speech_len": n_pspeech, "tokens": len(r["tokens"]), "steps": int(r["n_steps"]),
                         "draws_used": int(r["draws_used"]), "fallback_draws": int((r["step_draws"] == 2).sum()),
                         "ended_by": "max_len" if int(r["stop_token"]) < 0 else "stop token",
                         "logp_max_prob_mean": float(np.exp(r["logp"].max(-1)).mean()), "seconds": round(seconds, 3)}
        print(f"  {name}: {summary[name]}", flush=True)
    return summary


def make_tts_references(model, out: Path) -> dict:
    """Official zero-shot text -> waveform (CosyVoice2Model.tts), non-streaming and streaming, injected draws.
    Also keeps the mel of every HiFT call, and measures the waveform spread under float32-scale perturbations of the
    non-streaming HiFT input (make_flow_oracle.waveform_spread, the same noise)."""
    from make_flow_oracle import patched, recorded_draws, waveform_spread
    rng = np.random.default_rng(INPUT_SEED + 100)
    text, prompt_text, prompt_tokens = lm_inputs(rng, QWEN_TINY["vocab_size"], TTS_CASE["text"],
                                                 TTS_CASE["prompt_text"], TTS_CASE["prompt_tokens"])
    prompt_mel = rng.normal(-6.0, 2.0, size=(1, 2 * len(prompt_tokens), 80)).astype(np.float32)
    embedding = rng.normal(size=(1, 192)).astype(np.float32)
    draws = case_draws(INPUT_SEED + 200, 2 * 20 * len(text) + 2)
    summary = {}
    for stream in (False, True):
        tokens: list[int] = []
        original = model.llm.inference

        def inference(*args, _original=original, _tokens=tokens, **kwargs):
            for tok in _original(*args, **kwargs):
                _tokens.append(int(tok))
                yield tok

        calls: list = []

        def hift_inference(original, _calls=calls):
            def run(speech_feat, cache_source=None):
                if cache_source is None:
                    cache_source = torch.zeros(1, 1, 0)
                hift_draws: list = []
                with recorded_draws(hift_draws):
                    speech, src = original(speech_feat=speech_feat, cache_source=cache_source)
                _calls.append({"mel": speech_feat.detach().numpy().copy(), "draws": hift_draws})
                return speech, src
            return run

        model.llm.inference = inference
        model.token_hop_len = 25  # a fresh instance's hop (the official instance never resets it)
        log: list = []
        torch.manual_seed(HIFT_SEED)
        start = time.perf_counter()
        try:
            with injected_multinomial(iter(draws.tolist()), log), patched(model.hift, "inference", hift_inference):
                chunks = [o["tts_speech"] for o in model.tts(
                    text=torch.as_tensor(text)[None], flow_embedding=torch.as_tensor(embedding),
                    llm_embedding=torch.as_tensor(embedding), prompt_text=torch.as_tensor(prompt_text)[None],
                    llm_prompt_speech_token=torch.as_tensor(prompt_tokens)[None],
                    flow_prompt_speech_token=torch.as_tensor(prompt_tokens)[None],
                    prompt_speech_feat=torch.as_tensor(prompt_mel), stream=stream)]
        finally:
            del model.llm.inference
        seconds = time.perf_counter() - start
        speech = torch.cat(chunks, dim=1).numpy()
        name = "tts_zero_shot_stream" if stream else "tts_zero_shot"
        np.savez(out / f"{name}.npz", text=text, prompt_text=prompt_text, prompt_speech_token=prompt_tokens,
                 prompt_speech_feat=prompt_mel, embedding=embedding, draws=draws, stream=np.bool_(stream),
                 seed=np.int32(HIFT_SEED), tokens=np.asarray(tokens, np.int32), speech=speech,
                 chunk_lens=np.asarray([c.shape[1] for c in chunks], np.int64), draws_used=np.int32(len(log)),
                 n_hift_calls=np.int32(len(calls)), **{f"hift{i}_mel": c["mel"] for i, c in enumerate(calls)})
        summary[name] = {"tokens": len(tokens), "samples": int(speech.shape[1]),
                         "chunk_lens": [int(c.shape[1]) for c in chunks],
                         "speech_absmax": float(np.abs(speech).max()), "seconds": round(seconds, 3)}
        if not stream:
            def hift_call(mel, _replay=calls[0]["draws"]):
                with recorded_draws([], _replay), torch.inference_mode():
                    return model.hift.inference(speech_feat=torch.from_numpy(mel))[0].numpy()

            if not np.array_equal(hift_call(calls[0]["mel"]), speech):
                raise AssertionError("the replayed official HiFT does not reproduce the waveform")
            summary[name]["waveform_spread"] = waveform_spread(hift_call, calls[0]["mel"])
        print(f"  {name}: {summary[name]}", flush=True)
    return summary


# ------------------------------------------------------------------------------------------- bistream (live text)
# (name, mode, text chunk sizes, prompt text length, prompt speech count, stop id to aim the first full-distribution
# draw of the text phase at (None: plain draws)). The official front end hands inference_bistream one text token at a
# time; the LM also takes chunks of several tokens (its loop body then runs once per chunk).
BISTREAM_CASES = [
    ("bistream_runout", "zero_shot", [1] * 24, 5, 20, None),  # prompt speech used up mid-text
    ("bistream_left", "zero_shot", [1] * 8, 4, 60, None),  # prompt speech left when the text ends (dropped)
    ("bistream_cross_lingual", "cross_lingual", [1] * 17, 0, 0, None),
    ("bistream_instruct", "instruct", [1] * 13, 6, 0, None),
    ("bistream_chunks", "zero_shot", [7, 1, 12, 3, 9, 2], 5, 23, None),  # pieces of many tokens
    ("bistream_sampled_fill", "zero_shot", [1] * 22, 5, 20, 6563),  # a fill token sampled, not forced
    ("bistream_raises", "cross_lingual", [1] * 15, 0, 0, 6562),  # official: ValueError mid-stream
]
BISTREAM_LOGP_STEPS = 4  # per-step log-probabilities kept per bistream case (the first sampled steps)


def run_official_bistream(llm, chunks: list[np.ndarray], prompt_text, prompt_speech, draws: np.ndarray,
                          target: int | None) -> dict:
    """One official ``Qwen2LM.inference_bistream`` run, the text a generator of int32 [1, n] chunks, injected draws.

    ``target``: the first full-distribution draw (the repetition fallback) while the text is read picks this id
    (its ``u`` is the midpoint of the id's CDF interval); the ``draws`` returned are those actually used."""
    steps: list[dict] = []
    used: list[float] = []
    state = {"ignore_eos": None, "aimed": target is None}
    original = llm.sampling_ids
    plain = iter(draws.tolist())

    def sampling_ids(weighted_scores, decoded_tokens, sampling, ignore_eos=True):
        state["ignore_eos"] = bool(ignore_eos)
        steps.append({"logp": weighted_scores.detach().clone(), "ignore_eos": bool(ignore_eos), "n_draws": len(used),
                      "step": len(decoded_tokens)})
        steps[-1]["sampled"] = top = original(weighted_scores, decoded_tokens, sampling, ignore_eos=ignore_eos)
        return top

    class Draws:
        def __iter__(self):
            return self

        def __next__(self):
            u = next(plain)
            used.append(u)
            return u

    def aim(probs):  # called by the injected multinomial before it reads the next draw
        if state["aimed"] or probs.numel() != SPEECH_TOKEN_SIZE + 3 or not state["ignore_eos"]:
            return
        c = torch.cumsum(probs.detach().flatten().to(torch.float64), 0)
        lo = float(c[target - 1]) if target else 0.0
        u = (lo + float(c[target])) / 2 / float(c[-1])
        if pick(probs, u) != target:
            raise AssertionError(f"cannot aim a draw at {target}")
        state["aimed"] = True
        nonlocal plain
        plain = iter([u, *plain])

    def text_gen():
        for c in chunks:
            yield torch.as_tensor(c, dtype=torch.int32)[None]

    t = lambda a: torch.as_tensor(a, dtype=torch.int32)[None]
    log: list = []
    tokens: list[int] = []
    error = ""
    llm.sampling_ids = sampling_ids
    try:
        with injected_multinomial(Draws(), log, before=aim):
            try:
                for tok in llm.inference_bistream(
                        text=text_gen(), prompt_text=t(prompt_text),
                        prompt_text_len=torch.tensor([len(prompt_text)], dtype=torch.int32),
                        prompt_speech_token=t(prompt_speech),
                        prompt_speech_token_len=torch.tensor([len(prompt_speech)], dtype=torch.int32),
                        embedding=torch.zeros(1, 0), sampling=25):
                    tokens.append(int(tok))
            except ValueError as exc:
                error = str(exc)
    finally:
        del llm.sampling_ids
    if target is not None and not state["aimed"]:
        raise AssertionError(f"no full-distribution draw to aim at {target} while the text was read")
    bounds = [s["n_draws"] for s in steps] + [len(used)]
    sampled = np.asarray([s["sampled"] for s in steps], np.int32)
    return {
        "tokens": np.asarray(tokens, np.int32), "draws": np.asarray(used, np.float64),
        "draws_used": np.int32(len(used)), "step_draws": np.diff(bounds).astype(np.int32),
        "sampled": sampled, "sampled_at": np.asarray([s["step"] for s in steps], np.int32),
        "ignore_eos": np.asarray([s["ignore_eos"] for s in steps], bool),
        "logp": torch.stack([s["logp"] for s in steps[:BISTREAM_LOGP_STEPS]]).float().numpy(),
        "error": np.array(error),
    }


def make_bistream_references(model, out: Path) -> dict:
    config = qwen_config("tiny")
    rng = np.random.default_rng(INPUT_SEED + 300)
    summary = {}
    for i, (name, mode, sizes, n_ptext, n_pspeech, target) in enumerate(BISTREAM_CASES):
        text, prompt_text, prompt_speech = lm_inputs(rng, config["vocab_size"], sum(sizes), n_ptext, n_pspeech)
        bounds = np.cumsum([0, *sizes])
        chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
        draws = case_draws(INPUT_SEED + 400 + i, 4000)
        start = time.perf_counter()
        r = run_official_bistream(model.llm, chunks, prompt_text, prompt_speech, draws, target)
        seconds = time.perf_counter() - start
        np.savez(out / f"{name}.npz", mode=np.array(mode), text=text, chunk_sizes=np.asarray(sizes, np.int32),
                 prompt_text=prompt_text, prompt_speech_token=prompt_speech, target=np.int32(target or -1), **r)
        summary[name] = {"mode": mode, "text_len": int(sum(sizes)), "chunks": len(sizes), "prompt_text_len": n_ptext,
                         "prompt_speech_len": n_pspeech, "tokens": len(r["tokens"]),
                         "sampled_steps": len(r["sampled"]), "draws_used": int(r["draws_used"]),
                         "fallback_draws": int((r["step_draws"] == 2).sum()), "aimed_at": target,
                         "ended_by": r["error"].item() or "eos", "seconds": round(seconds, 3)}
        print(f"  {name}: {summary[name]}", flush=True)
    return summary


def bistream_only(args) -> int:
    """Add the bistream references to an existing tiny oracle folder (its llm.pt, checked against the meta)."""
    meta_path = args.out / "oracle_meta.json"
    meta = json.loads(meta_path.read_text())
    if meta.get("size") != "tiny":
        raise SystemExit(f"{args.out}: --bistream-only needs the tiny oracle folder")
    model = build_official(args.official, args.out, "tiny", None)
    if state_digest(dict(model.llm.state_dict())) != meta["weights"]["state_sha256"]:
        raise AssertionError(f"{args.out}/llm.pt is not the weights the meta records")
    print("Qwen2LM.inference_bistream references", flush=True)
    meta["bistream_cases"] = make_bistream_references(model, args.out)
    meta["bistream_versions"] = _versions(args.official, args.official_commit)
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


def _resolve_flow_hift(args) -> dict | None:
    """Turn ``--flow-hift`` into a weights folder (regenerated when no folder is given); the meta entry."""
    if args.flow_hift is None:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_flow_oracle
    import tempfile

    import make_flow_oracle

    if args.flow_hift == "":
        args.weights_tmp = tempfile.TemporaryDirectory()  # removed with args
        args.flow_hift = Path(args.weights_tmp.name)
        digests = make_flow_oracle.write_weights(args.flow_hift)
        how = f"tests/oracle/make_flow_oracle.py write_weights (seed {make_flow_oracle.WEIGHT_SEED})"
    else:
        args.flow_hift = Path(args.flow_hift)
        digests = {n: state_digest(torch.load(args.flow_hift / n, map_location="cpu", weights_only=True))
                   for n in ("flow.pt", "hift.pt")}
        how = "given folder"
    return {"weights": how, "state_sha256": digests}


def tts_only(args, flow_hift_meta: dict) -> int:
    """Re-make the text -> waveform references (tts_zero_shot*.npz and their meta entries) of an existing tiny
    oracle folder (its llm.pt, checked against the meta)."""
    meta_path = args.out / "oracle_meta.json"
    meta = json.loads(meta_path.read_text())
    if meta.get("size") != "tiny":
        raise SystemExit(f"{args.out}: --tts-only needs the tiny oracle folder")
    model = build_official(args.official, args.out, "tiny", args.flow_hift)
    if state_digest(dict(model.llm.state_dict())) != meta["weights"]["state_sha256"]:
        raise AssertionError(f"{args.out}/llm.pt is not the weights the meta records")
    print("text -> waveform references", flush=True)
    meta["tts_cases"] = make_tts_references(model, args.out)
    meta["flow_hift"] = flow_hift_meta
    meta["tts_versions"] = _versions(args.official, args.official_commit)
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


def _versions(official: Path, official_commit: str | None) -> dict:
    import subprocess

    def pkg(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "-C", str(official), "rev-parse", "HEAD"], capture_output=True, text=True)
    import transformers

    return {"official_commit": official_commit or commit.stdout.strip() or "unknown (not a git checkout)",
            "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
            "diffusers": pkg("diffusers"), "python": sys.version.split()[0], "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--official", type=Path, required=True, help="checkout of FunAudioLLM/CosyVoice")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--official-commit", default=None, help="commit of the checkout when it is a git archive")
    ap.add_argument("--flow-hift", nargs="?", const="", default=None, metavar="WEIGHTS_DIR",
                    help="also record text -> waveform on the flow oracle's tiny flow/HiFT: regenerated with "
                         "make_flow_oracle.write_weights, or the flow.pt/hift.pt/cosyvoice2.yaml of WEIGHTS_DIR")
    ap.add_argument("--tts-only", action="store_true",
                    help="only re-make the text -> waveform references of the existing tiny oracle in --out")
    ap.add_argument("--bistream-only", action="store_true",
                    help="only add the inference_bistream references to the existing tiny oracle in --out")
    args = ap.parse_args(argv)
    if args.bistream_only:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        return bistream_only(args)
    if args.flow_hift is not None and args.size != "tiny":
        ap.error("--flow-hift is for --size tiny (the flow/HiFT oracle is at tiny dims)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project, for cosyvoice_triton.bench.official
    flow_hift_meta = _resolve_flow_hift(args)
    if args.tts_only:
        if flow_hift_meta is None:
            ap.error("--tts-only needs --flow-hift")
        return tts_only(args, flow_hift_meta)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.out.mkdir(parents=True, exist_ok=True)
    timings = {}

    print(f"[{args.size}] random llm.pt + CosyVoice-BlankEN", flush=True)
    state, timings["write llm.pt + CosyVoice-BlankEN"] = write_llm(args.out, args.size)
    digest = state_digest(state)
    n_params = sum(v.numel() for k, v in state.items() if k != "llm.model.lm_head.weight")
    del state

    print("official CosyVoice2Model + strict load", flush=True)
    start = time.perf_counter()
    model = build_official(args.official, args.out, args.size, args.flow_hift)
    timings["official build + CosyVoice2Model.load (strict)"] = round(time.perf_counter() - start, 3)
    reloaded = {k: v for k, v in model.llm.state_dict().items()}
    if state_digest(reloaded) != digest:
        raise AssertionError("the official model does not hold the written llm.pt after the strict load")

    print("Qwen2LM.inference references", flush=True)
    lm = make_lm_references(model, args.size, args.out)
    tts = make_tts_references(model, args.out) if args.flow_hift is not None else None
    if args.size == "full":  # ~2 GB each: tests regenerate them (random_llm_state_dict), they are not committed
        (args.out / "llm.pt").unlink()
        shutil.rmtree(args.out / "CosyVoice-BlankEN")
        write_blank_en_config(args.out / "CosyVoice-BlankEN", args.size)

    from cosyvoice_triton.bench.official import OFFICIAL_SAMPLING, OFFICIAL_TOKEN_TEXT_RATIO, STUBBED

    meta = {"size": args.size, "versions": _versions(args.official, args.official_commit), "stubbed_modules": STUBBED,
            "seeds": {"weights": WEIGHT_SEED[args.size], "inputs": INPUT_SEED, "hift_noise": HIFT_SEED},
            "weights": {"logit_std": LOGIT_STD, "eos_bias": EOS_BIAS, "favourites": FAVOURITES,
                        "favourite_bias": FAVOURITE_BIAS, "params": n_params, "state_sha256": digest},
            "qwen_config": qwen_config(args.size), "speech_token_size": SPEECH_TOKEN_SIZE,
            "sampling": OFFICIAL_SAMPLING, "token_text_ratio": OFFICIAL_TOKEN_TEXT_RATIO,
            "logp_steps": LOGP_STEPS[args.size], "lm_cases": lm, "tts_cases": tts, "flow_hift": flow_hift_meta,
            "timings_s": timings}
    (args.out / "oracle_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
