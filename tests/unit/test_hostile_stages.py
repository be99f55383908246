"""Hostile input to the served stages, in process (no Triton needed): what issue 14 found, each refused per item.

* Every graph runner checks each request against the shape spec (axis maxima, lengths within their axis, token
  ids in range, finite floats) before batching, and a batched call that raises is retried item by item, so a
  bad request never fails its batch-mates (the flow and hift stages do the same with their graph calls).
* A refused request's tensors are freed with the request: its stored exception carries no traceback (the
  Python stub's ``execute`` path, with a stand-in for ``triton_python_backend_utils``).
* Encoded audio is checked from its header (rate, channels, length) and decoded in blocks under a running budget,
  so a small file cannot cost gigabytes.
"""

from __future__ import annotations

import gc
import importlib.util
import io
import json
import sys
import time
import tracemalloc
import types
import weakref

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, ROOT
from pb_standin import Err, MetricFamily, Response, Tensor

from cosyvoice_triton.config import ModelConfig
from cosyvoice_triton.errors import AudioError
from cosyvoice_triton.frontend import audio
from cosyvoice_triton.serving.stages.batching import ItemResult, RequestError
from cosyvoice_triton.serving.stages.flow import FlowItem, FlowSolver
from cosyvoice_triton.serving.stages.graphs import GraphRunner
from cosyvoice_triton.serving.stages.postprocess import Postprocessor
from cosyvoice_triton.serving.stages.vocoder import HiftRunner
from cosyvoice_triton.shapes import SPEECH_TOKEN_VOCAB


@pytest.fixture(scope="module")
def runners(serving_assets):
    onnx = serving_assets["onnx_dir"] / "fp32"
    return {n: GraphRunner(n, onnx_path=onnx / f"{n}.onnx")
            for n in ("flow_encoder", "flow_estimator", "hift_decoder", "speech_tokenizer")}


def _enc(n, *, length=None, fill=1):
    length = n if length is None else length
    return {"speech_tokens": np.full((1, n), fill, np.int32), "speech_token_len": np.array([length], np.int32),
            "lookahead_len": np.zeros(1, np.int32), "speaker_embedding": np.full((1, 192), 0.1, np.float32),
            "streaming": np.zeros(1, bool)}


def _est(t, rows=2):
    rng = np.random.default_rng(t)
    return {"x": rng.normal(size=(rows, 80, t)).astype(np.float32), "mask": np.ones((rows, 1, t), np.float32),
            "mu": rng.normal(size=(rows, 80, t)).astype(np.float32), "t": np.full(rows, 0.3, np.float32),
            "spks": rng.normal(size=(rows, 80)).astype(np.float32), "cond": np.zeros((rows, 80, t), np.float32),
            "streaming": np.zeros(rows, bool)}


# ------------------------------------------------------------------------------ finding 3 and 6: graphs

def test_flow_encoder_bad_lengths_fail_alone_and_batch_mates_get_their_solo_answer(runners):
    r = runners["flow_encoder"]
    good = [_enc(12), _enc(30, length=21)]
    bad = {
        "length above its tokens": (_enc(5, length=1000), ["speech_token_len", "1000", "1..5"]),
        "zero length": (_enc(6, length=0), ["speech_token_len", "0"]),
        "token id out of range": (_enc(8, fill=SPEECH_TOKEN_VOCAB), ["speech_tokens", str(SPEECH_TOKEN_VOCAB)]),
        "negative token id": (_enc(8, fill=-3), ["speech_tokens", "-3"]),
        "NaN embedding": ({**_enc(8), "speaker_embedding": np.full((1, 192), np.nan, np.float32)},
                          ["speaker_embedding", "NaN"]),
        "above the maximum": (_enc(3000), ["speech_tokens", "tokens", "3000", "maximum 1500"]),
        "lookahead out of range": ({**_enc(8), "lookahead_len": np.array([9], np.int32)}, ["lookahead_len", "9"]),
    }
    items = [good[0], *(v[0] for v in bad.values()), good[1]]
    res = r.run_items(items)
    assert res[0].ok and res[-1].ok, [x.error for x in res]
    for (case, (_, words)), out in zip(bad.items(), res[1:-1], strict=True):
        assert isinstance(out.error, RequestError), f"{case}: {out.error!r}"
        for w in words:
            assert w in str(out.error), f"{case}: {w!r} not in {out.error}"
    for item, out in zip(good, (res[0], res[-1]), strict=True):  # padded batch vs alone: float rounding only
        np.testing.assert_allclose(out.value["mu"], r.run(item)["mu"], atol=1e-5)


@pytest.mark.parametrize("graph, item, words", [
    ("flow_estimator", _est(6000), ["'x'", "mel_frames", "6000", "maximum 3000"]),
    ("flow_estimator", {**_est(40), "mu": np.full((2, 80, 40), np.nan, np.float32)}, ["'mu'", "NaN"]),
    ("hift_decoder", {"mel": np.zeros((1, 80, 5000), np.float32), "source": np.zeros((1, 1, 480 * 5000), np.float32)},
     ["'mel'", "mel_frames", "5000", "maximum 1508"]),
    ("hift_decoder", {"mel": np.zeros((1, 80, 20), np.float32),
                      "source": np.full((1, 1, 480 * 20), np.inf, np.float32)}, ["'source'", "NaN/Inf"]),
    ("speech_tokenizer", {"whisper_mel": np.zeros((1, 128, 50), np.float32),
                          "whisper_mel_len": np.array([80], np.int32)}, ["whisper_mel_len", "80", "1..50"]),
])
def test_above_maximum_and_non_finite_are_refused_before_any_compute(runners, graph, item, words):
    r = runners[graph]
    t0 = time.process_time()  # CPU time: what the refusal computed, however busy the machine
    res = r.run_items([item])[0]
    assert time.process_time() - t0 < 2.0  # refused up front, not computed (was 7-26 s)
    assert isinstance(res.error, RequestError), res.error
    for w in words:
        assert w in str(res.error), f"{w!r} not in {res.error}"
    with pytest.raises(RequestError):  # run() (the in-process BLS stand-in) checks the same
        r.run(item)


def test_a_batched_call_that_raises_is_retried_item_by_item(runners, monkeypatch):
    """An item that passes every check but breaks the runtime fails alone; the others get their solo answer."""
    r = runners["flow_encoder"]
    items = [_enc(10), _enc(17, fill=4), _enc(14)]
    solo = [r.run(x)["mu"] for x in items]
    real = r._call

    def flaky(feeds):
        if (feeds["speech_tokens"] == 4).any():
            raise RuntimeError("onnxruntime: index out of range")
        return real(feeds)

    monkeypatch.setattr(r, "_call", flaky)
    res = r.run_items(items)
    assert [x.ok for x in res] == [True, False, True]
    assert not res[1].invalid_argument and "index out of range" in str(res[1].error)
    np.testing.assert_array_equal(res[0].value["mu"], solo[0])
    np.testing.assert_array_equal(res[2].value["mu"], solo[2])


def test_flow_and_hift_stages_isolate_a_failing_item():
    cfm = ModelConfig.tiny().flow.cfm
    solver = FlowSolver(cfm, n_timesteps=2)

    def encoder(f):
        if (f["speech_tokens"] == 42).any():
            raise RuntimeError("encoder blew up")
        b, t = f["speech_tokens"].shape
        return {"mu": np.zeros((b, 80, 2 * t), np.float32), "mel_len": 2 * f["speech_token_len"],
                "spks": np.zeros((b, 80), np.float32)}

    def estimator(f):
        return {"velocity": np.ones_like(f["x"])}

    def item(n, tok=1):
        return FlowItem(np.full(n, tok, np.int32), np.ones(4, np.int32), np.zeros((6, 80), np.float32),
                        np.zeros(192, np.float32))

    res = solver.run([item(5), item(6, 42), item(7), item(5, SPEECH_TOKEN_VOCAB + 5)], encoder, estimator)
    assert [x.ok for x in res] == [True, False, True, False]
    assert "blew up" in str(res[1].error) and not res[1].invalid_argument
    assert res[3].invalid_argument and "source_speech_tokens" in str(res[3].error)
    assert res[0].value.shape == (80, 2 * 9 - 6) and res[2].value.shape == (80, 2 * 11 - 6)

    hift = HiftRunner()

    def source(f):
        if (f["mel"] == 7).any():
            raise RuntimeError("source blew up")
        return {"source": np.zeros((f["mel"].shape[0], 1, 480 * f["mel"].shape[2]), np.float32)}

    def decoder(f):
        return {"waveform": np.repeat(f["mel"][:, 0, :], 480, axis=1)}

    mels = [np.full((80, 10), v, np.float32) for v in (1, 7, 2)]
    res = hift.run([*mels, np.full((80, 5000), 1, np.float32)], [0, 0, 0, 0], source, decoder)
    assert [x.ok for x in res] == [True, False, True, False]
    assert np.all(res[0].value == 1) and np.all(res[2].value == 2)
    assert "maximum" in str(res[3].error)


def test_postprocess_refuses_non_finite_and_over_long_waveforms():
    post = Postprocessor()
    res = post.batch([np.full((1, 100), np.nan, np.float32), np.zeros((1, 2_000_000), np.float32),
                      np.zeros((1, 2400), np.float32)])
    assert [x.ok for x in res] == [False, False, True]
    assert "NaN" in str(res[0].error) and "maximum" in str(res[1].error)


# ------------------------------------------------------------------------------ finding 4: memory

class _Request:
    def __init__(self, tensors):
        self.tensors = tensors

    def parameters(self):
        return "{}"


def _stand_in_pb():
    return types.SimpleNamespace(
        TritonError=Err, Tensor=Tensor, InferenceResponse=Response, MetricFamily=MetricFamily,
        get_input_tensor_by_name=lambda req, n: (None if req.tensors.get(n) is None else Tensor(n, req.tensors[n])))


def _load_adapter(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in_pb())
    spec = importlib.util.spec_from_file_location(f"_adapter_{name}", ROOT / "model_repository" / name / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def _args(name: str, params: dict, repository) -> dict:
    """What Triton hands a Python model's ``initialize()``."""
    return {"model_config": json.dumps({"parameters": params}), "model_name": name, "model_version": "1",
            "model_repository": str(repository / name), "model_instance_name": f"{name}_0_0"}


def test_refused_requests_leave_nothing_behind_in_the_stub(serving_assets, monkeypatch):
    """Six refused 20 MB requests through ``preprocess``'s execute(): none of their inputs outlives its response,
    even with the garbage collector off (as it may as well be in an idle stub)."""
    model = _load_adapter("preprocess", monkeypatch)
    params = {"model_dir": {"string_value": str(serving_assets["model_dir"])}}
    model.initialize(_args("preprocess", params, serving_assets["root"]))
    src, sr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")

    def request(samples):
        return _Request({"source_audio": samples, "source_sample_rate": np.array([[sr]], np.int32),
                         "prompt_audio": src[None], "prompt_sample_rate": np.array([[sr]], np.int32)})

    model.execute([request(src[None])])  # warm-up (filter banks, caches)
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        refs = []
        for i in range(6):
            big = np.full((1, 5_000_000), 0.01 * (i + 1), np.float32)  # 20 MB, 312 s at the prompt's rate
            refs.append(weakref.ref(big))
            out = model.execute([request(big)])
            assert out[0].err.code() == "INVALID_ARG" and "too long" in out[0].err.message()
            del big, out
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of 6 refused inputs still alive"
    assert grown < 5e6, f"{grown / 1e6:.1f} MB still allocated after 6 refused 20 MB requests"


def test_graph_adapter_frees_refused_inputs(serving_assets, monkeypatch):
    model = _load_adapter("graph", monkeypatch)
    params = {"graph": {"string_value": "flow_estimator"},
              "onnx_path": {"string_value": str(serving_assets["onnx_dir"] / "fp32" / "flow_estimator.onnx")}}
    model.initialize(_args("flow_estimator", params, serving_assets["root"]))
    gc.collect()
    gc.disable()
    try:
        bad = _est(2000)
        bad["x"][0, 0, 0] = np.nan
        ref = weakref.ref(bad["x"])
        out = model.execute([_Request({k: (v.reshape(-1, 1) if v.ndim == 1 else v) for k, v in bad.items()})])
        assert out[0].err.code() == "INVALID_ARG" and "'x'" in out[0].err.message()
        del bad, out
        assert ref() is None, "the refused request's input is still alive"
    finally:
        gc.enable()


def test_item_result_keeps_no_traceback():
    def fail(x):
        raise AudioError("bad") from ValueError(f"inner {x.shape}")

    try:
        fail(np.zeros(3))
    except AudioError as exc:
        r = ItemResult(error=exc)
    assert r.error.__traceback__ is None and r.error.__cause__.__traceback__ is None and str(r.error) == "bad"


# ------------------------------------------------------------------------------ finding 5 and 8: audio files

def _encode(fmt, subtype, channels, rate, frames, *, value=0.0):
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format=fmt, subtype=subtype) as f:
        block = np.full((min(frames, 1 << 16), channels), value, np.float32)
        left = frames
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
    return buf.getvalue()


def _flac_without_length(data: bytes) -> bytes:
    """The FLAC with STREAMINFO's total-samples field zeroed (a stream written without seeking back)."""
    b = bytearray(data)
    assert b[:4] == b"fLaC"
    v = int.from_bytes(b[18:26], "big")
    b[18:26] = (v >> 36 << 36).to_bytes(8, "big")
    return bytes(b)


@pytest.fixture(scope="module")
def bombs():
    return {
        "ogg 255 channels": (_encode("OGG", "VORBIS", 255, 48000, 12000), ["255 channels", "at most 8"]),
        "flac 655 kHz x 8 channels": (_encode("FLAC", "PCM_16", 8, 655350, 655350),
                                      ["655350 Hz", "outside the supported range"]),
        "wav 64 channels": (_encode("WAV", "PCM_16", 64, 16000, 16000), ["64 channels"]),
        "flac 90 s without length": (_flac_without_length(_encode("FLAC", "PCM_16", 2, 48000, 48000 * 90, value=.1)),
                                     ["does not state its length"]),
    }


def test_decode_bombs_are_refused_with_bounded_memory_and_time(bombs):
    report = {}
    for case, (data, words) in bombs.items():
        tracemalloc.start()
        t0 = time.process_time()  # CPU time: the decoding work, however busy the machine
        with pytest.raises(AudioError) as info:
            audio.decode_audio(data, name="source_audio_bytes", max_seconds=30)
        seconds = time.process_time() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        report[case] = (len(data), peak, seconds)
        for w in words:
            assert w in str(info.value), f"{case}: {w!r} not in {info.value}"
        # at most 30 s of mono at the file's rate (48 kHz here: 5.8 MB) plus one block: nothing near the
        # hundreds of MB the whole file decodes to
        assert peak < 12e6, f"{case}: {peak / 1e6:.1f} MB"
        assert seconds < 5.0, f"{case}: {seconds:.1f} s of CPU time"
    print({k: f"{n / 1e3:.0f} KB -> peak {p / 1e6:.1f} MB, {s:.2f} s CPU" for k, (n, p, s) in report.items()})


def test_decoding_in_blocks_gives_what_a_whole_read_gives():
    rng = np.random.default_rng(0)
    y = rng.uniform(-0.5, 0.5, (150_000, 3)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, y, 44100, format="WAV", subtype="FLOAT")
    got, sr = audio.decode_audio(buf.getvalue(), max_seconds=30)
    assert sr == 44100
    np.testing.assert_array_equal(got, y.mean(axis=1, dtype=np.float64).astype(np.float32))


def test_a_header_that_understates_the_length_cannot_make_the_decoder_exceed_its_budget(monkeypatch):
    """The header's length is checked first, but the decoding itself stops at max_seconds + 1 frame."""
    data = _encode("FLAC", "PCM_16", 8, 48000, 48000 * 90, value=0.1)
    real = audio.soundfile.SoundFile

    class Lying:  # a header that says 1 s over 90 s of 8-channel audio
        def __init__(self, *a, **kw):
            self._f = real(*a, **kw)
            self.samplerate, self.channels, self.frames = self._f.samplerate, self._f.channels, 48000

        def read(self, **kw):
            return self._f.read(**kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(audio.soundfile, "SoundFile", Lying)
    tracemalloc.start()
    with pytest.raises(AudioError) as info:
        audio.decode_audio(data, name="prompt_audio_bytes", max_seconds=30)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "decodes to more than 30 s" in str(info.value)
    assert peak < 12e6, f"{peak / 1e6:.1f} MB"  # 30 s of mono at 48 kHz is 5.8 MB; all 90 s x 8 ch: 138 MB


def test_an_out_of_range_file_rate_is_refused_as_a_rate_not_a_length():
    data = _encode("WAV", "PCM_16", 1, 1, 16000, value=0.1)  # 1 Hz: 16000 s
    with pytest.raises(AudioError) as info:
        audio.decode_audio(data, name="source_audio_bytes", max_seconds=30)
    assert "1 Hz" in str(info.value) and "outside the supported range" in str(info.value)
    assert "too long" not in str(info.value)


@pytest.mark.parametrize("rate", [2**32 + 16000, 2**31, -(2**32) + 16000, 1])
def test_sample_rates_beyond_int32_or_range_are_refused_not_wrapped(serving_assets, rate):
    from cosyvoice_triton.serving.stages.frontend import Preprocessor

    pre = Preprocessor(ModelConfig.from_yaml(serving_assets["model_dir"] / "cosyvoice2.yaml").mel)
    x = np.full((1, 16000), 0.1, np.float32)
    req = {"source_audio": x, "source_sample_rate": np.array([[rate]], np.int64), "prompt_audio": x,
           "prompt_sample_rate": np.array([[16000]], np.int64)}
    err = pre.batch([req])[0].error
    assert isinstance(err, AudioError) and "source_sample_rate" in str(err)
    assert "outside the supported range" in str(err) or "positive" in str(err), err


# ------------------------------------------------------------------------------------ TTS text, codes, retries


@pytest.fixture(scope="module")
def text_frontend(serving_assets):
    from cosyvoice_triton.frontend.text import TextFrontend

    return TextFrontend(serving_assets["model_dir"] / "CosyVoice-BlankEN")


@pytest.mark.parametrize("text, words", [
    ("1" * 2000, ["run of 2000 digits", "maximum 32"]),
    ("Call 0" + "9" * 32 + " now.", ["run of 33 digits", "character 5"]),
    ("12 " * 129, ["258 digits", "maximum 256"]),
    ("１" * 40, ["run of 40 digits"]),  # full-width digits are digits to the normaliser too
])
def test_number_normalisation_is_bounded_before_it_runs(text_frontend, text, words):
    from cosyvoice_triton.errors import TextError

    t0 = time.process_time()  # CPU time: WeTextProcessing spends most of a minute on 2,000 digits
    with pytest.raises(TextError) as info:
        text_frontend.normalize(text)
    assert time.process_time() - t0 < 0.5
    assert all(w in str(info.value) for w in words), str(info.value)


def test_numbers_within_the_limits_are_still_read(text_frontend):
    out = text_frontend.normalize("Call 4155550123 at 9 or " + "1" * 32 + ".", split=False)
    assert not any(c.isdigit() for c in out) and "nine" in out


def test_normalised_length_is_bounded(serving_assets):
    from cosyvoice_triton.errors import TextError
    from cosyvoice_triton.frontend.text import TextFrontend

    f = TextFrontend(serving_assets["model_dir"] / "CosyVoice-BlankEN", max_normalized_chars=40)
    assert f.normalize("Twenty-nine cats.", split=False)
    with pytest.raises(TextError, match="once numbers and symbols are spelled out, more than the maximum 40"):
        f.normalize("I have 29 cats and 31 dogs here.", split=False)


def test_segments_that_cannot_fit_the_flow_are_refused_before_the_lm_and_others_stop_at_its_room():
    from cosyvoice_triton.errors import TextError
    from cosyvoice_triton.models.llm import Qwen2LM
    from cosyvoice_triton.serving.stages.tts import TTSPlan, capped_ratio, speech_token_room
    from cosyvoice_triton.speakers import SpeakerPrompt

    prompt = SpeakerPrompt(np.ones(100, np.int32), np.zeros((200, 80), np.float32), np.zeros(192, np.float32))

    def plan(*lengths):
        return TTSPlan([(f"s{n}", np.ones(n, np.int32)) for n in lengths], np.zeros(0, np.int32),
                       np.zeros(0, np.int32), prompt, 0, "zero_shot")

    assert speech_token_room(plan(10, 700)) == 1400  # 1500 - the prompt's 100
    with pytest.raises(TextError, match=r"text segment 2 .*701 text tokens.*at least 1402 .*prompt's 100.*1500"):
        speech_token_room(plan(10, 701))
    assert capped_ratio(10, 1400) == 20.0  # 200 speech tokens fit: the official ratio
    for n in (71, 135, 333, 700):  # the LM's own float32 arithmetic stays within the room
        _, most = Qwen2LM.length_bounds(n, 2, capped_ratio(n, 1400))
        assert most <= 1400 and most >= 1399


def test_status_codes_come_from_how_a_message_starts_not_from_quoted_client_text():
    from cosyvoice_triton.errors import SpeakerError
    from cosyvoice_triton.serving.stages.lm_engine import BUSY, EngineBusy
    from cosyvoice_triton.serving.stages.tts import _RESERVED, error_code, error_response

    class _Err(Err):
        UNAVAILABLE = "UNAVAILABLE"

    pb = types.SimpleNamespace(TritonError=_Err, InferenceResponse=Response)
    assert BUSY in _RESERVED
    assert error_code(pb, f"{BUSY}too many concurrent TTS requests") == pb.TritonError.UNAVAILABLE
    assert error_code(pb, "internal error: KeyError: 'x'") == pb.TritonError.INTERNAL
    for quoted in (BUSY, "internal error: ", "UNAVAILABLE: "):
        assert error_code(pb, f"unknown speaker_id '{quoted}x'") == pb.TritonError.INVALID_ARG
        # a client error that starts with a reserved prefix is never read back as another code
        res = error_response(pb, SpeakerError(f"{quoted}x"))
        assert res.error().code() == pb.TritonError.INVALID_ARG
        assert error_code(pb, res.error().message()) == pb.TritonError.INVALID_ARG
    busy = error_response(pb, EngineBusy("the LM engine is shut down"))
    assert busy.error().code() == pb.TritonError.UNAVAILABLE
    assert error_code(pb, busy.error().message()) == pb.TritonError.UNAVAILABLE


def test_an_error_quoting_long_client_input_stays_under_grpcs_metadata_limit():
    """gRPC carries an error's message as trailing metadata, which clients refuse above 8 KiB (the stream is lost
    as RESOURCE_EXHAUSTED); every error response is cut to MAX_ERROR_CHARS, and ids are quoted short."""
    from cosyvoice_triton.errors import SpeakerError
    from cosyvoice_triton.serving.stages import triton_io
    from cosyvoice_triton.serving.stages.tts import error_response
    from cosyvoice_triton.speakers import validate_speaker_id

    pb = types.SimpleNamespace(TritonError=Err, InferenceResponse=Response)
    with pytest.raises(SpeakerError) as exc:
        validate_speaker_id("x" * 10000)
    assert len(str(exc.value)) < 200 and "invalid" in str(exc.value)
    for res in (error_response(pb, SpeakerError("unknown " + "y" * 20000 + " end")),
                triton_io.error_response(pb, KeyError("z" * 9000))):
        message = res.error().message()
        assert len(message) <= triton_io.MAX_ERROR_CHARS
        assert "characters cut" in message and message.endswith(("end", "'"))
    short = triton_io.error_response(pb, SpeakerError("unknown speaker 'a'"))
    assert short.error().message() == "unknown speaker 'a'"


@pytest.mark.parametrize("status", ["400", "StatusCode.INVALID_ARGUMENT"])
@pytest.mark.parametrize("quoted", ["TTS busy: ", "Stub process 'x' is not healthy",
                                    "Request for unknown model: 'x' has no available versions",
                                    "Failed for execute the inference request. Model 'x' is not ready."])
def test_a_refusal_quoting_transient_words_is_not_retried(status, quoted):
    from tritonclient.utils import InferenceServerException

    from cosyvoice_triton.clients.retry import is_retryable

    assert not is_retryable(InferenceServerException(f"unknown speaker_id '{quoted}'", status=status))
    assert not is_retryable(InferenceServerException(quoted, status="StatusCode.INVALID_ARGUMENT"))
    # Triton's own answer for an unloaded model over HTTP (400, or 404: seen in a fresh-clone make test while the
    # flow stage was reloaded after a kill) is still retried
    for unloaded in ("400", "404"):
        assert is_retryable(InferenceServerException("Request for unknown model: 'cosyvoice_vc' has no available "
                                                     "versions", status=unloaded))
    assert not is_retryable(InferenceServerException("Request for unknown model: 'nope' is not found", status="404"))


def test_the_lm_of_a_long_segment_is_asked_for_no_more_than_the_flows_room():
    from cosyvoice_triton.models.llm import Qwen2LM
    from cosyvoice_triton.serving.stages.tts import TTSPlan, TTSService, speech_token_room
    from cosyvoice_triton.speakers import SpeakerPrompt

    asked = []

    class Job:
        hit_max_len = False

        def tokens(self):
            return iter(np.ones(8, np.int64))

        def cancel(self):
            pass

    class Engine:
        def submit(self, request, cancelled):
            asked.append(Qwen2LM.length_bounds(len(request.text_tokens), request.min_token_text_ratio,
                                               request.max_token_text_ratio)[1])
            return Job()

    service = TTSService.__new__(TTSService)
    service.engine, service.prefixes = Engine(), None
    service.token2wav = lambda prompt, tokens, seed, speed=1.0: np.zeros(480, np.float32)
    prompt = SpeakerPrompt(np.ones(42, np.int32), np.zeros((84, 80), np.float32), np.zeros(192, np.float32))
    plan = TTSPlan([("tags", np.ones(135, np.int32)), ("short", np.ones(10, np.int32))], np.zeros(0, np.int32),
                   np.zeros(0, np.int32), prompt, 0, "zero_shot")
    plan.max_speech_tokens = speech_token_room(plan)
    assert len(list(service.synthesize(plan, stream=False))) == 2
    assert asked[0] <= 1500 - 42 < 135 * 20  # 2,742 with the prompt's, officially: the flow refuses that
    assert asked[1] == 200  # the official 20 per text token where it fits
