"""Regenerate the CosyVoice3 token -> waveform oracle (tests/fixtures/cv3_token2wav_oracle) from the official code.

    python tests/oracle/make_cv3_token2wav_oracle.py --official /tmp/cosyvoice_official \
        --out tests/fixtures/cv3_token2wav_oracle [--official-commit SHA]

The OFFICIAL ``CosyVoice3Model`` is built with the official ``CausalMaskedDiffWithDiT`` (HyperPyYAML, the tiny
dims of make_cv3_flow_oracle) and ``CausalHiFTGenerator`` (the tiny dims and noise seed of make_cv3_hift_oracle),
and loads, through ``CosyVoice3Model.load``, the seeded ``flow.pt`` and ``hift.pt`` those two oracles regenerate
(their weight functions; the loaded digests must equal the ones their metas record). Each case runs the official
``tts(source_speech_token=...)``, the voice-conversion path (``vc_job``: no LM, deterministic), on a FRESH model
(the official ``tts`` grows ``token_hop_len`` on the instance and never resets it): non-streaming, streaming, and
non-streaming with ``speed`` != 1. Every ``token2wav``, flow and vocoder call is recorded, with each chunk's audio,
and the waveform spread under float32-scale perturbations of the vocoder's mel (the bar). The streaming schedule is
also scanned over several prompt and source lengths with the official ``tts`` loop and a recording stand-in for
``token2wav``, and the hop quirk is recorded (two streams on one instance). See tests/oracle/cosyvoice3_token2wav.md.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import make_cv3_flow_oracle as flow_oracle  # noqa: E402
import make_cv3_hift_oracle as hift_oracle  # noqa: E402
from make_flow_oracle import SPREAD_PERTURBATIONS, SPREAD_SEEDS, patched, recorded_draws, waveform_spread  # noqa: E402
from make_llm_oracle import state_digest  # noqa: E402
from oracle_common import oracle_parser, write_meta  # noqa: E402

INPUT_SEED = 4004
SPEECH_TOKENS = 6561
#: 20 prompt tokens: the first hop is 25 + 5 (prompt + hop a multiple of 25). 90 source tokens: chunks end at 30
#: (needs 33 tokens), 80 (needs 83), then the last call has all 90. The prompt mel has 2 frames per prompt token.
PROMPT_TOKENS, SOURCE_TOKENS = 20, 90
#: (case, source tokens used, stream, speed)
CASES = [("vc_nonstream", SOURCE_TOKENS, False, 1.0), ("vc_stream", SOURCE_TOKENS, True, 1.0),
         ("vc_speed", 40, False, 1.3)]
#: The schedule scan (token2wav replaced by a recorder): every prompt length with every source length.
SCAN_PROMPTS = (0, 1, 7, 20, 24, 25, 26, 49, 50, 61)
SCAN_SOURCES = (1, 3, 4, 27, 28, 29, 30, 32, 33, 34, 57, 58, 82, 83, 84, 130, 182, 183, 184, 250, 283, 284, 400)
#: the quirk: two streams of this length on one official instance
QUIRK = {"prompt": 20, "source": 300}
FIXTURES = ROOT / "tests" / "fixtures"


def _np(t):
    return t.detach().cpu().numpy().copy()


# ------------------------------------------------------------------------------------------------ official model
class _Modules:
    def __init__(self, official: Path):
        from cosyvoice_triton.bench.official import import_official

        self.official = official
        self.model_mod, self.gen_mod, self.f0_mod = import_official(
            official, "cosyvoice.cli.model", "cosyvoice.hifigan.generator", "cosyvoice.hifigan.f0_predictor")


def write_weights(folder: Path) -> dict:
    """``flow.pt`` and ``hift.pt`` of the existing CosyVoice3 oracles (their seeded draws), an empty ``llm.pt``;
    returns the state digests, checked against those oracles' metas."""
    digests = {"flow.pt": flow_oracle.write_weights(folder, flow_oracle.WEIGHT_SEED),
               "hift.pt": hift_oracle.write_weights(folder, hift_oracle.WEIGHT_SEED)}
    torch.save({}, folder / "llm.pt")
    for name, oracle in (("flow.pt", "cv3_flow_oracle"), ("hift.pt", "cv3_hift_oracle")):
        want = json.loads((FIXTURES / oracle / "oracle_meta.json").read_text())["weights"]["state_sha256"]
        if digests[name] != want:
            raise AssertionError(f"{name} regenerated here is not the one {oracle} was made with")
    return digests


def official_model(mods: _Modules, weights: Path, digests: dict):
    """A fresh official ``CosyVoice3Model`` with the tiny flow and vocoder, loaded by ``CosyVoice3Model.load``."""
    flow = flow_oracle.official_flow(mods.official, flow_oracle.TINY_OVERRIDES)
    hift = hift_oracle.official_hift3(mods.gen_mod, mods.f0_mod, hift_oracle.tiny_dims())
    model = mods.model_mod.CosyVoice3Model(torch.nn.Module(), flow, hift)
    model.load(str(weights / "llm.pt"), str(weights / "flow.pt"), str(weights / "hift.pt"))
    for name, module in (("flow.pt", model.flow), ("hift.pt", model.hift)):
        if state_digest(module.state_dict()) != digests[name]:
            raise AssertionError(f"the official model does not hold the written {name} after the load")
    if model.token_hop_len != 25 or model.token_max_hop_len != 100 or model.stream_scale_factor != 2:
        raise AssertionError("the official CosyVoice3Model's hops are not 25 / 100 / x2")
    return model


# ------------------------------------------------------------------------------------------------ audio cases
def run_case(model, inputs: dict, stream: bool, speed: float) -> dict:
    """The official ``tts`` for voice conversion, every call of token2wav / flow / vocoder recorded."""
    t2w, flows, hifts = [], [], []

    def token2wav(original):
        def run(token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False, finalize=False,
                speed=1.0):
            t2w.append({"tokens": int(token.shape[1]), "offset": int(token_offset), "stream": bool(stream),
                        "finalize": bool(finalize), "speed": float(speed)})
            return original(token=token, prompt_token=prompt_token, prompt_feat=prompt_feat, embedding=embedding,
                            token_offset=token_offset, uuid=uuid, stream=stream, finalize=finalize, speed=speed)
        return run

    def flow_inference(original):
        def run(**kw):
            mel, cache = original(**kw)
            flows.append({"tokens": int(kw["token"].shape[1]), "streaming": bool(kw["streaming"]),
                          "finalize": bool(kw["finalize"]), "frames": int(mel.shape[2])})
            return mel, cache
        return run

    def hift_inference(original):
        def run(speech_feat, finalize=True):
            speech, source = original(speech_feat=speech_feat, finalize=finalize)
            hifts.append({"mel": _np(speech_feat), "finalize": bool(finalize), "samples": int(speech.shape[1])})
            return speech, source
        return run

    draws: list = []
    start = time.perf_counter()
    with (patched(model, "token2wav", token2wav), patched(model.flow, "inference", flow_inference),
          patched(model.hift, "inference", hift_inference), recorded_draws(draws)):
        chunks = [_np(o["tts_speech"]) for o in model.tts(
            source_speech_token=torch.from_numpy(inputs["source_speech_token"]),
            flow_prompt_speech_token=torch.from_numpy(inputs["flow_prompt_speech_token"]),
            prompt_speech_feat=torch.from_numpy(inputs["prompt_speech_feat"]),
            flow_embedding=torch.from_numpy(inputs["flow_embedding"]), stream=stream, speed=speed)]
    if draws:
        raise AssertionError(f"the official tts drew random numbers: {[d[0] for d in draws]}")
    return {"chunks": chunks, "token2wav": t2w, "flow": flows, "hift": hifts,
            "seconds": round(time.perf_counter() - start, 3)}


def official_hift_call(hift):
    def call(mel: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return _np(hift.inference(speech_feat=torch.from_numpy(mel), finalize=True)[0])
    return call


def make_case(model, name: str, inputs: dict, stream: bool, speed: float, out: Path) -> dict:
    rec = run_case(model, inputs, stream, speed)
    chunks = rec["chunks"]
    speech = np.concatenate(chunks, axis=1)
    last_mel = rec["hift"][-1]["mel"]  # the vocoder's whole input of the last call (cache + new mel; stretched)
    oneshot = official_hift_call(model.hift)(last_mel)
    if stream and oneshot.shape != speech.shape:
        raise AssertionError(f"{name}: the stream has {speech.shape[1]} samples, its mel {oneshot.shape[1]}")
    if not stream and not np.array_equal(oneshot, speech):
        raise AssertionError(f"{name}: the vocoder rerun on its mel does not give the tts output")
    t2w, flows, hifts = rec["token2wav"], rec["flow"], rec["hift"]
    fields = {**inputs, "stream": np.bool_(stream), "speed": np.float64(speed), "speech": speech,
              "chunk_lens": np.asarray([c.shape[1] for c in chunks], np.int64),
              "t2w_tokens": np.asarray([c["tokens"] for c in t2w], np.int64),
              "t2w_offset": np.asarray([c["offset"] for c in t2w], np.int64),
              "t2w_stream": np.asarray([c["stream"] for c in t2w]),
              "t2w_finalize": np.asarray([c["finalize"] for c in t2w]),
              "flow_streaming": np.asarray([c["streaming"] for c in flows]),
              "flow_frames": np.asarray([c["frames"] for c in flows], np.int64),
              "hift_frames": np.asarray([c["mel"].shape[2] for c in hifts], np.int64),
              "hift_finalize": np.asarray([c["finalize"] for c in hifts]),
              "hift_samples": np.asarray([c["samples"] for c in hifts], np.int64),
              "last_hift_mel": last_mel}
    np.savez_compressed(out / f"{name}.npz", **fields)
    summary = {"source_tokens": int(inputs["source_speech_token"].shape[1]),
               "prompt_tokens": int(inputs["flow_prompt_speech_token"].shape[1]), "stream": stream, "speed": speed,
               "chunk_lens": fields["chunk_lens"].tolist(), "token2wav_calls": t2w, "flow_calls": flows,
               "hift_calls": [{k: v for k, v in c.items() if k != "mel"} | {"frames": int(c["mel"].shape[2])}
                              for c in hifts],
               "samples": int(speech.shape[1]), "speech_absmax": float(np.abs(speech).max()),
               "stream_vs_oneshot_of_its_mel": float(np.abs(speech - oneshot).max() / np.abs(oneshot).max()),
               "waveform_spread": waveform_spread(official_hift_call(model.hift), last_mel),
               "seconds": rec["seconds"]}
    print(f"  {name}: {json.dumps({k: summary[k] for k in ('chunk_lens', 'samples', 'waveform_spread')})}",
          flush=True)
    return summary


# ------------------------------------------------------------------------------------------------ schedule
class _LookaheadOnly(torch.nn.Module):
    """The flow slot of a model whose ``token2wav`` is a recorder: ``tts`` reads only ``pre_lookahead_len``."""

    def __init__(self, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len


def recorded_stream(model, n_prompt: int, n_source: int) -> list[list]:
    """The official ``tts(stream=True)`` loop over ``n_source`` tokens after ``n_prompt``, token2wav recorded as
    ``[tokens, token_offset, stream, finalize]`` and not run."""
    calls: list = []

    def token2wav(token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False, finalize=False,
                  speed=1.0):
        calls.append([int(token.shape[1]), int(token_offset), bool(stream), bool(finalize)])
        return torch.zeros(1, 0)

    model.token2wav = token2wav
    try:
        list(model.tts(source_speech_token=torch.arange(n_source, dtype=torch.int32)[None],
                       flow_prompt_speech_token=torch.zeros(1, n_prompt, dtype=torch.int32), stream=True))
    finally:
        del model.token2wav
    return calls


def scan_schedule(mods: _Modules, lookahead: int) -> dict:
    """Official chunk calls for every (prompt, source) length, each on a fresh instance; the loop's 0.1 s sleep is
    shortened (voice conversion has every token before the loop starts, so only the timing changes)."""

    def fresh():
        return mods.model_mod.CosyVoice3Model(torch.nn.Module(), _LookaheadOnly(lookahead), torch.nn.Module())

    shim = types.SimpleNamespace(sleep=lambda s: time.sleep(0))
    runs = []
    with patched(mods.model_mod, "time", lambda original: shim):
        for n_prompt in SCAN_PROMPTS:
            for n_source in SCAN_SOURCES:
                runs.append({"prompt": n_prompt, "source": n_source,
                             "calls": recorded_stream(fresh(), n_prompt, n_source)})
        model = fresh()
        quirk = [recorded_stream(model, QUIRK["prompt"], QUIRK["source"]) for _ in range(2)]
        hop_after = model.token_hop_len
    return {"runs": runs, "pre_lookahead_len": lookahead,
            "quirk": {**QUIRK, "first_stream": quirk[0], "second_stream": quirk[1],
                      "token_hop_len_after": hop_after}}


# ------------------------------------------------------------------------------------------------ main
def make_inputs(rng: np.random.Generator) -> dict:
    return {"source_speech_token": rng.integers(0, SPEECH_TOKENS, size=(1, SOURCE_TOKENS)).astype(np.int32),
            "flow_prompt_speech_token": rng.integers(0, SPEECH_TOKENS, size=(1, PROMPT_TOKENS)).astype(np.int32),
            "prompt_speech_feat": rng.normal(-6.0, 2.0, size=(1, 2 * PROMPT_TOKENS, 80)).astype(np.float32),
            "flow_embedding": rng.normal(size=(1, 192)).astype(np.float32)}


def main(argv: list[str] | None = None) -> int:
    ap = oracle_parser(__doc__)
    args = ap.parse_args(argv)
    from cosyvoice_triton.bench.official import STUBBED

    mods = _Modules(args.official)
    args.out.mkdir(parents=True, exist_ok=True)
    timings: dict = {}
    inputs = make_inputs(np.random.default_rng(INPUT_SEED))
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp)
        start = time.perf_counter()
        digests = write_weights(weights)
        timings["seeded weights"] = round(time.perf_counter() - start, 3)
        for name, n_source, stream, speed in CASES:
            start = time.perf_counter()
            model = official_model(mods, weights, digests)
            timings[f"{name}: fresh official model"] = round(time.perf_counter() - start, 3)
            case_inputs = dict(inputs, source_speech_token=inputs["source_speech_token"][:, :n_source])
            start = time.perf_counter()
            cases[name] = make_case(model, name, case_inputs, stream, speed, args.out)
            timings[f"{name}: references"] = round(time.perf_counter() - start, 3)
            lookahead = model.flow.pre_lookahead_len
            del model
            gc.collect()
    start = time.perf_counter()
    schedule = scan_schedule(mods, lookahead)
    timings["schedule scan"] = round(time.perf_counter() - start, 3)
    (args.out / "schedule.json").write_text(json.dumps(schedule, separators=(",", ":")) + "\n")
    quirk = schedule["quirk"]["second_stream"]
    print(f"  schedule: {len(schedule['runs'])} runs; quirk: the second stream's calls {quirk}", flush=True)
    a, b = (np.load(args.out / f"{n}.npz")["speech"] for n in ("vc_nonstream", "vc_stream"))
    meta = {
        "versions": flow_oracle._versions(args.official, args.official_commit), "stubbed_modules": STUBBED,
        "seeds": {"flow_weights": flow_oracle.WEIGHT_SEED, "hift_weights": hift_oracle.WEIGHT_SEED,
                  "hift_noise": hift_oracle.NOISE_SEED, "inputs": INPUT_SEED, "spread": list(SPREAD_SEEDS)},
        "weights": {"how": "make_cv3_flow_oracle.write_weights and make_cv3_hift_oracle.write_weights (seeded "
                           "draws; the digests those oracles record)",
                    "flow_state_sha256": digests["flow.pt"], "hift_state_sha256": digests["hift.pt"]},
        "dims": {"flow": flow_oracle.oracle_dims().to_dict(),
                 "hift": json.loads(json.dumps(dataclasses.asdict(hift_oracle.tiny_dims())))},
        "cases": cases,
        "stream_vs_nonstream": float(np.abs(a - b).max() / np.abs(a).max()) if a.shape == b.shape else None,
        "spread_perturbations": [list(p) for p in SPREAD_PERTURBATIONS], "timings_s": timings,
    }
    write_meta(args.out, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
