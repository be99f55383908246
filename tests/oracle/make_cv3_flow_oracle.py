"""Regenerate the CosyVoice3 flow oracle (tests/fixtures/cv3_flow_oracle) from a checkout of the official code.

    python tests/oracle/make_cv3_flow_oracle.py --official /tmp/cosyvoice_official \
        --out tests/fixtures/cv3_flow_oracle [--official-commit SHA] [--keys-full tests/fixtures/cv3_flow_keys_full.txt]

The tiny ``flow.pt`` is made of seeded ``torch.Generator`` draws in the official format (:func:`oracle_state`; no
forward pass, no reduction, so it regenerates bit for bit and is not committed). The official
``CausalMaskedDiffWithDiT`` is built by HyperPyYAML from the ``flow:`` section of the official ``cosyvoice3.yaml``
with the tiny dims as overrides, loads the file strictly and is checked by digest; then the OFFICIAL code computes
every reference: one DiT estimator call (batch 2, one item padded, non-streaming and streaming) and the flow's
``inference`` as ``CosyVoice3Model.token2wav`` calls it (non-streaming, streaming chunks with look-ahead, the last
call), with the stages in between (speaker projection, ``mu``, ``conds``, the fixed noise, the time grid, the
estimator's input and output at kept Euler steps). ``--keys-full`` writes the key / shape / dtype list of the
official flow at the yaml's own dims (built on the meta device: no weights). See tests/oracle/cosyvoice3_flow.md.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from make_flow_oracle import patched, recorded_draws, sha256  # noqa: E402
from make_llm_oracle import state_digest  # noqa: E402
from oracle_common import checkout_commit, oracle_parser, package_version, write_meta  # noqa: E402

from cosyvoice_triton.models.cosyvoice3.dit import rotary_inv_freq  # noqa: E402
from cosyvoice_triton.models.cosyvoice3.flow import CausalMaskedDiffWithDiT, Flow3Dims  # noqa: E402

WEIGHT_SEED = 20251203
INPUT_SEED = 3003
SPEECH_TOKENS = 6561
INV_FREQ_KEY = "decoder.estimator.rotary_embed.inv_freq"
# (case, Tp, Ts (a prefix of the case's source tokens), Tf, streaming, finalize, token_offset). The stream cases
# follow CosyVoice3Model.tts with 20 prompt tokens: the first hop is 25 + 5 (prompt padding to the 25-token chunk)
# tokens + 3 look-ahead, the second 50 + 3 from offset 30, the last call has every token with finalize=True and the
# tts default streaming=False ("stream_final"); "stream_final_chunked" is that call with streaming=True.
STREAM_SOURCE = 90
FLOW_CASES = [("nonstream", 15, 40, 30, False, True, 0), ("misaligned", 12, 20, 25, False, True, 0),
              ("stream_chunk1", 20, 33, 40, True, False, 0), ("stream_chunk2", 20, 83, 40, True, False, 30),
              ("stream_final", 20, 90, 40, False, True, 80), ("stream_final_chunked", 20, 90, 40, True, True, 80)]
EST_STEPS = (0, 9)  # Euler steps whose estimator input / output are kept (all 10 run)
ESTIMATOR_CASE = {"T": 130, "pad_from": 90, "t": (0.3, 0.85)}
#: The yaml's estimator / look-ahead values the tiny dims override (every other value is the yaml's own).
TINY_OVERRIDES = {"flow": {"pre_lookahead_layer": {"channels": 64},
                           "decoder": {"estimator": {"dim": 64, "depth": 2, "heads": 4, "dim_head": 16}}}}
YAML = "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml"
#: Top-level keys of cosyvoice3.yaml the flow section refers to, kept with it.
YAML_KEYS = ("spk_embed_dim", "token_frame_rate", "token_mel_ratio", "chunk_size", "num_decoding_left_chunks", "flow")


def oracle_dims() -> Flow3Dims:
    return Flow3Dims.tiny()


# ------------------------------------------------------------------------------------------------ weights
def _std(key: str, shape: tuple[int, ...]) -> float:
    """The draw's scale: N(0, 1) embeddings and speaker projection (its input is L2-normalised), 1/sqrt(fan-in) for
    other weights, 0.02 for biases: unit-scale activations through every layer."""
    if key == "input_embedding.weight" or key == "spk_embed_affine_layer.weight":
        return 1.0
    if key.endswith(".bias"):
        return 0.02
    fan_in = int(np.prod(shape[1:]))
    return 1.0 / fan_in**0.5


def oracle_state(seed: int = WEIGHT_SEED, inv_freq: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tiny flow's state_dict: one ``torch.randn`` draw per key from a generator seeded ``seed``, keys in sorted
    order, times the scale of :func:`_std`. The rotary ``inv_freq`` buffer is not drawn: it is the release's formula,
    or the exact float32 values ``inv_freq`` (``float.hex`` strings, as the oracle meta records them)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalMaskedDiffWithDiT(oracle_dims()).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(shapes):
        if key == INV_FREQ_KEY:
            continue
        state[key] = torch.randn(shapes[key], generator=gen) * _std(key, shapes[key])
    if inv_freq is None:
        state[INV_FREQ_KEY] = rotary_inv_freq(oracle_dims().dit.dim_head)
    else:
        state[INV_FREQ_KEY] = torch.tensor([float.fromhex(v) for v in inv_freq], dtype=torch.float32)
    return {k: state[k] for k in sorted(state)}


def write_weights(folder: Path, seed: int = WEIGHT_SEED, inv_freq: list[str] | None = None) -> str:
    """``flow.pt`` under ``folder`` (``torch.save`` of the state_dict, as the release stores it); returns its digest."""
    folder.mkdir(parents=True, exist_ok=True)
    state = oracle_state(seed, inv_freq)
    torch.save(state, folder / "flow.pt")
    return state_digest(state)


# ------------------------------------------------------------------------------------------------ official model
def flow_yaml(official: Path) -> str:
    """The ``flow:`` section of the official cosyvoice3.yaml with the top-level values it refers to."""
    text = (official / YAML).read_text()
    blocks = re.split(r"\n(?=[^\s#])", text)
    keep = [b for b in blocks if b.split(":", 1)[0].strip() in YAML_KEYS]
    return "\n".join(keep) + "\n"


def official_flow(official: Path, overrides: dict | None):
    """The official ``CausalMaskedDiffWithDiT`` built by HyperPyYAML from the yaml's flow section (eval mode)."""
    from hyperpyyaml import load_hyperpyyaml

    from cosyvoice_triton.bench.official import import_official

    import_official(official, "cosyvoice.flow.flow", "cosyvoice.flow.DiT.dit", "cosyvoice.flow.flow_matching")
    return load_hyperpyyaml(flow_yaml(official), overrides=overrides or {})["flow"].eval()


def full_keys(official: Path, out: Path) -> int:
    """Key, shape and dtype of every tensor of the official flow at the yaml's dims (built on the meta device)."""
    with torch.device("meta"):
        flow = official_flow(official, None)
    lines = [f"{k}\t{tuple(v.shape)}\t{str(v.dtype).replace('torch.', '')}" for k, v in flow.state_dict().items()]
    out.write_text("\n".join(lines) + "\n")
    return sum(v.numel() for v in flow.state_dict().values())


# ------------------------------------------------------------------------------------------------ references
def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def run_flow(flow, token, prompt_token, prompt_feat, embedding, streaming, finalize) -> dict:
    """One official ``flow.inference`` with the intermediates the tests check."""
    rec: dict = {"est": []}
    hooks = [flow.spk_embed_affine_layer.register_forward_hook(lambda m, i, o: rec.update(spk_proj=_np(o))),
             flow.input_embedding.register_forward_hook(lambda m, i, o: rec.update(token_emb_raw=_np(o))),
             flow.pre_lookahead_layer.register_forward_hook(lambda m, i, o: rec.update(h_tokens=_np(o)))]

    def decoder(original):
        def forward(mu, mask, n_timesteps, temperature=1.0, spks=None, cond=None, streaming=False):
            z0 = flow.decoder.rand_noise[:, :, :mu.size(2)]
            rec.update(mu=_np(mu), mask=_np(mask), spks=_np(spks), cond=_np(cond), n_timesteps=np.int32(n_timesteps),
                       temperature=np.float32(temperature), z0_sha256=np.array(sha256(z0)),
                       decoder_streaming=np.bool_(streaming))
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
    i32 = lambda a: torch.as_tensor(a, dtype=torch.int32)
    try:
        with (patched(flow.decoder, "forward", decoder), patched(flow.decoder, "solve_euler", solve_euler),
              patched(flow.decoder.estimator, "forward", estimator), recorded_draws(draws), torch.inference_mode()):
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
    rows = _np(flow.input_embedding.weight)[np.concatenate([prompt_token, token], axis=1)]
    if not np.array_equal(rec["token_emb_raw"], rows):
        raise AssertionError("the token embeddings are not the rows of input_embedding.weight")
    mu_from_h = np.repeat(rec["h_tokens"], flow.token_mel_ratio, axis=1).transpose(0, 2, 1)
    if not np.array_equal(rec["mu"], mu_from_h):
        raise AssertionError("mu is not the look-ahead layer's output repeated token_mel_ratio times")
    rec["feat"] = _np(feat)
    est = rec.pop("est")
    assert len(est) == 10
    rec["est_steps"] = np.asarray(EST_STEPS, np.int32)
    rec["est_x"] = np.stack([est[k][0] for k in EST_STEPS])
    rec["est_t"] = np.asarray([e[1] for e in est], np.float32)
    rec["est_out"] = np.stack([est[k][2] for k in EST_STEPS])
    # token_emb_raw: rows of the regenerated weights (kept as a digest); h_tokens: mu before the repeat (asserted).
    rec["token_emb_raw_sha256"] = np.array(sha256(rec.pop("token_emb_raw")))
    del rec["h_tokens"]
    return rec


def make_flow(flow, out: Path, rng: np.random.Generator) -> dict:
    summary = {}
    stream_source = rng.integers(0, SPEECH_TOKENS, size=(1, STREAM_SOURCE)).astype(np.int32)
    stream_prompt = rng.integers(0, SPEECH_TOKENS, size=(1, 20)).astype(np.int32)
    stream_feat = rng.normal(-6.0, 2.0, size=(1, 40, 80)).astype(np.float32)
    stream_emb = rng.normal(size=(1, 192)).astype(np.float32)
    for name, tp, ts, tf, streaming, finalize, offset in FLOW_CASES:
        if name.startswith("stream"):
            token, prompt_token, prompt_feat, embedding = stream_source[:, :ts], stream_prompt, stream_feat, stream_emb
        else:
            token = rng.integers(0, SPEECH_TOKENS, size=(1, ts)).astype(np.int32)
            prompt_token = rng.integers(0, SPEECH_TOKENS, size=(1, tp)).astype(np.int32)
            prompt_feat = rng.normal(-6.0, 2.0, size=(1, tf, 80)).astype(np.float32)
            embedding = rng.normal(size=(1, 192)).astype(np.float32)
        start = time.perf_counter()
        rec = run_flow(flow, token, prompt_token, prompt_feat, embedding, streaming, finalize)
        fields = dict(token=token, prompt_token=prompt_token, prompt_feat=prompt_feat, embedding=embedding,
                      streaming=np.bool_(streaming), finalize=np.bool_(finalize), token_offset=np.int32(offset),
                      inference_cfg_rate=np.float32(0.7), pre_lookahead_len=np.int32(3), token_mel_ratio=np.int32(2),
                      **rec)
        np.savez_compressed(out / f"flow_{name}.npz", **fields)
        summary[name] = {"Tp": tp, "Ts": ts, "Tf": tf, "streaming": streaming, "finalize": finalize,
                         "token_offset": offset, "T_mel": int(rec["mu"].shape[-1]),
                         "out_frames": int(rec["feat"].shape[-1]), "feat_absmax": float(np.abs(rec["feat"]).max()),
                         "feat_std": float(rec["feat"].std()), "seconds": round(time.perf_counter() - start, 3)}
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
        summary[name] = {"B": 2, "T": t_len, "pad_from": c["pad_from"], "out_absmax": float(np.abs(_np(o)).max()),
                         "out_std_valid": float(_np(o)[0].std())}
    return summary


# ------------------------------------------------------------------------------------------------ main
def _versions(official: Path, official_commit: str | None) -> dict:
    return {"official_commit": checkout_commit(official, official_commit),
            "matcha_commit": "dd9105b34bf2be2230f4aa1e4769fb586a3c824e", "torch": torch.__version__,
            "numpy": np.__version__, "x_transformers": package_version("x-transformers"),
            "einops": package_version("einops"), "hyperpyyaml": package_version("HyperPyYAML"),
            "omegaconf": package_version("omegaconf"), "python": sys.version.split()[0],
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = oracle_parser(__doc__)
    ap.add_argument("--keys-full", type=Path, default=None, help="also write the full-dims key list there")
    ap.add_argument("--weights-out", type=Path, default=None, help="where flow.pt goes (default: a temporary folder)")
    args = ap.parse_args(argv)
    import tempfile

    from cosyvoice_triton.bench.official import STUBBED
    from cosyvoice_triton.models.cfm import cfm_noise

    args.out.mkdir(parents=True, exist_ok=True)
    timings: dict = {}
    meta_extra: dict = {}
    if args.keys_full is not None:
        start = time.perf_counter()
        meta_extra["full_params"] = full_keys(args.official, args.keys_full)
        timings["full-dims key list (meta device)"] = round(time.perf_counter() - start, 3)
        print(f"wrote {args.keys_full} ({meta_extra['full_params']} parameters)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights_out or Path(tmp)
        start = time.perf_counter()
        digest = write_weights(weights)
        timings["seeded weights"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        flow = official_flow(args.official, TINY_OVERRIDES)
        fresh_inv_freq = flow.decoder.estimator.rotary_embed.inv_freq.clone()
        flow.load_state_dict(torch.load(weights / "flow.pt", map_location="cpu", weights_only=True), strict=True)
        timings["official build + strict load"] = round(time.perf_counter() - start, 3)
        state = torch.load(weights / "flow.pt", weights_only=True)
        file_bytes = (weights / "flow.pt").stat().st_size
    if state_digest(flow.state_dict()) != digest:
        raise AssertionError("the official flow does not hold the written flow.pt after the strict load")
    if not torch.equal(fresh_inv_freq, state[INV_FREQ_KEY]):
        raise AssertionError("the official RotaryEmbedding's inv_freq differs from the project's formula")
    if not torch.equal(flow.decoder.rand_noise, cfm_noise()):
        raise AssertionError("the official CFM noise is not randn([1, 80, 15000]) after manual_seed(0)")
    est = flow.decoder.estimator
    if est.static_chunk_size != 50 or est.long_skip_connection is not None or flow.decoder.inference_cfg_rate != 0.7:
        raise AssertionError("the official flow is not configured as cosyvoice3.yaml says")

    rng = np.random.default_rng(INPUT_SEED)
    start = time.perf_counter()
    est_summary = make_estimator(est, args.out, rng)
    timings["estimator references"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    flow_summary = make_flow(flow, args.out, rng)
    timings["flow references"] = round(time.perf_counter() - start, 3)
    (args.out / "cv3_flow_dims.json").write_text(json.dumps(
        {"project": oracle_dims().to_dict(), "yaml_overrides": TINY_OVERRIDES}, indent=1) + "\n")
    groups: dict = {}
    for k, v in state.items():
        g = k.split(".")[0] if not k.startswith("decoder.") else ".".join(k.split(".")[:3])
        groups[g] = groups.get(g, 0) + v.numel()
    meta = {
        "versions": _versions(args.official, args.official_commit), "stubbed_modules": STUBBED,
        "seeds": {"weights": WEIGHT_SEED, "inputs": INPUT_SEED, "cfm_rand_noise": 0},
        "weights": {"how": "make_cv3_flow_oracle.oracle_state: torch.randn per sorted key from "
                           "torch.Generator().manual_seed(seed), times 1 (embeddings), 0.02 (biases) or "
                           "1/sqrt(fan_in); inv_freq: the release formula", "state_sha256": digest,
                    "file_bytes": file_bytes, "params": groups,
                    "rotary_inv_freq_hex": [float(v).hex() for v in state[INV_FREQ_KEY].tolist()]},
        "cfm_rand_noise_sha256": sha256(flow.decoder.rand_noise),
        "flow_cases": flow_summary, "estimator_cases": est_summary, "est_steps": list(EST_STEPS),
        "timings_s": timings, **meta_extra,
    }
    write_meta(args.out, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
