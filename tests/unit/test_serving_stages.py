"""cosyvoice_triton.serving in-process: the served stages without a server (no Triton needed).

The stages composed as the ensemble composes them (LocalPipeline) equal CosyVoice2.convert within the fp32
bar; batches of different lengths give each request its solo answer; a bad request fails alone; the Triton
adapter helpers map errors to INVALID_ARG / INTERNAL (checked with a stand-in for triton_python_backend_utils).
"""

from __future__ import annotations

import io
import types

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import FIXTURES, rel_err
from pb_standin import Err, Response, Tensor

from cosyvoice_triton.errors import AudioError
from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.batching import ItemResult, RequestError, chunks_by_rows
from cosyvoice_triton.serving.stages.flow import FlowItem
from cosyvoice_triton.serving.stages.graphs import GraphRunner
from cosyvoice_triton.serving.stages.postprocess import Postprocessor, integrated_loudness
from cosyvoice_triton.serving.stages.vocoder import nsf_noise, parse_seed


@pytest.fixture(scope="module")
def speech():
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: int(1.6 * ssr)], ssr, prm[: int(1.2 * psr)], psr


@pytest.fixture(scope="module")
def local(serving_assets):
    from cosyvoice_triton.serving.stages.local import LocalPipeline

    return LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")


def _req(src, ssr, prm, psr):
    return {"source_audio": np.asarray(src, np.float32)[None], "source_sample_rate": np.array([[ssr]], np.int32),
            "prompt_audio": np.asarray(prm, np.float32)[None], "prompt_sample_rate": np.array([[psr]], np.int32)}


def test_local_pipeline_matches_in_process_cosyvoice2(local, speech, serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2

    src, ssr, prm, psr = speech
    ref = CosyVoice2.from_pretrained(serving_assets["model_dir"]).convert(src, prm, source_sr=ssr, prompt_sr=psr,
                                                                          seed=5)
    out = local.convert(src, ssr, prm, psr, seed=5)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-3  # the fp32 bar of the whole token-to-wav path


def test_batch_of_different_lengths_equals_solo_and_bad_fails_alone(local, speech):
    src, ssr, prm, psr = speech
    reqs = [_req(src[: int(ssr * s)], ssr, prm[: int(psr * p)], psr) for s, p in ((1.6, 1.2), (0.9, 0.7), (1.3, 1.2))]
    bad = _req(np.full(ssr, np.inf, np.float32), ssr, prm, psr)
    res = local.convert_batch([reqs[0], bad, reqs[1], reqs[2]], [1, 1, 2, 3])
    assert [r.ok for r in res] == [True, False, True, True]
    assert isinstance(res[1].error, AudioError) and "infinite" in str(res[1].error)
    for r, q, s in zip((res[0], res[2], res[3]), reqs, (1, 2, 3), strict=True):
        solo = local.convert_batch([q], [s])[0].unwrap()
        np.testing.assert_allclose(r.value, solo, atol=1e-5)


def test_preprocess_errors_name_the_tensor(local, speech):
    src, ssr, prm, psr = speech
    cases = {"source_sample_rate": _req(src, 0, prm, psr), "prompt_audio": _req(src, ssr, prm[:10], psr)}
    for name, req in cases.items():
        r = local.pre.batch([req])[0]
        assert not r.ok and str(r.error).startswith(name)
    r = local.pre.batch([{"source_audio": None}])[0]
    assert "missing input" in str(r.error)
    r = local.pre.batch([{**_req(src, ssr, prm, psr), "source_audio": np.zeros((2, 2, 5), np.float32)}])[0]
    assert "source_audio" in str(r.error) and "shape" in str(r.error)


def test_graph_runner_group_policy_is_exact_per_item(serving_assets):
    runner = GraphRunner("hift_source", onnx_path=serving_assets["onnx_dir"] / "fp32" / "hift_source.onnx")
    assert runner.policy == "group"
    rng = np.random.default_rng(0)
    items = [{"mel": rng.normal(-4, 1, (1, 80, n)).astype(np.float32),
              "nsf_noise": rng.standard_normal((1, 480 * n, 9)).astype(np.float32)} for n in (12, 20, 12)]
    items.append({"mel": np.zeros((1, 80, 5), np.float32)})  # missing input: fails alone
    res = runner.run_items(items)
    assert [r.ok for r in res] == [True, True, True, False] and "nsf_noise" in str(res[3].error)
    for item, r in zip(items[:3], res[:3], strict=True):
        np.testing.assert_array_equal(r.value["source"], runner.run(item)["source"])


def test_graph_runner_pad_policy_crops_each_item(serving_assets):
    runner = GraphRunner("flow_estimator", onnx_path=serving_assets["onnx_dir"] / "fp32" / "flow_estimator.onnx")
    assert runner.policy == "pad"
    rng = np.random.default_rng(1)

    def item(n):
        return {"x": rng.normal(size=(2, 80, n)).astype(np.float32), "mask": np.ones((2, 1, n), np.float32),
                "mu": rng.normal(size=(2, 80, n)).astype(np.float32), "t": np.full(2, 0.3, np.float32),
                "spks": rng.normal(size=(2, 80)).astype(np.float32), "cond": np.zeros((2, 80, n), np.float32),
                "streaming": np.zeros(2, bool)}

    items = [item(30), item(47), {**item(10), "t": np.zeros((2, 2), np.float32)}]
    res = runner.run_items(items)
    assert [r.ok for r in res] == [True, True, False]
    assert isinstance(res[2].error, RequestError) and "'t'" in str(res[2].error)
    for it, r in zip(items[:2], res[:2], strict=True):
        assert r.value["velocity"].shape == it["x"].shape
        np.testing.assert_allclose(r.value["velocity"], runner.run(it)["velocity"], atol=1e-5)


def test_tokenizer_probe_and_output_crop(serving_assets):
    runner = GraphRunner("speech_tokenizer", onnx_path=serving_assets["onnx_dir"] / "fp32" / "speech_tokenizer.onnx")
    assert runner.policy == "pad"  # the stand-in masks padding
    rng = np.random.default_rng(2)
    items = [{"whisper_mel": rng.normal(0, 0.5, (1, 128, n)).astype(np.float32),
              "whisper_mel_len": np.array([n], np.int32)} for n in (41, 100)]
    res = runner.run_items(items)
    assert [r.value["speech_tokens"].shape for r in res] == [(1, 11), (1, 25)]


def test_nsf_noise_replays_the_hift_generator_draws():
    from cosyvoice_triton.config import ModelConfig
    from cosyvoice_triton.models.hift import HiFTGenerator

    hift = HiFTGenerator(ModelConfig.tiny().hift)
    want = hift.draw_noise(1, 7, torch.Generator().manual_seed(42))
    np.testing.assert_array_equal(nsf_noise(7, 42), want.numpy())


def test_parse_seed():
    assert parse_seed(None) == 0 and parse_seed(np.array([[7]], np.int64)) == 7 and parse_seed("12") == 12
    for bad in (np.array([[1.5]]), -1, "x", True, 2**64):
        with pytest.raises(RequestError):
            parse_seed(bad)


def test_flow_item_checks(serving_assets):
    from cosyvoice_triton.config import ModelConfig
    from cosyvoice_triton.serving.stages.flow import FlowSolver

    solver = FlowSolver(ModelConfig.from_yaml(serving_assets["model_dir"] / "cosyvoice2.yaml").flow.cfm)
    ok = {"source_speech_tokens": np.ones((1, 10), np.int32), "prompt_speech_tokens": np.ones((1, 5), np.int32),
          "prompt_mel": np.zeros((1, 10, 80), np.float32), "speaker_embedding": np.zeros((1, 192), np.float32)}
    solver.check(FlowItem.from_tensors(ok))
    too_long = {**ok, "source_speech_tokens": np.ones((1, 1600), np.int32)}
    long_prompt = {**ok, "prompt_mel": np.zeros((1, 31, 80), np.float32)}
    called = []
    res = solver.run_tensors([too_long, long_prompt, {**ok, "speaker_embedding": None}],
                             lambda f: called.append(f), lambda f: called.append(f))
    assert not called and not any(r.ok for r in res)
    assert "exceed" in str(res[0].error) and "prompt_mel is longer" in str(res[1].error)
    assert "missing input" in str(res[2].error)


def test_postprocess_rate_loudness_and_bytes():
    t = np.arange(48000) / 24000
    wave = (0.05 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)[None]
    post = Postprocessor(output_sample_rate=16000, loudness_lufs=-20.0, output_format="wav")
    out = post.batch([wave, np.zeros((1, 2, 3), np.float32), None])
    assert [r.ok for r in out] == [True, False, False]
    y = out[0].value["waveform"][0]
    assert y.shape == (32000,) and out[0].value["sample_rate"].tolist() == [[16000]]
    assert abs(integrated_loudness(y, 16000) + 20.0) < 0.2
    decoded, sr = sf.read(io.BytesIO(out[0].value["audio_bytes"][0, 0]))
    assert sr == 16000 and len(decoded) == 32000
    loud = Postprocessor(loudness_lufs=-5.0, peak_dbfs=-1.0).waveform(wave)
    assert np.max(np.abs(loud)) <= 10 ** (-1 / 20) + 1e-6  # the gain is capped by the peak ceiling
    assert Postprocessor().batch([wave])[0].value["waveform"].tolist() == wave.tolist()  # off by default
    with pytest.raises(ValueError):
        Postprocessor(output_format="mp3")


def test_chunks_by_rows():
    assert chunks_by_rows([0, 1, 2, 3], [2, 2, 2, 2], 4) == [[0, 1], [2, 3]]
    with pytest.raises(RequestError):
        chunks_by_rows([0], [5], 4)


# ------------------------------------------------------------------------- adapter helpers (stand-in pb)

def _pb(callee=None):
    class Request:
        def __init__(self, model_name, inputs, requested_output_names, **kw):
            self.model_name, self.inputs, self.names = model_name, inputs, requested_output_names

        def exec(self):
            return callee(self)

    return types.SimpleNamespace(
        TritonError=Err, Tensor=Tensor, InferenceResponse=Response, InferenceRequest=Request,
        get_output_tensor_by_name=lambda res, n: next((t for t in res.output_tensors if t.name() == n), None),
        get_input_tensor_by_name=lambda req, n: req.get(n))


def test_responses_map_client_errors_to_invalid_arg():
    pb = _pb()
    out = triton_io.responses(pb, [ItemResult({"y": np.ones(2)}), ItemResult(error=AudioError("x: bad")),
                                   ItemResult(error=RuntimeError("boom"))], lambda v: v)
    assert out[0].output_tensors[0].name() == "y"
    assert (out[1].err.code(), out[1].err.message()) == ("INVALID_ARG", "x: bad")
    assert out[2].err.code() == "INTERNAL" and "boom" in out[2].err.message()


def test_bls_graph_shapes_rank_one_tensors_and_raises_with_the_callee_code():
    seen = {}

    def callee(req):
        seen.update({t.name(): t.as_numpy().shape for t in req.inputs})
        return Response([Tensor("mu", np.zeros((2, 80, 8), np.float32)), Tensor("mel_len", np.array([[8], [6]])),
                          Tensor("spks", np.zeros((2, 80), np.float32))])

    fn = triton_io.BlsGraph(_pb(callee), "flow_encoder", "flow_encoder")
    out = fn({"speech_tokens": np.zeros((2, 4), np.int32), "speech_token_len": np.array([4, 3], np.int32),
              "lookahead_len": np.zeros(2, np.int32), "speaker_embedding": np.zeros((2, 192), np.float32),
              "streaming": np.zeros(2, bool)})
    assert seen["speech_token_len"] == (2, 1) and seen["streaming"] == (2, 1) and seen["speech_tokens"] == (2, 4)
    assert out["mel_len"].tolist() == [8, 6]

    bad = triton_io.BlsGraph(_pb(lambda r: Response(error=Err("too long", "INVALID_ARG"))), "m", "hift_decoder")
    with pytest.raises(AudioError.__mro__[1]) as info:  # a CosyVoiceError: the client's fault
        bad({"mel": np.zeros((1, 80, 4), np.float32), "source": np.zeros((1, 1, 1920), np.float32)})
    assert "too long" in str(info.value)
    broken = triton_io.BlsGraph(_pb(lambda r: Response(error=Err("oom", "INTERNAL"))), "m", "hift_decoder")
    with pytest.raises(triton_io.BlsError) as info:
        broken({"mel": np.zeros((1, 80, 4), np.float32), "source": np.zeros((1, 1, 1920), np.float32)})
    assert not info.value.invalid_argument


# ------------------------------------------------------------------------------ optional clean-up (off)

@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_vad_trim_cuts_silence_at_both_ends_and_refuses_no_speech(speech):
    pytest.importorskip("silero_vad", reason="silero-vad not installed (pip install silero-vad==6.2.3)")
    from cosyvoice_triton.serving.stages.enhance import VadTrimmer

    src, ssr, _, _ = speech
    rng = np.random.default_rng(0)
    quiet = lambda n: (rng.standard_normal(n) * 1e-3).astype(np.float32)
    padded = np.concatenate([quiet(ssr), src, quiet(ssr // 2)])
    vad = VadTrimmer(pad_seconds=0.05)
    trimmed = vad.trim(padded, ssr)
    assert len(src) * 0.7 < len(trimmed) < len(src) + 0.2 * ssr
    with pytest.raises(AudioError, match="no speech"):
        vad.trim(quiet(ssr * 2) * 50, ssr, name="prompt_audio")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_preprocess_with_vad_and_denoise_still_gives_features(serving_assets, speech):
    pytest.importorskip("silero_vad", reason="silero-vad not installed")
    from cosyvoice_triton.config import ModelConfig
    from cosyvoice_triton.serving.stages.frontend import Preprocessor

    src, ssr, prm, psr = speech
    cfg = ModelConfig.from_yaml(serving_assets["model_dir"] / "cosyvoice2.yaml")
    plain = Preprocessor(cfg.mel).one(src[None], [[ssr]], prm[None], [[psr]])
    pre = Preprocessor(cfg.mel, vad_trim=True, denoise_prompt=True)
    padded = np.concatenate([np.full(ssr, 1e-3, np.float32) * np.sign(np.sin(np.arange(ssr))), src])
    feats = pre.one(padded[None], [[ssr]], prm[None], [[psr]])
    assert feats.source_whisper_mel.shape[1] <= plain.source_whisper_mel.shape[1] + 25
    assert feats.prompt_mel.shape[1] == 80 and np.isfinite(feats.prompt_mel).all()


def test_spectral_gate_lowers_the_noise_floor(speech):
    from cosyvoice_triton.serving.stages.enhance import spectral_gate

    src, ssr, _, _ = speech
    rng = np.random.default_rng(3)
    noise = (rng.standard_normal(ssr) * 0.01).astype(np.float32)
    noisy = np.concatenate([noise, src + rng.standard_normal(len(src)).astype(np.float32) * 0.01])
    clean = spectral_gate(noisy, ssr)
    assert clean.shape == noisy.shape and clean.dtype == np.float32
    rms = lambda x: float(np.sqrt(np.mean(x**2)))
    assert rms(clean[: ssr // 2]) < 0.5 * rms(noisy[: ssr // 2])  # noise-only part: > 6 dB quieter
    assert rms(clean[ssr:]) > 0.6 * rms(src)  # speech kept
