"""Regenerate the CosyVoice2 flow + HiFT oracle (tests/fixtures/flow_oracle) from a checkout of the official code.

    python tests/oracle/make_flow_oracle.py --official /tmp/cosyvoice_official --out tests/fixtures/flow_oracle \
        [--official-commit SHA] [--weights-out DIR]

The tiny ``flow.pt`` / ``hift.pt`` come from the project's own seeded code (:func:`oracle_states`, the demo model's
weights plus perturbed weight-norm magnitudes); they are written in the official format, loaded strictly by the
official loader, checked by digest, and every reference below is computed by the OFFICIAL code: the mel front end,
the flow (encoder internals, every Euler step's estimator input/output, the mel) non-streaming, misaligned VC and
streaming chunk / final, one padded estimator call, HiFT on a mel and on the flow output (f0, source, conv_post,
speech, the random draws), and the VC path of ``CosyVoice2Model.tts`` non-streaming and streaming. It also measures
how much float32 rounding of HiFT's input mel moves the waveform (the bar of the end-to-end waveform tests).

The small references and the tiny ``hift.pt`` (1.7 MB) are committed; ``flow.pt`` (58 MB) is not: tests regenerate it
from the seeded draws with :func:`write_weights` and check both digests in ``oracle_meta.json``. ``hift.pt`` is
committed because its F0 calibration (a forward pass of the F0 predictor) and its weight-norm magnitudes (norms)
carry the last bits of the CPU's kernels: an AVX-512 machine regenerates it with another digest than an AVX2 one.
See tests/oracle/README.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_llm_oracle import state_digest  # noqa: E402
from oracle_common import checkout_commit, oracle_parser, package_version, write_meta  # noqa: E402

WEIGHT_SEED = 20251201
INPUT_SEED = 777
HIFT_SEED = 1234
HIFT_MEL_A_FRAMES = 30  # hift_melA: the first frames of the front end's mel_a_mel
CFM_NOISE_SEED = 0  # CausalConditionalCFM.__init__: set_all_random_seed(0); randn([1, 80, 15000])
SPEECH_TOKENS = 6561
#: The oracle's tiny HiFT weights, committed (see the module docstring).
HIFT_FILE = ROOT / "tests" / "fixtures" / "flow_oracle" / "hift.pt"
# (case, Tp, Ts, Tf, streaming, finalize). Stream cases span several 25-token / 50-frame chunks.
FLOW_CASES = [("nonstream", 15, 25, 30, False, True), ("vc_misaligned", 12, 20, 25, False, True),
              ("stream_chunk", 25, 28, 50, True, False), ("stream_final", 25, 40, 50, True, True)]
EST_STEPS = (0, 9)  # Euler steps whose estimator input / output are kept (all 10 were run)
ESTIMATOR_CASE = {"T": 77, "pad_from": 60, "t": (0.3, 0.85)}
E2E_CASE = {"source_tokens": 80, "prompt_tokens": 25, "prompt_frames": 50}
# HiFT input perturbations: (name, kind, size). "ulp": every element moved by one float32 ulp, up or down at random;
# "rel": + size * max|mel| * N(0, 1). Several seeds each.
SPREAD_PERTURBATIONS = [("1ulp", "ulp", 1.0), ("rel_1e-6", "rel", 1e-6), ("rel_1e-4", "rel", 1e-4)]
SPREAD_SEEDS = (1, 2, 3, 4, 5)


def sha256(a) -> str:
    a = np.ascontiguousarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a)
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()


# ------------------------------------------------------------------------------------------------ weights
def oracle_config():
    from cosyvoice_triton.config import ModelConfig

    return ModelConfig.tiny()


def oracle_states(seed: int = WEIGHT_SEED) -> tuple[dict, dict]:
    """``(flow state_dict, hift state_dict)``: the project's seeded random weights (deterministic on CPU, one torch)."""
    from cosyvoice_triton.models.demo import build_demo_models

    flow, hift = build_demo_models(oracle_config(), seed=seed, perturb_gains=True)
    return flow.state_dict(), hift.state_dict()


def write_weights(folder: Path, seed: int = WEIGHT_SEED, *, hift_file: Path | None = HIFT_FILE) -> dict[str, str]:
    """``flow.pt``, ``hift.pt`` and ``cosyvoice2.yaml`` under ``folder``; returns their state digests. ``flow.pt``
    comes from the seeded draws; ``hift.pt`` from ``hift_file`` (the committed one) where that exists, since a
    regenerated one depends on the CPU (module docstring); None: regenerated (a new oracle's weights)."""
    from cosyvoice_triton.config import write_yaml

    folder.mkdir(parents=True, exist_ok=True)
    flow, hift = oracle_states(seed)
    if hift_file is not None and hift_file.is_file():
        hift = torch.load(hift_file, map_location="cpu", weights_only=True)
    torch.save(flow, folder / "flow.pt")
    torch.save(hift, folder / "hift.pt")
    write_yaml(oracle_config(), folder / "cosyvoice2.yaml")
    return {"flow.pt": state_digest(flow), "hift.pt": state_digest(hift)}


def dims(config) -> dict:
    """The tiny dims, in the layout of a resolved cosyvoice2.yaml (what the official modules were built with)."""
    e, est, h, m = config.flow.encoder, config.flow.estimator, config.hift, config.mel
    return {
        "flow": {"encoder": {"output_size": e.output_size, "attention_heads": e.attention_heads,
                             "linear_units": e.linear_units, "num_blocks": e.num_blocks,
                             "static_chunk_size": e.static_chunk_size, "input_size": e.input_size},
                 "decoder": {"estimator": {"channels": list(est.channels), "attention_head_dim": est.attention_head_dim,
                                           "n_blocks": est.n_blocks, "num_mid_blocks": est.num_mid_blocks,
                                           "num_heads": est.num_heads, "static_chunk_size": est.static_chunk_size}}},
        "hift": {"base_channels": h.base_channels, "upsample_rates": list(h.upsample_rates),
                 "f0_predictor": {"cond_channels": h.f0_predictor.cond_channels}},
        "feat_extractor": {"n_fft": m.n_fft, "num_mels": m.num_mels, "sampling_rate": m.sampling_rate,
                           "hop_size": m.hop_size, "win_size": m.win_size, "fmin": m.fmin, "fmax": m.fmax},
    }


# ------------------------------------------------------------------------------------------------ recording
_RANDOM = ("rand", "randn", "rand_like", "randn_like", "randint", "normal", "multinomial")


@contextlib.contextmanager
def recorded_draws(log: list, replay: list | None = None):
    """Every torch random draw of the block goes to ``log`` as (function, tensor); with ``replay``, the draws are
    not made but taken from it in order (same function, same shape)."""
    originals = {name: getattr(torch, name) for name in _RANDOM}
    it = iter(replay) if replay is not None else None

    def wrap(name):
        def draw(*args, **kwargs):
            if it is not None:
                fn, value = next(it)
                out = originals[name](*args, **kwargs)
                if fn != name or value.shape != out.shape:
                    raise AssertionError(f"replay: {name}{tuple(out.shape)} drawn where {fn}{tuple(value.shape)} was")
                out = value.clone()
            else:
                out = originals[name](*args, **kwargs)
            log.append((name, out.detach().clone()))
            return out
        return draw

    for name in _RANDOM:
        setattr(torch, name, wrap(name))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


@contextlib.contextmanager
def patched(obj, name, make):
    had = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _np(t):
    return t.detach().cpu().numpy().copy()


# ------------------------------------------------------------------------------------------------ references
def test_signals() -> dict[str, np.ndarray]:
    """Deterministic 24 kHz test signals: sines + a chirp + seeded noise (a), a chord with noise (b); peak 0.9."""
    sr = 24000
    t = np.arange(28800) / sr
    a = (np.sin(2 * np.pi * 220 * t) + 0.5 * np.sin(2 * np.pi * 1250 * t)
         + 0.4 * np.sin(2 * np.pi * (100 * t + 1500 * t**2))
         + 0.1 * np.random.default_rng(INPUT_SEED).standard_normal(t.size))
    t = np.arange(24123) / sr
    b = (np.sin(2 * np.pi * 330 * t) * np.sin(2 * np.pi * 3 * t) + 0.3 * np.sin(2 * np.pi * 2900 * t)
         + 0.05 * np.random.default_rng(INPUT_SEED + 1).standard_normal(t.size))
    return {k: (0.9 * v / np.abs(v).max()).astype(np.float32)[None] for k, v in (("a", a), ("b", b))}


def make_mel(out: Path) -> dict:
    from matcha.utils import audio

    from cosyvoice_triton.config import MelConfig

    m = MelConfig()
    kw = {"n_fft": m.n_fft, "num_mels": m.num_mels, "sampling_rate": m.sampling_rate, "hop_size": m.hop_size,
          "win_size": m.win_size, "fmin": m.fmin, "fmax": m.fmax, "center": False}
    fields = {"feat_kwargs_json": np.array(json.dumps(kw))}
    for name, wav in test_signals().items():
        fields[f"mel_{name}_wav"] = wav
        fields[f"mel_{name}_mel"] = _np(audio.mel_spectrogram(torch.from_numpy(wav), **kw))
    fields["mel_basis"] = _np(audio.mel_basis[f"{m.fmax}_cpu"])
    fields["hann_window"] = _np(audio.hann_window["cpu"])
    np.savez_compressed(out / "mel_frontend.npz", **fields)
    return {k: list(v.shape) for k, v in fields.items() if v.ndim}


def run_flow(flow, token, prompt_token, prompt_feat, embedding, streaming, finalize) -> dict:
    """One official ``flow.inference`` with every intermediate the tests check."""
    rec: dict = {"est": []}
    hooks = [flow.spk_embed_affine_layer.register_forward_hook(lambda m, i, o: rec.update(spk_proj=_np(o))),
             flow.input_embedding.register_forward_hook(lambda m, i, o: rec.update(token_emb_raw=_np(o))),
             flow.encoder_proj.register_forward_hook(lambda m, i, o: rec.update(h=_np(o)))]

    def encoder(original):
        def forward(xs, xs_lens, *args, **kwargs):
            out, mask = original(xs, xs_lens, *args, **kwargs)
            rec.update(encoder_in=_np(xs), encoder_in_len=_np(xs_lens), encoder_out=_np(out), encoder_mask=_np(mask))
            return out, mask
        return forward

    def decoder(original):
        def forward(mu, mask, n_timesteps, temperature=1.0, spks=None, cond=None, streaming=False):
            z0 = flow.decoder.rand_noise[:, :, :mu.size(2)]
            rec.update(mu=_np(mu), mask=_np(mask), spks=_np(spks), cond=_np(cond), n_timesteps=np.int32(n_timesteps),
                       temperature=np.float32(temperature), z0_sha256=sha256(z0))
            return original(mu, mask, n_timesteps, temperature, spks, cond, streaming)
        return forward

    def solve_euler(original):
        def solve(x, t_span, *args, **kwargs):
            rec.update(t_span=_np(t_span))
            return original(x, t_span, *args, **kwargs)
        return solve

    def estimator(original):
        def forward(x, mask, mu, t, spks, cond, streaming=False):
            out = original(x, mask, mu, t, spks, cond, streaming=streaming)
            assert torch.equal(x[0], x[1]) and torch.equal(t[0], t[1])
            rec["est"].append((_np(x[0]), _np(t[0]), _np(out)))
            return out
        return forward

    draws: list = []
    try:
        with (patched(flow.encoder, "forward", encoder), patched(flow.decoder, "forward", decoder),
              patched(flow.decoder, "solve_euler", solve_euler), patched(flow.decoder.estimator, "forward", estimator),
              recorded_draws(draws), torch.inference_mode()):
            i32 = lambda a: torch.as_tensor(a, dtype=torch.int32)
            feat, _ = flow.inference(token=i32(token), token_len=i32([token.shape[1]]), prompt_token=i32(prompt_token),
                                     prompt_token_len=i32([prompt_token.shape[1]]),
                                     prompt_feat=torch.from_numpy(prompt_feat),
                                     prompt_feat_len=i32([prompt_feat.shape[1]]),
                                     embedding=torch.from_numpy(embedding), streaming=streaming, finalize=finalize)
    finally:
        for h in hooks:
            h.remove()
    if draws:
        raise AssertionError(f"flow.inference drew random numbers: {[d[0] for d in draws]}")
    n = int(rec["encoder_in_len"][0]) if finalize else rec["encoder_in"].shape[1]
    if not np.array_equal(rec["encoder_in"], rec["token_emb_raw"][:, :n]):
        raise AssertionError("the encoder input is not the leading token embeddings")
    rows = _np(flow.input_embedding.weight)[np.concatenate([prompt_token, token], axis=1)]
    if not np.array_equal(rec["token_emb_raw"], rows):
        raise AssertionError("the token embeddings are not the rows of input_embedding.weight")
    if not np.array_equal(rec["mu"], rec["h"].transpose(0, 2, 1)):
        raise AssertionError("mu is not h transposed")
    rec["feat"] = _np(feat)
    est = rec.pop("est")
    assert len(est) == 10
    rec["est_steps"] = np.asarray(EST_STEPS, np.int32)
    rec["est_x"] = np.stack([est[k][0] for k in EST_STEPS])
    rec["est_t"] = np.asarray([e[1] for e in est], np.float32)  # all 10 (the solver test checks the schedule)
    rec["est_out"] = np.stack([est[k][2] for k in EST_STEPS])
    rec["encoder_in_frames"] = np.int32(n)
    # Not stored, to keep the files small: encoder_in == token_emb_raw[:, :encoder_in_frames] and mu == h^T
    # (asserted above), and token_emb_raw are rows of the regenerated input_embedding (its digest is kept).
    rec["token_emb_raw_sha256"] = np.array(sha256(rec.pop("token_emb_raw")))
    del rec["encoder_in"], rec["h"]
    return rec


def make_flow(flow, out: Path, rng: np.random.Generator) -> dict:
    summary = {}
    for name, tp, ts, tf, streaming, finalize in FLOW_CASES:
        token = rng.integers(0, SPEECH_TOKENS, size=(1, ts)).astype(np.int32)
        prompt_token = rng.integers(0, SPEECH_TOKENS, size=(1, tp)).astype(np.int32)
        prompt_feat = rng.normal(-6.0, 2.0, size=(1, tf, 80)).astype(np.float32)
        embedding = rng.normal(size=(1, 192)).astype(np.float32)
        start = time.perf_counter()
        rec = run_flow(flow, token, prompt_token, prompt_feat, embedding, streaming, finalize)
        fields = dict(token=token, prompt_token=prompt_token, prompt_feat=prompt_feat, embedding=embedding,
                      streaming=np.bool_(streaming), finalize=np.bool_(finalize), inference_cfg_rate=np.float32(0.7),
                      pre_lookahead_len=np.int32(3), token_mel_ratio=np.int32(2), **rec)
        if not finalize:
            fields["context_tokens"] = token[:, -3:]
        fields["z0_sha256"] = np.array(fields["z0_sha256"])
        np.savez_compressed(out / f"flow_{name}.npz", **fields)
        summary[name] = {"Tp": tp, "Ts": ts, "Tf": tf, "streaming": streaming, "finalize": finalize,
                         "T_h": int(rec["mu"].shape[-1]), "out_frames": int(rec["feat"].shape[-1]),
                         "feat_absmax": float(np.abs(rec["feat"]).max()),
                         "seconds": round(time.perf_counter() - start, 3)}
        print(f"  flow_{name}: {summary[name]}", flush=True)
    return summary


def make_estimator(estimator, out: Path, rng: np.random.Generator) -> dict:
    c = ESTIMATOR_CASE
    t_len = c["T"]
    mask = np.ones((2, 1, t_len), np.float32)
    mask[1, :, c["pad_from"]:] = 0
    base = {"x": rng.standard_normal((2, 80, t_len)), "mu": rng.standard_normal((2, 80, t_len)),
            "spks": rng.standard_normal((2, 80)), "cond": rng.standard_normal((2, 80, t_len))}
    base = {k: v.astype(np.float32) for k, v in base.items()}
    base.update(mask=mask, t=np.asarray(c["t"], np.float32))
    summary = {}
    for streaming in (False, True):
        with torch.inference_mode():
            o = estimator(*(torch.from_numpy(base[k]) for k in ("x", "mask", "mu", "t", "spks", "cond")),
                          streaming=streaming)
        name = "estimator_stream" if streaming else "estimator_nonstream"
        np.savez_compressed(out / f"{name}.npz", **base, streaming=np.bool_(streaming), out=_np(o))
        summary[name] = {"B": 2, "T": t_len, "pad_from": c["pad_from"], "out_absmax": float(np.abs(_np(o)).max())}
    return summary


def run_hift(hift, mel: np.ndarray, replay: list | None = None, seed: int = HIFT_SEED) -> dict:
    """Official ``hift.inference`` after ``torch.manual_seed(seed)``, with f0, source, conv_post and the draws."""
    rec: dict = {}
    hooks = [hift.f0_predictor.register_forward_hook(lambda m, i, o: rec.update(f0=_np(o))),
             hift.conv_post.register_forward_hook(lambda m, i, o: rec.update(conv_post_out=_np(o)))]
    draws: list = []
    torch.manual_seed(seed)
    try:
        with recorded_draws(draws, replay), torch.inference_mode():
            speech, source = hift.inference(speech_feat=torch.from_numpy(mel))
    finally:
        for h in hooks:
            h.remove()
    rec.update(speech=_np(speech), source=_np(source), draws=draws)
    return rec


def hift_fields(rec: dict, mel: np.ndarray, keep_conv_post: bool) -> dict:
    names = [d[0] for d in rec["draws"]]
    if names != ["rand", "randn_like", "randn_like"]:
        raise AssertionError(f"HiFT drew {names}")
    (_, rand_ini), (_, noise_sine), (_, noise_source) = rec["draws"]
    fields = {"speech_feat": mel, "f0": rec["f0"], "source": rec["source"], "speech": rec["speech"],
              "seed": np.int32(HIFT_SEED), "noise_sine_sha256": np.array(sha256(noise_sine)),
              "noise_rand_ini_sha256": np.array(sha256(rand_ini)),
              "noise_source_sha256": np.array(sha256(noise_source)), "noise_sine_frames": np.int32(mel.shape[-1])}
    if keep_conv_post:
        fields["conv_post_out"] = rec["conv_post_out"]
    return fields


def make_hift(hift, out: Path, mels: dict[str, np.ndarray]) -> dict:
    summary = {}
    for name, mel in mels.items():
        rec = run_hift(hift, mel)
        again = run_hift(hift, mel, replay=rec["draws"])
        if not np.array_equal(again["speech"], rec["speech"]):
            raise AssertionError("replaying HiFT's draws does not reproduce its output")
        zeroed = [(rec["draws"][0][0], torch.zeros_like(rec["draws"][0][1])), rec["draws"][1],
                  (rec["draws"][2][0], torch.zeros_like(rec["draws"][2][1]))]
        only_sine = run_hift(hift, mel, replay=zeroed)
        np.savez_compressed(out / f"hift_{name}.npz", **hift_fields(rec, mel, keep_conv_post=name == "melA"))
        voiced = float((rec["f0"] > 10).mean())
        spread = waveform_spread(lambda m, _draws=rec["draws"]: run_hift(hift, m, replay=_draws)["speech"], mel)
        summary[f"hift_{name}"] = {
            "frames": int(mel.shape[-1]), "voiced_fraction": voiced, "f0_mean": float(rec["f0"].mean()),
            "speech_absmax": float(np.abs(rec["speech"]).max()),
            "max_change_zeroing_rand_ini_and_noise_source": float(np.abs(only_sine["speech"] - rec["speech"]).max()),
            "waveform_spread": spread}
        if voiced < 0.5:
            raise AssertionError(f"hift_{name}: only {voiced:.0%} of the frames are voiced")
        print(f"  hift_{name}: {summary[f'hift_{name}']}", flush=True)
    return summary


def perturbed(mel: np.ndarray, kind: str, size: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "ulp":
        up = rng.random(mel.shape) < 0.5
        return np.where(up, np.nextafter(mel, np.float32(np.inf)), np.nextafter(mel, np.float32(-np.inf)))
    return (mel + size * np.abs(mel).max() * rng.standard_normal(mel.shape)).astype(np.float32)


def waveform_spread(hift_call, mel: np.ndarray) -> dict:
    """How far the waveform moves (rel err: max abs diff / max |ref|) when HiFT's input mel is perturbed, with the
    same noise: ``{perturbation: [per seed]}``. ``hift_call(mel) -> speech``."""
    ref = hift_call(mel)
    scale = max(float(np.abs(ref).max()), 1e-30)
    spread = {}
    for name, kind, size in SPREAD_PERTURBATIONS:
        spread[name] = [float(np.abs(hift_call(perturbed(mel, kind, size, s)) - ref).max() / scale)
                        for s in SPREAD_SEEDS]
    return spread


def make_e2e(model, out: Path, rng: np.random.Generator) -> dict:
    c = E2E_CASE
    source = rng.integers(0, SPEECH_TOKENS, size=(1, c["source_tokens"])).astype(np.int32)
    prompt = rng.integers(0, SPEECH_TOKENS, size=(1, c["prompt_tokens"])).astype(np.int32)
    prompt_feat = rng.normal(-6.0, 2.0, size=(1, c["prompt_frames"], 80)).astype(np.float32)
    embedding = rng.normal(size=(1, 192)).astype(np.float32)
    summary = {}
    for stream in (False, True):
        calls: list = []

        def inference(original, _calls=calls):
            def run(speech_feat, cache_source=None):
                if cache_source is None:
                    cache_source = torch.zeros(1, 1, 0)
                speech, src = original(speech_feat=speech_feat, cache_source=cache_source)
                _calls.append({"mel": _np(speech_feat), "cache": _np(cache_source), "speech": _np(speech)})
                return speech, src
            return run

        model.token_hop_len = 25  # a fresh instance's hop (the official instance never resets it)
        draws: list = []
        flow_lens: list = []
        hook = model.flow.encoder_proj.register_forward_hook(lambda m, i, o, _lens=flow_lens: _lens.append(o.shape[1]))
        torch.manual_seed(HIFT_SEED)
        start = time.perf_counter()
        try:
            with patched(model.hift, "inference", inference), recorded_draws(draws):
                chunks = [o["tts_speech"] for o in model.tts(
                    source_speech_token=torch.from_numpy(source), flow_prompt_speech_token=torch.from_numpy(prompt),
                    prompt_speech_feat=torch.from_numpy(prompt_feat), flow_embedding=torch.from_numpy(embedding),
                    stream=stream)]
        finally:
            hook.remove()
        seconds = time.perf_counter() - start
        names = [d[0] for d in draws]
        if names != ["rand", "randn_like", "randn_like"] * len(calls):
            raise AssertionError(f"e2e draws: {names}")
        speech = torch.cat(chunks, dim=1).numpy()
        name = "e2e_vc_stream" if stream else "e2e_vc_nonstream"
        fields = dict(source_speech_token=source, flow_prompt_speech_token=prompt, prompt_speech_feat=prompt_feat,
                      flow_embedding=embedding, stream=np.bool_(stream), seed=np.int32(HIFT_SEED), speech=speech,
                      chunk_lens=np.asarray([ch.shape[1] for ch in chunks], np.int64),
                      flow_mu_lens=np.asarray(flow_lens, np.int32), n_hift_calls=np.int32(len(calls)))
        for i, call in enumerate(calls):
            fields[f"hift{i}_mel"] = call["mel"]
            fields[f"hift{i}_noise_sine_sha256"] = np.array(sha256(draws[3 * i + 1][1]))
            fields[f"hift{i}_noise_frames"] = np.int32(call["mel"].shape[-1])
        np.savez_compressed(out / f"{name}.npz", **fields)
        summary[name] = {"samples": int(speech.shape[1]), "chunk_lens": fields["chunk_lens"].tolist(),
                         "flow_mu_lens": flow_lens, "speech_absmax": float(np.abs(speech).max()),
                         "seconds": round(seconds, 3)}
        if not stream:
            mel, replay = calls[0]["mel"], draws[:3]

            def hift_call(m, _replay=replay):
                with recorded_draws([], _replay), torch.inference_mode():
                    return _np(model.hift.inference(speech_feat=torch.from_numpy(m))[0])

            if not np.array_equal(hift_call(mel), speech):
                raise AssertionError("the replayed official HiFT does not reproduce the e2e waveform")
            summary[name]["waveform_spread"] = waveform_spread(hift_call, mel)
        print(f"  {name}: {summary[name]}", flush=True)
    return summary


# ------------------------------------------------------------------------------------------------ main
def _versions(official: Path, official_commit: str | None) -> dict:
    return {"official_commit": checkout_commit(official, official_commit),
            "matcha_commit": "dd9105b34bf2be2230f4aa1e4769fb586a3c824e", "torch": torch.__version__,
            "numpy": np.__version__, "diffusers": package_version("diffusers"), "librosa": package_version("librosa"),
            "python": sys.version.split()[0], "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = oracle_parser(__doc__)
    ap.add_argument("--weights-out", type=Path, default=None,
                    help="where flow.pt / hift.pt / cosyvoice2.yaml go (default: a temporary folder)")
    args = ap.parse_args(argv)
    import tempfile

    from cosyvoice_triton.bench.official import STUBBED, import_official, official_vc_model

    args.out.mkdir(parents=True, exist_ok=True)
    timings = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights_out or Path(tmp)
        start = time.perf_counter()
        digests = write_weights(weights)
        timings["project seeded weights"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        import_official(args.official, "cosyvoice.cli.model")
        model = official_vc_model(args.official, weights)
        timings["official build + strict load"] = round(time.perf_counter() - start, 3)
        for name, module in (("flow.pt", model.flow), ("hift.pt", model.hift)):
            if state_digest(module.state_dict()) != digests[name]:
                raise AssertionError(f"the official model does not hold the written {name} after the strict load")
        flow_state = torch.load(weights / "flow.pt", weights_only=True)
        sizes = {n: (weights / n).stat().st_size for n in ("flow.pt", "hift.pt")}

    gen = torch.Generator().manual_seed(CFM_NOISE_SEED)
    expected_noise = torch.randn([1, 80, 15000], generator=gen)
    if not torch.equal(model.flow.decoder.rand_noise, expected_noise):
        raise AssertionError("the official CFM noise is not randn([1, 80, 15000]) after manual_seed(0)")
    rng = np.random.default_rng(INPUT_SEED)
    print("mel front end", flush=True)
    mel = make_mel(args.out)
    print("flow", flush=True)
    start = time.perf_counter()
    flow = make_flow(model.flow, args.out, rng)
    est = make_estimator(model.flow.decoder.estimator, args.out, rng)
    timings["flow + estimator references"] = round(time.perf_counter() - start, 3)
    with np.load(args.out / "mel_frontend.npz") as z_mel, np.load(args.out / "flow_nonstream.npz") as z_flow:
        mels = {"melA": z_mel["mel_a_mel"][:, :, :HIFT_MEL_A_FRAMES], "flowout": z_flow["feat"]}
    print("hift", flush=True)
    hift = make_hift(model.hift, args.out, mels)
    print("e2e", flush=True)
    start = time.perf_counter()
    e2e = make_e2e(model, args.out, rng)
    timings["e2e references"] = round(time.perf_counter() - start, 3)
    (args.out / "cosyvoice2_dims.json").write_text(json.dumps(dims(oracle_config()), indent=1) + "\n")

    flow_groups: dict = {}
    for k, v in flow_state.items():
        flow_groups[k.split(".")[0]] = flow_groups.get(k.split(".")[0], 0) + v.numel()
    meta = {
        "versions": _versions(args.official, args.official_commit), "stubbed_modules": STUBBED,
        "seeds": {"weights": WEIGHT_SEED, "perturb_generator": WEIGHT_SEED + 1, "inputs": INPUT_SEED,
                  "hift_noise": HIFT_SEED, "cfm_rand_noise": CFM_NOISE_SEED, "spread": list(SPREAD_SEEDS)},
        "weights": {"how": "cosyvoice_triton.models.demo.build_demo_models(ModelConfig.tiny(), seed, "
                           "perturb_gains=True)", "state_sha256": digests, "file_bytes": sizes,
                    "flow_params": flow_groups},
        "cfm_rand_noise_sha256": sha256(model.flow.decoder.rand_noise),
        "mel_frontend": mel, "flow_cases": flow, "estimator_cases": est, "hift_cases": hift, "e2e_cases": e2e,
        "est_steps": list(EST_STEPS), "spread_perturbations": [list(p) for p in SPREAD_PERTURBATIONS],
        "timings_s": timings,
    }
    write_meta(args.out, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
