"""Regenerate the CosyVoice3 end-to-end oracle (tests/fixtures/cv3_pipeline_oracle) from the official code.

    python tests/oracle/make_cv3_pipeline_oracle.py --official /tmp/cosyvoice_official \
        --out tests/fixtures/cv3_pipeline_oracle --official-commit ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40

A CosyVoice3 model folder (:func:`write_folder`) from the existing cv3 oracles' seeded weights (pure draws; their
digests are checked): ``llm.pt`` of make_cv3_llm_oracle, ``flow.pt`` of make_cv3_flow_oracle, ``hift.pt`` of
make_cv3_hift_oracle, a ``cosyvoice3.yaml`` at those dims, ``CosyVoice-BlankEN/`` (the LM oracle's Qwen2 config,
the stand-in tokenizer with the official special ids) and the speech tokenizer / CAM++ stand-ins.

The OFFICIAL ``CosyVoice3`` class runs every mode on it: ``inference_zero_shot``, ``inference_cross_lingual``,
``inference_instruct2`` and ``inference_vc``, non-streaming and streaming (and zero-shot with ``speed``), so its
text split, its front end's arrangement of ``model_input`` (``frontend_zero_shot`` / ``_cross_lingual`` /
``_instruct2`` / ``_vc``: the prompt cut to a common length, the LM prompt each mode keeps) and
``CosyVoice3Model.tts`` (``llm_job`` with its silent-token filter, ``token2wav``, the streaming loop) are the
official ones. Its ``CosyVoice3Model`` holds the official ``CosyVoice3LM`` (HyperPyYAML, strict load), flow and
vocoder (as make_cv3_token2wav_oracle builds them). What runs on the project's side:

- the speech front end: the official ``_extract_speech_token`` / ``_extract_speech_feat`` /
  ``_extract_spk_embedding`` read audio with torchaudio (stubbed here), so they are replaced by the project's
  outputs for the same recording (``CosyVoice3.prompt_features`` and the tokenizer's tokens of the source);
  recorded in ``frontend.npz``;
- no text normaliser is installed on the official side (``text_frontend`` ''): the texts are ones WeTextProcessing
  leaves unchanged (the text oracle covers normalisation).

The LM's ``multinomial`` draws are injected (make_llm_oracle's ``pick`` on seeded uniforms), so sampling is
deterministic; the project gets the same uniforms through ``draws=``. Each case records the official segments'
``model_input``, the LM's raw tokens, the tokens ``llm_job`` passed on, the chunks, the last vocoder input and the
waveform's spread under float32-scale perturbations of it (the bar). See tests/oracle/cosyvoice3_pipeline.md.
"""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import make_cv3_flow_oracle as flow_oracle  # noqa: E402
import make_cv3_hift_oracle as hift_oracle  # noqa: E402
import make_cv3_llm_oracle as llm_oracle  # noqa: E402
import make_cv3_token2wav_oracle as t2w_oracle  # noqa: E402
import make_llm_oracle as cv2_llm_oracle  # noqa: E402
from make_flow_oracle import patched, waveform_spread  # noqa: E402
from oracle_common import oracle_parser, write_meta  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
PROMPT_WAV = FIXTURES / "prompt_en_3s.wav"
SOURCE_WAV = FIXTURES / "source_en_5s.wav"
STANDIN_SEED = 33
QWEN_DIR = "CosyVoice-BlankEN"
TEXT_ROWS = 151936
SYSTEM = "You are a helpful assistant.<|endofprompt|>"
ZERO_SHOT = {"text": "hello there, how are you.", "prompt_text": SYSTEM + "a short prompt."}
CROSS_LINGUAL = {"text": SYSTEM + "good day to you."}
INSTRUCT2 = {"text": "good morning, friend.",
             "instruct_text": "You are a helpful assistant. Speak slowly.<|endofprompt|>"}
#: (case, mode, keywords, stream, speed, draw seed)
CASES = [
    ("zero_shot", "zero_shot", ZERO_SHOT, False, 1.0, 524),
    ("zero_shot_stream", "zero_shot", ZERO_SHOT, True, 1.0, 111),
    ("zero_shot_speed", "zero_shot", ZERO_SHOT, False, 1.3, 106),
    ("cross_lingual", "cross_lingual", CROSS_LINGUAL, False, 1.0, 110),
    ("cross_lingual_stream", "cross_lingual", CROSS_LINGUAL, True, 1.0, 120),
    ("instruct2", "instruct2", INSTRUCT2, False, 1.0, 102),
    ("instruct2_stream", "instruct2", INSTRUCT2, True, 1.0, 314),
    ("vc", "vc", {}, False, 1.0, None),
    ("vc_stream", "vc", {}, True, 1.0, None),
]
#: The draw seeds give the flow 14-36 speech tokens (short answers keep the fixtures small; a stream has 2 chunks);
#: in zero_shot and instruct2_stream llm_job's silent-token filter drops some of the LM's tokens.
N_DRAWS = 20000
#: Voice conversion's source: the first seconds of SOURCE_WAV (50 tokens), handed over as 16 kHz samples.
SOURCE_SECONDS = 2


def source_16k() -> np.ndarray:
    from cosyvoice_triton.frontend import audio

    return audio.load_audio(str(SOURCE_WAV), target_sr=audio.TOKENIZER_SR)[: SOURCE_SECONDS * audio.TOKENIZER_SR]


def _np(t):
    return t.detach().cpu().numpy().copy()


# ------------------------------------------------------------------------------------------------ the folder
def write_folder(folder: Path, *, safetensors: bool = False) -> dict:
    """The model folder (module docstring); returns the weight digests (each checked against its oracle's meta; the
    flow's rotary ``inv_freq`` is the flow oracle's recorded one, so the digests hold on any CPU).
    ``safetensors``: also the ``model.safetensors`` the official ``Qwen2Encoder.from_pretrained`` reads."""
    from cosyvoice_triton.config import LLMConfig
    from cosyvoice_triton.frontend.text import write_tokenizer_standin
    from cosyvoice_triton.models.cosyvoice3.config import CosyVoice3Config, write_cosyvoice3_yaml
    from cosyvoice_triton.models.standins import write_campplus_standin, write_speech_tokenizer_standin

    folder.mkdir(parents=True, exist_ok=True)
    metas = {name: json.loads((FIXTURES / oracle / "oracle_meta.json").read_text())["weights"]
             for name, oracle in (("flow.pt", "cv3_flow_oracle"), ("hift.pt", "cv3_hift_oracle"),
                                  ("llm.pt", "cv3_llm_oracle"))}
    state = llm_oracle.random_cv3_llm_state_dict(llm_oracle.QWEN_TINY, seed=llm_oracle.WEIGHT_SEED)
    torch.save(state, folder / "llm.pt")
    digests = {"flow.pt": flow_oracle.write_weights(folder, flow_oracle.WEIGHT_SEED,
                                                    metas["flow.pt"]["rotary_inv_freq_hex"]),
               "hift.pt": hift_oracle.write_weights(folder, hift_oracle.WEIGHT_SEED),
               "llm.pt": cv2_llm_oracle.state_digest(state)}
    for name, digest in digests.items():
        if digest != metas[name]["state_sha256"]:
            raise AssertionError(f"{name} regenerated here is not the one its oracle was made with")
    llm_oracle.write_blank_en(folder / QWEN_DIR, state if safetensors else None)
    write_tokenizer_standin(folder / QWEN_DIR, TEXT_ROWS, official_ids=True)
    hidden = llm_oracle.QWEN_TINY["hidden_size"]
    config = CosyVoice3Config(llm=LLMConfig(llm_input_size=hidden, llm_output_size=hidden),
                              flow=flow_oracle.oracle_dims(), hift=hift_oracle.tiny_dims())
    write_cosyvoice3_yaml(config, folder / "cosyvoice3.yaml")
    write_speech_tokenizer_standin(folder / "speech_tokenizer_v3.onnx", seed=STANDIN_SEED, version="v3")
    write_campplus_standin(folder / "campplus.onnx", seed=STANDIN_SEED)
    return digests


def project_model(folder: Path):
    """The project's CosyVoice3 on the folder, with the official vocoder's noise seed."""
    from cosyvoice_triton.models.cosyvoice3.pipeline import CosyVoice3

    return CosyVoice3.from_pretrained(folder, hift_noise_seed=hift_oracle.NOISE_SEED, prompt_cache=False)


def project_frontend(model) -> dict:
    """What the project's front end gives for the prompt and the source recordings."""
    entry = model.prompt_features(str(PROMPT_WAV))
    (source,) = model._tokenize([source_16k()], model_timer())
    return {"prompt_tokens": np.asarray(entry["prompt_tokens"], np.int32),
            "prompt_mel": np.asarray(entry["prompt_mel"], np.float32),
            "embedding": np.asarray(entry["embedding"], np.float32), "source_tokens": np.asarray(source, np.int32)}


def model_timer():
    from cosyvoice_triton.prompt_frontend import StageTimer

    return StageTimer()


# ------------------------------------------------------------------------------------------------ official side
def official_cosyvoice3(official: Path, folder: Path, weights: Path, digests: dict, front: dict):
    """The official ``CosyVoice3`` object: its front end (text side official, speech side the project's outputs),
    its ``CosyVoice3Model`` with the official LM, flow and vocoder."""
    from hyperpyyaml import load_hyperpyyaml

    from cosyvoice_triton.bench.official import import_official, stub_frontend_imports

    stub_frontend_imports()
    cli, fe_mod, tok_mod = import_official(official, "cosyvoice.cli.cosyvoice", "cosyvoice.cli.frontend",
                                           "cosyvoice.tokenizer.tokenizer")
    model = t2w_oracle.official_model(t2w_oracle._Modules(official), weights, digests)
    yaml_path = weights / "llm_section.yaml"
    llm_oracle.write_yaml(yaml_path, llm_oracle.QWEN_TINY["hidden_size"])
    llm_oracle.check_yaml(official, yaml_path)
    with open(yaml_path) as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(folder / QWEN_DIR)})
    llm = configs["llm"]
    llm.load_state_dict(torch.load(folder / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    if cv2_llm_oracle.state_digest(dict(llm.state_dict())) != digests["llm.pt"]:
        raise AssertionError("the official LM does not hold llm.pt after the strict load")
    model.llm = llm.eval()

    import inflect

    frontend = fe_mod.CosyVoiceFrontEnd.__new__(fe_mod.CosyVoiceFrontEnd)
    frontend.tokenizer = tok_mod.get_qwen_tokenizer(token_path=str(folder / QWEN_DIR), skip_special_tokens=True,
                                                    version="cosyvoice3")
    frontend.allowed_special = "all"
    frontend.inflect_parser = inflect.engine()
    frontend.text_frontend = ""
    frontend.device = torch.device("cpu")
    frontend.spk2info = {}
    tokens = {str(PROMPT_WAV): front["prompt_tokens"], "source": front["source_tokens"]}

    def speech_token(wav):
        t = torch.from_numpy(tokens[str(wav)].copy())[None]
        return t, torch.tensor([t.shape[1]], dtype=torch.int32)

    def speech_feat(wav):
        assert str(wav) == str(PROMPT_WAV), wav
        feat = torch.from_numpy(front["prompt_mel"].copy())[None]
        return feat, torch.tensor([feat.shape[1]], dtype=torch.int32)

    def spk_embedding(wav):
        assert str(wav) == str(PROMPT_WAV), wav
        return torch.from_numpy(front["embedding"].copy())[None]

    frontend._extract_speech_token = speech_token
    frontend._extract_speech_feat = speech_feat
    frontend._extract_spk_embedding = spk_embedding
    cosy = cli.CosyVoice3.__new__(cli.CosyVoice3)
    cosy.frontend, cosy.model, cosy.sample_rate = frontend, model, 24000
    return cosy


def run_official(cosy, mode: str, kw: dict, stream: bool, speed: float, draws: np.ndarray | None) -> dict:
    """One official ``inference_<mode>`` with injected draws; every ``tts`` call's ``model_input``, the LM's raw
    and passed-on tokens, the chunks, the vocoder's inputs."""
    model = cosy.model
    model.token_hop_len = 25  # a fresh instance's hop (the official tts keeps the grown one on the instance)
    segments, hifts = [], []

    def tts(original):
        def run(**kw):
            seg = {k: _np(v) for k, v in kw.items() if isinstance(v, torch.Tensor)}
            segments.append(seg)
            seg["raw"], seg["kept"] = [], None
            yield from original(**kw)
        return run

    def llm_job(original):
        def run(text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid):
            original(text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid)
            segments[-1]["kept"] = list(model.tts_speech_token_dict[uuid])
        return run

    def inference(original):
        def run(**kw):
            for token in original(**kw):
                segments[-1]["raw"].append(int(token))
                yield token
        return run

    def hift_inference(original):
        def run(speech_feat, finalize=True):
            speech, source = original(speech_feat=speech_feat, finalize=finalize)
            hifts.append({"mel": _np(speech_feat), "finalize": bool(finalize)})
            return speech, source
        return run

    log: list = []
    inject = (cv2_llm_oracle.injected_multinomial(iter(draws.tolist()), log) if draws is not None
              else contextlib.nullcontext())
    start = time.perf_counter()
    with (patched(model, "tts", tts), patched(model, "llm_job", llm_job), patched(model.llm, "inference", inference),
          patched(model.hift, "inference", hift_inference), inject):
        if mode == "vc":
            outputs = cosy.inference_vc("source", str(PROMPT_WAV), stream=stream, speed=speed)
        else:
            call = {"zero_shot": cosy.inference_zero_shot, "cross_lingual": cosy.inference_cross_lingual,
                    "instruct2": cosy.inference_instruct2}[mode]
            outputs = call(**{("tts_text" if k == "text" else k): v for k, v in kw.items()},
                           prompt_wav=str(PROMPT_WAV), stream=stream, speed=speed)
        chunks = [_np(o["tts_speech"])[0] for o in outputs]
    return {"segments": segments, "chunks": chunks, "hifts": hifts, "draws_used": len(log),
            "seconds": round(time.perf_counter() - start, 3)}


def make_case(cosy, name: str, mode: str, kw: dict, stream: bool, speed: float, seed, out: Path) -> dict:
    draws = None if seed is None else cv2_llm_oracle.case_draws(seed, N_DRAWS)
    rec = run_official(cosy, mode, kw, stream, speed, draws)
    if len(rec["segments"]) != 1:
        raise AssertionError(f"{name}: {len(rec['segments'])} segments (the cases are one segment each)")
    seg = rec["segments"][0]
    speech = np.concatenate(rec["chunks"])
    last_mel = rec["hifts"][-1]["mel"]
    fields = {"speech": speech, "chunk_lens": np.asarray([len(c) for c in rec["chunks"]], np.int64),
              "stream": np.bool_(stream), "speed": np.float64(speed), "mode": np.array(mode),
              "hift_frames": np.asarray([h["mel"].shape[2] for h in rec["hifts"]], np.int64)}
    for key in ("text", "prompt_text", "llm_prompt_speech_token", "flow_prompt_speech_token", "source_speech_token"):
        if key in seg:
            fields[key] = seg[key][0].astype(np.int32)
    fields["prompt_speech_feat_frames"] = np.int64(seg["prompt_speech_feat"].shape[1])
    if draws is not None:
        fields["draws"] = draws[: rec["draws_used"]]
        fields["lm_tokens"] = np.asarray(seg["raw"], np.int32)
        fields["llm_job_tokens"] = np.asarray(seg["kept"], np.int32)
    np.savez_compressed(out / f"{name}.npz", **fields)
    spread = waveform_spread(t2w_oracle.official_hift_call(cosy.model.hift), last_mel)
    summary = {"mode": mode, "stream": stream, "speed": speed, "draw_seed": seed,
               "text_tokens": len(fields.get("text", [])), "prompt_text_tokens": len(fields.get("prompt_text", [])),
               "llm_prompt_speech_tokens": len(fields.get("llm_prompt_speech_token", [])),
               "flow_prompt_tokens": len(fields["flow_prompt_speech_token"]),
               "prompt_feat_frames": int(fields["prompt_speech_feat_frames"]),
               "lm_tokens": len(seg["raw"]) if draws is not None else None,
               "llm_job_tokens": len(seg["kept"]) if draws is not None else None,
               "draws_used": rec["draws_used"], "chunk_lens": fields["chunk_lens"].tolist(),
               "samples": len(speech), "waveform_spread": spread, "seconds": rec["seconds"]}
    print(f"  {name}: {json.dumps({k: summary[k] for k in ('lm_tokens', 'llm_job_tokens', 'chunk_lens')})}",
          flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = oracle_parser(__doc__)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.npz"):
        old.unlink()
    timings: dict = {}
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, weights = Path(tmp) / "model", Path(tmp) / "weights"
        start = time.perf_counter()
        digests = write_folder(folder, safetensors=True)
        weights.mkdir()
        t2w_oracle.write_weights(weights)  # flow.pt, hift.pt and an empty llm.pt for the official model's load
        timings["folder"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        project = project_model(folder)
        front = project_frontend(project)
        del project
        gc.collect()
        np.savez_compressed(args.out / "frontend.npz", **front)
        timings["project front end"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        cosy = official_cosyvoice3(args.official, folder, weights, digests, front)
        timings["official build"] = round(time.perf_counter() - start, 3)
        for name, mode, kw, stream, speed, seed in CASES:
            start = time.perf_counter()
            cases[name] = make_case(cosy, name, mode, kw, stream, speed, seed, args.out)
            timings[name] = round(time.perf_counter() - start, 3)
        shutil.rmtree(folder)
    from cosyvoice_triton.bench.official import STUBBED

    meta = {"versions": flow_oracle._versions(args.official, args.official_commit), "stubbed_modules": STUBBED,
            "weights": {"how": "make_cv3_llm_oracle.random_cv3_llm_state_dict, make_cv3_flow_oracle.write_weights, "
                               "make_cv3_hift_oracle.write_weights (seeded draws; the digests those oracles record)",
                        "state_sha256": digests},
            "seeds": {"standins": STANDIN_SEED, "hift_noise": hift_oracle.NOISE_SEED, "draws": {
                n: s for n, _, _, _, _, s in CASES if s is not None}},
            "texts": {"zero_shot": ZERO_SHOT, "cross_lingual": CROSS_LINGUAL, "instruct2": INSTRUCT2},
            "frontend": {k: list(v.shape) for k, v in front.items()}, "cases": cases, "timings_s": timings}
    write_meta(args.out, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
