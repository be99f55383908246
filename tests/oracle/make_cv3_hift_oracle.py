"""Regenerate the CosyVoice3 vocoder oracle (tests/fixtures/cv3_hift_oracle) from a checkout of the official code.

    python tests/oracle/make_cv3_hift_oracle.py --official /tmp/cosyvoice_official \
        --out tests/fixtures/cv3_hift_oracle [--official-commit SHA] [--keys-out tests/fixtures/cv3_hift_keys_full.txt]

The tiny ``hift.pt`` is pure seeded draws (:func:`random_hift3_state`: no forward pass, no reduction), so it
regenerates bit for bit and is not committed. The OFFICIAL ``CausalHiFTGenerator`` (with its
``CausalConvRNNF0Predictor``) is built at the tiny dims right after ``torch.manual_seed(NOISE_SEED)`` (the F0
predictor, its argument, first: it is built first from the yaml too), loads ``hift.pt`` as
``CosyVoice3Model.load`` does (strict, digest-checked), and computes every reference: f0, source, ``conv_post``
output and waveform, one-shot (``finalize=True``) and for one look-ahead call (``finalize=False``), and a stream
run by the official ``CosyVoice3Model.token2wav`` (a stand-in flow hands it the mel) with its chunks; the digests of
its noise buffers. It measures how far float32-scale perturbations of the mel move the waveform (the bar), and
writes the key / shape / dtype list of the official module at the released yaml's dims.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_flow_oracle import (  # noqa: E402
    SPREAD_PERTURBATIONS,
    SPREAD_SEEDS,
    patched,
    recorded_draws,
    sha256,
    waveform_spread,
)
from make_llm_oracle import state_digest  # noqa: E402
from oracle_common import checkout_commit, oracle_parser, package_version, write_meta  # noqa: E402

WEIGHT_SEED = 20251203
NOISE_SEED = 1234  # torch.manual_seed right before the official CausalHiFTGenerator is constructed
INPUT_SEED = 778
#: f0 = |classifier(h)|: the bias centres it and the weight scale spreads it, so that most frames are voiced
#: (> 10 Hz) at 50-400 Hz and a few are not. Chosen once by looking at the tiny model's f0; constants, no
#: calibration pass (which would tie the weights to the CPU's last bits).
F0_BIAS = 150.0
F0_WEIGHT_SCALE = 120.0
#: weight-norm magnitudes g = GAIN * (1 + 0.1 N) per module (prefix), others 1
GAINS = {"conv_post": 0.5, "resblocks": 0.5, "source_resblocks": 0.5}
YAML = "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml"
# cases: (name, frames, finalize); the stream runs token2wav on STREAM_FRAMES frames with calls at STREAM_CALLS
CASES = [("nonstream", 60, True), ("lookahead", 60, False)]
STREAM_FRAMES = 160
STREAM_CALLS = (50, 100, 160)  # mel frames handed to the vocoder so far; the last call finalizes
TOKEN_MEL_RATIO = 2


def tiny_dims():
    from cosyvoice_triton.models.cosyvoice3.hift import Hift3Dims

    return Hift3Dims.tiny()


# ------------------------------------------------------------------------------------------------ weights
def _gain(key: str) -> float:
    for prefix, gain in GAINS.items():
        if key.startswith(prefix + "."):
            return gain
    return 1.0


def random_hift3_state(dims=None, seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    """A ``CausalHiFTGenerator`` state_dict in the official format from seeded draws only.

    ``torch.Generator().manual_seed(seed)`` draws ``randn`` for each key in sorted order: weight-norm directions
    (``original1``) N(0, 1); magnitudes (``original0``) ``gain * (1 + 0.1 N)`` (not the norm of the direction);
    Snake alpha ``1 + 0.1 N``; biases ``0.02 N``; plain weights ``N / sqrt(fan_in)``; the F0 classifier
    ``F0_WEIGHT_SCALE * N / sqrt(fan_in)`` and bias ``F0_BIAS + 10 N``. Only elementwise float32 arithmetic.
    """
    from cosyvoice_triton.models.cosyvoice3.hift import CausalHiFTGenerator

    with torch.random.fork_rng():  # the module's own initialisation draws from the global generator
        layout = {k: v.shape for k, v in CausalHiFTGenerator(dims or tiny_dims()).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(layout):
        shape = layout[key]
        n = torch.randn(shape, generator=gen)
        if key.endswith("original1"):
            value = n
        elif key.endswith("original0"):
            value = (1.0 + 0.1 * n) * _gain(key)
        elif key.endswith(".alpha"):
            value = 1.0 + 0.1 * n
        elif key == "f0_predictor.classifier.bias":
            value = F0_BIAS + 10.0 * n
        elif key.endswith("bias"):
            value = 0.02 * n
        else:
            fan_in = int(np.prod(shape[1:]))
            scale = F0_WEIGHT_SCALE if key == "f0_predictor.classifier.weight" else 1.0
            value = n * (scale / fan_in**0.5)
        state[key] = value.contiguous()
    return state


def write_weights(folder: Path, seed: int = WEIGHT_SEED) -> str:
    """``hift.pt`` under ``folder`` (``torch.save(state_dict)``); returns its state digest."""
    folder.mkdir(parents=True, exist_ok=True)
    state = random_hift3_state(seed=seed)
    torch.save(state, folder / "hift.pt")
    return state_digest(state)


# ------------------------------------------------------------------------------------------------ official
def official_hift3(gen_mod, f0_mod, dims, noise_seed: int = NOISE_SEED):
    """The official ``CausalHiFTGenerator`` at ``dims``: its F0 predictor first, then ``torch.manual_seed`` and
    the generator (whose construction draws the causal source's noise buffers)."""
    f0 = f0_mod.CausalConvRNNF0Predictor(num_class=dims.f0_num_class, in_channels=dims.f0_in_channels,
                                         cond_channels=dims.f0_cond_channels)
    torch.manual_seed(noise_seed)
    return gen_mod.CausalHiFTGenerator(
        in_channels=dims.in_channels, base_channels=dims.base_channels, nb_harmonics=dims.nb_harmonics,
        sampling_rate=dims.sampling_rate, nsf_alpha=dims.nsf_alpha, nsf_sigma=dims.nsf_sigma,
        nsf_voiced_threshold=dims.nsf_voiced_threshold, upsample_rates=list(dims.upsample_rates),
        upsample_kernel_sizes=list(dims.upsample_kernel_sizes),
        istft_params={"n_fft": dims.n_fft, "hop_len": dims.hop_len},
        resblock_kernel_sizes=list(dims.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in dims.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(dims.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in dims.source_resblock_dilation_sizes],
        lrelu_slope=dims.lrelu_slope, audio_limit=dims.audio_limit, conv_pre_look_right=dims.conv_pre_look_right,
        f0_predictor=f0)


class _MelFlow(torch.nn.Module):
    """Stands in for the flow in ``CosyVoice3Model.token2wav``: the mel of the first ``len(token)`` tokens."""

    def __init__(self, mel: torch.Tensor):
        super().__init__()
        self.mel, self.token_mel_ratio = mel, TOKEN_MEL_RATIO

    def inference(self, token, **_):
        return self.mel[:, :, :token.shape[1] * self.token_mel_ratio], None


def _np(t):
    return t.detach().cpu().numpy().copy()


def run_hift(hift, mel: np.ndarray, finalize: bool) -> dict:
    """Official ``hift.inference(mel, finalize)`` with its f0 (float64, before the cast), conv_post output and
    source; asserts that it draws no random number."""
    rec: dict = {}
    hooks = [hift.f0_predictor.register_forward_hook(lambda m, i, o: rec.update(f0=_np(o))),
             hift.conv_post.register_forward_hook(lambda m, i, o: rec.update(conv_post_out=_np(o)))]
    draws: list = []
    try:
        with recorded_draws(draws):
            speech, source = hift.inference(speech_feat=torch.from_numpy(mel), finalize=finalize)
    finally:
        for h in hooks:
            h.remove()
    if draws:
        raise AssertionError(f"CausalHiFTGenerator.inference drew {[d[0] for d in draws]}")
    if rec["f0"].dtype != np.float64:
        raise AssertionError(f"the official f0 is {rec['f0'].dtype}, expected float64")
    rec.update(speech=_np(speech), source=_np(source))
    return rec


def noise_digests(hift, samples: int) -> dict:
    src = hift.m_source
    return {"noise_sha256": np.array(sha256(src.l_sin_gen.sine_waves[:, :samples])),
            "noise_samples": np.int64(samples)}


def make_cases(hift, out: Path, rng: np.random.Generator) -> dict:
    summary = {}
    mel_a = rng.normal(-6.0, 2.0, size=(1, 80, CASES[0][1])).astype(np.float32)
    for name, frames, finalize in CASES:
        mel = mel_a[:, :, :frames]
        start = time.perf_counter()
        rec = run_hift(hift, mel, finalize)
        fields = {"speech_feat": mel, "finalize": np.bool_(finalize), "f0": rec["f0"], "source": rec["source"],
                  "speech": rec["speech"], "noise_seed": np.int64(NOISE_SEED),
                  **noise_digests(hift, rec["source"].shape[2])}
        if name == "nonstream":  # kept for one case (file size)
            fields["conv_post_out"] = rec["conv_post_out"]
        np.savez_compressed(out / f"hift_{name}.npz", **fields)
        f0 = rec["f0"]
        summary[name] = {"frames": frames, "finalize": finalize, "f0_frames": int(f0.shape[1]),
                         "samples": int(rec["speech"].shape[1]), "voiced_fraction": float((f0 > 10).mean()),
                         "f0_min": float(f0.min()), "f0_mean": float(f0.mean()), "f0_max": float(f0.max()),
                         "speech_absmax": float(np.abs(rec["speech"]).max()),
                         "clamped_fraction": float((np.abs(rec["speech"]) >= 0.99).mean()),
                         "waveform_spread": waveform_spread(lambda m, _f=finalize: run_hift(hift, m, _f)["speech"],
                                                            mel),
                         "seconds": round(time.perf_counter() - start, 3)}
        print(f"  hift_{name}: {summary[name]}", flush=True)
    return summary


def make_stream(model, out: Path, rng: np.random.Generator) -> dict:
    """The official ``CosyVoice3Model.token2wav`` streaming (finalize False, ..., True) on a stand-in flow, and the
    same mel in one ``hift.inference`` call."""
    hift = model.hift
    mel = rng.normal(-6.0, 2.0, size=(1, 80, STREAM_FRAMES)).astype(np.float32)
    model.flow = _MelFlow(torch.from_numpy(mel))
    calls: list = []

    def inference(original):
        def run(speech_feat, finalize=True):
            speech, source = original(speech_feat=speech_feat, finalize=finalize)
            calls.append({"frames": speech_feat.shape[2], "finalize": finalize, "speech": _np(speech),
                          "source": _np(source)})
            return speech, source
        return run

    uuid = "oracle"
    model.hift_cache_dict[uuid] = None
    chunks, offset = [], 0
    draws: list = []
    with patched(hift, "inference", inference), recorded_draws(draws):
        for i, frames in enumerate(STREAM_CALLS):
            tokens = frames // TOKEN_MEL_RATIO
            speech = model.token2wav(token=torch.zeros(1, tokens, dtype=torch.int32),
                                     prompt_token=torch.zeros(1, 0, dtype=torch.int32),
                                     prompt_feat=torch.zeros(1, 0, 80), embedding=torch.zeros(1, 192),
                                     token_offset=offset, uuid=uuid, stream=True, finalize=i == len(STREAM_CALLS) - 1)
            chunks.append(_np(speech))
            offset = tokens
    if draws:
        raise AssertionError(f"token2wav drew {[d[0] for d in draws]}")
    oneshot = run_hift(hift, mel, True)
    speech = np.concatenate(chunks, axis=1)
    fields = {"speech_feat": mel, "calls_frames": np.asarray(STREAM_CALLS, np.int64),
              "chunk_lens": np.asarray([c.shape[1] for c in chunks], np.int64), "speech": speech,
              "oneshot_speech": oneshot["speech"], "oneshot_f0": oneshot["f0"],
              "noise_seed": np.int64(NOISE_SEED), **noise_digests(hift, STREAM_FRAMES * 480)}
    fields["calls_finalize"] = np.asarray([c["finalize"] for c in calls])
    for i, call in enumerate(calls):
        if call["frames"] != STREAM_CALLS[i]:
            raise AssertionError(f"token2wav handed the vocoder {call['frames']} frames, expected {STREAM_CALLS[i]}")
    np.savez_compressed(out / "hift_stream.npz", **fields)
    n = min(speech.shape[1], oneshot["speech"].shape[1])
    summary = {"frames": STREAM_FRAMES, "calls_frames": list(STREAM_CALLS), "chunk_lens": fields["chunk_lens"].tolist(),
               "call_samples": [int(c["speech"].shape[1]) for c in calls],
               "stream_vs_oneshot_max_abs": float(np.abs(speech[:, :n] - oneshot["speech"][:, :n]).max()),
               "voiced_fraction": float((oneshot["f0"] > 10).mean()),
               "speech_absmax": float(np.abs(speech).max()),
               "waveform_spread": waveform_spread(lambda m: run_hift(hift, m, True)["speech"], mel)}
    print(f"  hift_stream: {summary}", flush=True)
    return summary


def check_unused_draws(hift, mel: np.ndarray) -> dict:
    """Zero the official ``rand_ini`` and ``SourceModuleHnNSF.uv`` buffers: the output must not change."""
    ref = run_hift(hift, mel, True)["speech"]
    src = hift.m_source
    saved = src.l_sin_gen.rand_ini.clone(), src.uv.clone()
    digests = {"rand_ini_sha256": sha256(saved[0]), "uv_prefix_sha256": sha256(saved[1][:, :mel.shape[2] * 480])}
    src.l_sin_gen.rand_ini.zero_()
    src.uv.zero_()
    try:
        changed = float(np.abs(run_hift(hift, mel, True)["speech"] - ref).max())
    finally:
        src.l_sin_gen.rand_ini.copy_(saved[0])
        src.uv.copy_(saved[1])
    if changed != 0.0:
        raise AssertionError(f"zeroing rand_ini and uv changed the waveform by {changed}")
    return {**digests, "max_change_zeroing_rand_ini_and_uv": changed,
            "buffer_shapes": {"rand_ini": list(saved[0].shape), "sine_waves": list(src.l_sin_gen.sine_waves.shape),
                              "uv": list(saved[1].shape)}}


def full_keys(gen_mod, f0_mod, official: Path, keys_out: Path) -> dict:
    """Key / shape / dtype of the official module at the released yaml's dims (read with the project's parser)."""
    from cosyvoice_triton.config import load_hyperpyyaml
    from cosyvoice_triton.models.cosyvoice3.hift import Hift3Dims

    dims = Hift3Dims.from_section(load_hyperpyyaml((official / YAML).read_text())["hift"])
    if dims != Hift3Dims.full():
        raise AssertionError(f"the official yaml's hift dims {dims} are not Hift3Dims.full()")
    with torch.random.fork_rng():
        module = official_hift3(gen_mod, f0_mod, dims)
    state = module.state_dict()
    lines = [f"{k}\t{tuple(v.shape)}\t{str(v.dtype).removeprefix('torch.')}" for k, v in state.items()]
    keys_out.write_text("\n".join(lines) + "\n")
    return {"dims": json.loads(json.dumps(dataclasses.asdict(dims))), "tensors": len(state),
            "parameters": sum(p.numel() for p in module.parameters())}


def _versions(official: Path, official_commit: str | None) -> dict:
    return {"official_commit": checkout_commit(official, official_commit),
            "torch": torch.__version__, "numpy": np.__version__, "scipy": package_version("scipy"),
            "python": sys.version.split()[0], "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = oracle_parser(__doc__)
    ap.add_argument("--keys-out", type=Path, default=ROOT / "tests" / "fixtures" / "cv3_hift_keys_full.txt")
    args = ap.parse_args(argv)
    from cosyvoice_triton.bench.official import STUBBED, import_official

    model_mod, gen_mod, f0_mod = import_official(args.official, "cosyvoice.cli.model", "cosyvoice.hifigan.generator",
                                                 "cosyvoice.hifigan.f0_predictor")
    args.out.mkdir(parents=True, exist_ok=True)
    timings = {}
    dims = tiny_dims()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        digest = write_weights(tmp)
        size = (tmp / "hift.pt").stat().st_size
        timings["seeded weights"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        hift = official_hift3(gen_mod, f0_mod, dims)
        for name in ("llm.pt", "flow.pt"):
            torch.save({}, tmp / name)
        # CosyVoice3Model.load, literally: strict loads, "generator." removed from the HiFT keys
        model = model_mod.CosyVoice3Model(torch.nn.Module(), torch.nn.Module(), hift)
        model.load(str(tmp / "llm.pt"), str(tmp / "flow.pt"), str(tmp / "hift.pt"))
        timings["official build + strict load"] = round(time.perf_counter() - start, 3)
    if state_digest(hift.state_dict()) != digest:
        raise AssertionError("the official CausalHiFTGenerator does not hold the written hift.pt after the load")
    rng = np.random.default_rng(INPUT_SEED)
    print("cases", flush=True)
    start = time.perf_counter()
    cases = make_cases(hift, args.out, rng)
    stream = make_stream(model, args.out, rng)
    with np.load(args.out / "hift_nonstream.npz") as z:
        unused = check_unused_draws(hift, z["speech_feat"])
    timings["references"] = round(time.perf_counter() - start, 3)
    print("full-size keys", flush=True)
    start = time.perf_counter()
    full = full_keys(gen_mod, f0_mod, args.official, args.keys_out)
    timings["full-size official module"] = round(time.perf_counter() - start, 3)
    meta = {
        "versions": _versions(args.official, args.official_commit), "stubbed_modules": STUBBED,
        "seeds": {"weights": WEIGHT_SEED, "noise": NOISE_SEED, "inputs": INPUT_SEED, "spread": list(SPREAD_SEEDS)},
        "dims": json.loads(json.dumps(dataclasses.asdict(dims))),
        "weights": {"how": "make_cv3_hift_oracle.random_hift3_state (seeded draws only)", "state_sha256": digest,
                    "file_bytes": size, "f0_bias": F0_BIAS, "f0_weight_scale": F0_WEIGHT_SCALE, "gains": GAINS},
        "hift_cases": {**cases, "stream": stream}, "unused_draws": unused, "full": full,
        "spread_perturbations": [list(p) for p in SPREAD_PERTURBATIONS], "timings_s": timings,
    }
    write_meta(args.out, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
