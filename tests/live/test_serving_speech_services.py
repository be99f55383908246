"""The stand-alone speech services as public models (``speech_tokens``, ``speaker_embedding``: ensembles of the
``cosyvoice_vc`` stages) and per-request priorities in the clients (issue 13).

No server: the render (every flavor; left out of a versioned render), ``preprocess`` serving one utterance when only
its outputs are asked for, the warm-up plan, the client's priority checks. Live (one tritonserver, tiny demo model,
rendered with ``priority_levels=2``): the served tokens / embedding equal the in-process library
(``frontend.speech_models`` on the model folder's ONNX files) over HTTP and gRPC, hostile audio is refused with
INVALID_ARGUMENT naming the problem and the server goes on serving, the warm-up reaches both models, Triton's metrics
carry them, and priorities 1 / 2 are served while one beyond the levels is refused by the client (Triton 2.51 itself
serves it at the model's default level: tested here with tritonclient directly).
"""

from __future__ import annotations

import io
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, rel_err, served

from cosyvoice_triton.clients.client import PriorityError, VCClient, VCError, config_priority_levels
from cosyvoice_triton.errors import AudioError
from cosyvoice_triton.frontend import audio, features
from cosyvoice_triton.serving.launch.warmup import plan
from cosyvoice_triton.serving.repository import render_repository
from cosyvoice_triton.serving.stages.frontend import UTTERANCES, Preprocessor, utterances_for
from cosyvoice_triton.shapes import SPEAKER_EMBEDDING_MODEL, SPEECH_TOKENS_MODEL

PUBLIC = (SPEECH_TOKENS_MODEL, SPEAKER_EMBEDDING_MODEL)
LEVELS = 2  # the live server's priority_levels


def _parse(path):
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    text_format = pytest.importorskip("google.protobuf.text_format")
    return text_format.Parse(path.read_text(), pb2.ModelConfig())


@pytest.fixture(scope="module")
def speech():
    """2 s of the bundled source recording (its own rate) and a 1.5 s prompt."""
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: 2 * ssr], ssr, prm[: int(1.5 * psr)], psr


# ------------------------------------------------------------------------------------------ no server
@pytest.mark.parametrize("flavor", ["local", "onnx", "trt"])
def test_rendered_in_every_flavor_as_ensembles_of_the_vc_stages(flavor, tmp_path):
    from cosyvoice_triton.models.demo import write_demo_model

    model_dir = write_demo_model(tmp_path / "demo", size="tiny")
    out = tmp_path / "repo"
    report = render_repository(flavor, out, model_dir=model_dir, onnx_dir=tmp_path / "onnx", allow_missing=True,
                               priority_levels=LEVELS)
    steps = {SPEECH_TOKENS_MODEL: ["preprocess", "speech_tokenizer"],
             SPEAKER_EMBEDDING_MODEL: ["preprocess", "speaker_encoder"]}
    ins = {SPEECH_TOKENS_MODEL: ["source_audio", "source_sample_rate", "source_audio_bytes"],
           SPEAKER_EMBEDDING_MODEL: ["prompt_audio", "prompt_sample_rate", "prompt_audio_bytes"]}
    for name in PUBLIC:
        assert report.models[name] == "ensemble"
        cfg = _parse(out / name / "config.pbtxt")
        assert cfg.platform == "ensemble" and cfg.max_batch_size == 1
        assert [s.model_name for s in cfg.ensemble_scheduling.step] == steps[name]
        assert [i.name for i in cfg.input] == ins[name] and all(i.optional for i in cfg.input)
        assert [o.name for o in cfg.output] == [name]
        # preprocess is asked for one utterance's outputs only (it computes just that one)
        asked = set(cfg.ensemble_scheduling.step[0].output_map)
        assert utterances_for(asked) == (("source",) if name == SPEECH_TOKENS_MODEL else ("prompt",))
    # the members carry the priority levels (an ensemble has no scheduler: Triton passes the priority on)
    for member in ("preprocess", "speech_tokenizer", "speaker_encoder"):
        batching = _parse(out / member / "config.pbtxt").dynamic_batching
        assert batching.priority_levels == LEVELS and batching.default_priority_level == LEVELS


def test_left_out_of_a_versioned_render(tmp_path):
    from cosyvoice_triton.serving.repository import NOT_VERSIONED

    # they call the graphs with model_version -1: a staged candidate would serve them
    assert set(PUBLIC) <= set(NOT_VERSIONED)


def test_preprocess_computes_only_the_utterance_asked_for(serving_assets, speech):
    from cosyvoice_triton.config import ModelConfig

    src, ssr, prm, psr = speech
    cfg = ModelConfig.from_yaml(serving_assets["model_dir"] / "cosyvoice2.yaml")
    pre = Preprocessor(cfg.mel, sample_rate=cfg.sample_rate)
    both = pre.one(src[None], np.array([[ssr]]), prm[None], np.array([[psr]]))
    source_only = pre.one(src[None], np.array([[ssr]]), need=("source",)).tensors()
    prompt_only = pre.one(prompt_audio=prm[None], prompt_sample_rate=np.array([[psr]]), need=("prompt",)).tensors()
    assert set(source_only) == {"source_whisper_mel", "source_whisper_mel_len"}
    assert set(prompt_only) == {"prompt_whisper_mel", "prompt_whisper_mel_len", "prompt_fbank", "prompt_mel"}
    for k, v in {**source_only, **prompt_only}.items():
        np.testing.assert_array_equal(v, both.tensors()[k])
    # the absent utterance is neither needed nor checked; the needed one still is
    with pytest.raises(AudioError, match="source: missing input source_audio"):
        pre.one(prompt_audio=prm[None], prompt_sample_rate=np.array([[psr]]), need=("source",))
    results = pre.batch([{"source_audio": src[None], "source_sample_rate": np.array([[ssr]])},
                         {"prompt_audio": prm[None], "prompt_sample_rate": np.array([[psr]])}],
                        [utterances_for(["source_whisper_mel"]), utterances_for(["prompt_fbank"])])
    assert [r.ok for r in results] == [True, True]
    assert utterances_for(None) == UTTERANCES == utterances_for(["unrelated"])


def test_warm_up_plan_includes_the_speech_services():
    models = [
        {"name": SPEECH_TOKENS_MODEL, "inputs": {"source_audio", "source_sample_rate", "source_audio_bytes"},
         "outputs": {"speech_tokens"}, "decoupled": False},
        {"name": SPEAKER_EMBEDDING_MODEL, "inputs": {"prompt_audio", "prompt_sample_rate", "prompt_audio_bytes"},
         "outputs": {"speaker_embedding"}, "decoupled": False},
        {"name": "speech_tokenizer", "inputs": {"whisper_mel", "whisper_mel_len"}, "outputs": {"speech_tokens"},
         "decoupled": False},
        {"name": "speaker_encoder", "inputs": {"fbank"}, "outputs": {"speaker_embedding"}, "decoupled": False},
        {"name": "preprocess", "inputs": {"source_audio", "prompt_audio"}, "outputs": {"source_whisper_mel"},
         "decoupled": False},
    ]
    assert plan(models) == [(SPEECH_TOKENS_MODEL, "speech_tokens"), (SPEAKER_EMBEDDING_MODEL, "speaker_embedding")]


def test_priority_levels_from_configs_and_bad_priorities():
    step = {"preprocess": 3, "speech_tokenizer": 2}
    ensemble = {"ensemble_scheduling": {"step": [{"model_name": "preprocess"}, {"model_name": "speech_tokenizer"}]}}
    assert config_priority_levels(ensemble, step.__getitem__) == 2  # the fewest levels among its steps
    unread = {"preprocess": 3, "speech_tokenizer": None}  # a step's config could not be read
    assert config_priority_levels(ensemble, unread.__getitem__) is None  # unknown: the priority goes unchecked
    assert config_priority_levels({"dynamic_batching": {"priority_levels": "2"}}) == 2  # JSON uint64: a string
    assert config_priority_levels({"dynamic_batching": {}}) == 0
    assert config_priority_levels({}) == 0
    client = VCClient.__new__(VCClient)  # no connection: only the local checks
    client.check_priority, client._levels, client.admin_key = True, {"m": 2, "plain": 0, "unknown": None}, None
    assert client.validate_priority("m", None) == 0 and client.validate_priority("m", 2) == 2
    assert client.validate_priority("unknown", 7) == 7  # config not readable: sent as it is
    for bad, words in ((0, ">= 1"), (-1, ">= 1"), (1.5, "whole number"), (True, "whole number"), ("1", "whole number")):
        with pytest.raises(PriorityError, match=words):
            client.validate_priority("m", bad)
    with pytest.raises(PriorityError, match="beyond the 2 priority levels of model 'm'"):
        client.validate_priority("m", 3)
    with pytest.raises(PriorityError, match="declares no priority levels"):
        client.validate_priority("plain", 1)


# ------------------------------------------------------------------------------------------- live
@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    repo = tmp_path_factory.mktemp("speech_services") / "model_repository"
    render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      max_queue_delay_us=2000, priority_levels=LEVELS)
    with served(repo) as s:
        yield s


@pytest.fixture(scope="module")
def library(serving_assets):
    """The in-process library on the model folder's shipped graphs (what ``CosyVoice2`` runs)."""
    from cosyvoice_triton.frontend.speech_models import SpeakerEncoder, SpeechTokenizer

    d = serving_assets["model_dir"]
    tokenizer, encoder = SpeechTokenizer(d / "speech_tokenizer_v2.onnx"), SpeakerEncoder(d / "campplus.onnx")

    def tokens(wave, sr):
        whisper, n = features.whisper_log_mel_batch([audio.resample(wave, orig_sr=sr, target_sr=16000)])
        return tokenizer.tokenize(whisper, n)[0]

    def embedding(wave, sr):
        fbank, n = features.kaldi_fbank_batch([audio.resample(wave, orig_sr=sr, target_sr=16000)])
        return encoder.embed(fbank, n)[0]

    return tokens, embedding


def _url(server, protocol):
    return server.http_url if protocol == "http" else server.grpc_url


def _wav(wave, sr, fmt="WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wave, sr, format=fmt, subtype="PCM_16" if fmt == "WAV" else None)
    return buf.getvalue()


def test_warm_up_reaches_both_models(server):
    from cosyvoice_triton.serving.launch.warmup import warm_up

    results = warm_up(server, timeout=PATIENCE_S)
    for name in PUBLIC:
        assert isinstance(results.get(name), float), results


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_equals_the_in_process_library(server, library, speech, protocol):
    tokens_of, embedding_of = library
    src, ssr, prm, psr = speech
    with VCClient(_url(server, protocol), protocol=protocol, timeout=PATIENCE_S) as c:
        tokens = c.speech_tokens(src, sample_rate=ssr)
        embedding = c.speaker_embedding(prm, sample_rate=psr)
        assert tokens.dtype == np.int32 and tokens.shape == (50,)  # 2 s at 25 Hz
        np.testing.assert_array_equal(tokens, tokens_of(src, ssr))
        assert embedding.dtype == np.float32 and embedding.shape == (192,)
        assert rel_err(embedding, embedding_of(prm, psr)) <= 1e-4
        # an encoded file (decoded by the server) gives what its samples give
        pcm, pcm_sr = sf.read(io.BytesIO(_wav(src, ssr)), dtype="float32")
        np.testing.assert_array_equal(c.speech_tokens(_wav(src, ssr), encoded=True), tokens_of(pcm, pcm_sr))
        pcm, pcm_sr = sf.read(io.BytesIO(_wav(prm, psr, "FLAC")), dtype="float32")
        assert rel_err(c.speaker_embedding(_wav(prm, psr, "FLAC"), encoded=True), embedding_of(pcm, pcm_sr)) <= 1e-4


def _hostile(speech):
    src, ssr, _, _ = speech
    tone = (0.3 * np.sin(np.arange(31 * 16000) * 0.05)).astype(np.float32)
    nan = src.copy()
    nan[100] = np.nan
    return [  # (audio, sample_rate or None for encoded bytes, words the refusal must contain)
        (tone, 16000, "31 s is too long; at most 30 s is accepted"),
        (_wav(tone, 16000), None, "at most 30 s"),
        (np.zeros(0, np.float32), 16000, "empty (0 samples)"),
        (src[: int(0.05 * ssr)], ssr, "too short; at least 0.1 s"),
        (np.zeros(16000, np.float32), 16000, "silent"),
        (nan, ssr, "1 NaN"),
        (src, 0, "sample_rate"),
        (b"RIFF\x00\x00\x00\x00WAVEgarbage" * 20, None, "audio_bytes"),
        (b"", None, "audio_bytes"),
    ]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_hostile_audio_is_refused_by_name_and_the_server_goes_on(server, speech, protocol, library):
    tokens_of, _ = library
    src, ssr, prm, psr = speech
    status = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    with VCClient(_url(server, protocol), protocol=protocol, timeout=PATIENCE_S) as c:
        for call, which in ((c.speech_tokens, "source"), (c.speaker_embedding, "prompt")):
            for wave, sr, words in _hostile(speech):
                kw = {"encoded": True} if sr is None else {"sample_rate": sr}
                with pytest.raises(VCError) as info:
                    call(wave, **kw)
                err = info.value
                assert err.status == status and err.invalid_argument, (call.__name__, words, err)
                assert words in err.message and which in err.message, (call.__name__, words, err.message)
                assert "in ensemble" not in err.message  # the client drops Triton's ensemble prefix
        # both models still serve, with the right answer
        np.testing.assert_array_equal(c.speech_tokens(src, sample_rate=ssr), tokens_of(src, ssr))
        assert c.speaker_embedding(prm, sample_rate=psr).shape == (192,)
        assert all(c._client.is_model_ready(m) for m in (*PUBLIC, "preprocess", "speech_tokenizer",
                                                          "speaker_encoder"))


def test_raw_requests_with_missing_or_doubled_audio(server, speech):
    """What the client cannot send: no audio at all, samples without their rate, samples and bytes together."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    src, ssr, _, _ = speech

    def t(module, name, arr, dtype):
        x = module.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

    for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        samples = t(module, "source_audio", src[None], "FP32")
        rate = t(module, "source_sample_rate", np.array([[ssr]], np.int32), "INT32")
        data = t(module, "source_audio_bytes", np.array([[_wav(src, ssr)]], dtype=object), "BYTES")
        client = module.InferenceServerClient(url)
        for inputs, words in (([rate], "missing input source_audio"), ([samples], "missing input source_sample_rate"),
                              ([samples, rate, data], "send either source_audio with source_sample_rate, or "
                                                      "source_audio_bytes")):
            with pytest.raises(Exception) as info:
                client.infer(SPEECH_TOKENS_MODEL, inputs)
            err = VCError.from_exception(info.value)
            assert err.invalid_argument and words in err.message, err
        assert client.infer(SPEECH_TOKENS_MODEL, [samples, rate]).as_numpy("speech_tokens").shape == (1, 50)
        client.close()


def test_metrics_carry_the_new_models(server, speech):
    src, ssr, prm, psr = speech
    with VCClient(server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
        c.speech_tokens(src, sample_rate=ssr)
        c.speaker_embedding(prm, sample_rate=psr)
    body = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    for name in PUBLIC:
        lines = [ln for ln in body.splitlines()
                 if ln.startswith("nv_inference_request_success{") and f'model="{name}"' in ln]
        assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1, name
        assert any(ln.startswith("nv_inference_request_failure{") and f'model="{name}"' in ln
                   for ln in body.splitlines())


# ------------------------------------------------------------------------------------------ priorities
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_priority_one_and_two_are_served(server, speech, protocol):
    src, ssr, prm, psr = speech
    with VCClient(_url(server, protocol), protocol=protocol, timeout=PATIENCE_S) as c:
        assert c.priority_levels(SPEECH_TOKENS_MODEL) == LEVELS  # read from its steps' configs (admin key)
        assert c.priority_levels("cosyvoice_tts") == LEVELS
        for level in (1, 2):
            assert c.speech_tokens(src, sample_rate=ssr, priority=level).shape == (50,)
            assert c.speaker_embedding(prm, sample_rate=psr, priority=level).shape == (192,)
        assert c.convert(src[: ssr], prm, source_sr=ssr, prompt_sr=psr, priority=2).waveform.size > 0
        assert c.tts("Hi.", prompt=prm, prompt_sr=psr, priority=1).waveform.size > 0
        if protocol == "grpc":
            assert list(c.convert_stream(src[: ssr], prm, source_sr=ssr, prompt_sr=psr, priority=1))
            assert list(c.tts_stream("Hi.", prompt=prm, prompt_sr=psr, priority=2))
        else:  # Triton 2.51's generate_stream has no request priority: refused before anything is sent
            with pytest.raises(PriorityError, match="generate_stream cannot carry a request priority"):
                c.tts_stream("Hi.", prompt=prm, prompt_sr=psr, priority=1)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_priority_beyond_the_levels(server, speech, protocol):
    """Triton 2.51 does not refuse priority 3 on 2 levels: it serves the request at the model's default level
    (an ensemble passes the priority on; each step falls back to its own default). The client refuses it."""
    src, ssr, prm, psr = speech
    with VCClient(_url(server, protocol), protocol=protocol, timeout=PATIENCE_S) as c:
        for call, audio_ in ((c.speech_tokens, src), (c.speaker_embedding, prm)):
            with pytest.raises(PriorityError, match=f"beyond the {LEVELS} priority levels"):
                call(audio_, sample_rate=ssr, priority=LEVELS + 1)
        with pytest.raises(PriorityError, match="beyond the 2 priority levels of model 'cosyvoice_tts'"):
            c.tts("Hi.", prompt=prm, prompt_sr=psr, priority=LEVELS + 1)
        # what Triton itself does with it: served, no error
        raw = c._module.InferInput("source_audio", [1, len(src)], "FP32")
        raw.set_data_from_numpy(src[None])
        rate = c._module.InferInput("source_sample_rate", [1, 1], "INT32")
        rate.set_data_from_numpy(np.array([[ssr]], np.int32))
        answer = c._client.infer(SPEECH_TOKENS_MODEL, [raw, rate], priority=LEVELS + 1)
        assert answer.as_numpy("speech_tokens").shape == (1, 50)
    with VCClient(_url(server, protocol), protocol=protocol, timeout=PATIENCE_S, check_priority=False) as c:
        assert c.speech_tokens(src, sample_rate=ssr, priority=LEVELS + 7).shape == (50,)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_asyncio_client(server, library, speech, protocol):
    import asyncio

    from cosyvoice_triton.clients.client import AsyncVCClient

    tokens_of, embedding_of = library
    src, ssr, prm, psr = speech

    async def run():
        async with AsyncVCClient(_url(server, protocol), protocol=protocol, timeout=PATIENCE_S) as c:
            tokens = await c.speech_tokens(src, sample_rate=ssr, priority=1)
            embedding = await c.speaker_embedding(prm, sample_rate=psr, priority=2)
            assert await c.priority_levels(SPEAKER_EMBEDDING_MODEL) == LEVELS
            with pytest.raises(PriorityError, match="beyond the 2 priority levels"):
                await c.speech_tokens(src, sample_rate=ssr, priority=3)
            if protocol == "grpc":
                chunks = [ch async for ch in c.tts_stream("Hi.", prompt=prm, prompt_sr=psr, priority=1)]
            else:
                with pytest.raises(PriorityError, match="generate_stream"):
                    c.tts_stream("Hi.", prompt=prm, prompt_sr=psr, priority=1)
                chunks = [ch async for ch in c.tts_stream("Hi.", prompt=prm, prompt_sr=psr)]
            return tokens, embedding, chunks

    tokens, embedding, chunks = asyncio.run(run())
    np.testing.assert_array_equal(tokens, tokens_of(src, ssr))
    assert rel_err(embedding, embedding_of(prm, psr)) <= 1e-4
    assert chunks and all(ch.waveform.size for ch in chunks)


def test_cli_tokens_embedding_and_priority(server, library, tmp_path):
    import subprocess
    import sys


    tokens_of, embedding_of = library
    cli = [sys.executable, "-m", "cosyvoice_triton", "client"]
    wav = FIXTURES / "source_en_5s.wav"
    wave, sr = sf.read(wav, dtype="float32")
    out = subprocess.run([*cli, "tokens", "--url", server.http_url, "--audio", str(wav), "--priority", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(np.array(out.stdout.split(), np.int32), tokens_of(wave, sr))
    npy = tmp_path / "emb.npy"
    out = subprocess.run([*cli, "embedding", "--url", server.grpc_url, "--protocol", "grpc", "--audio", str(wav),
                          "-o", str(npy)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert rel_err(np.load(npy), embedding_of(wave, sr)) <= 1e-4
    out = subprocess.run([*cli, "tokens", "--url", server.http_url, "--audio", str(wav), "--priority", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--priority: priority 3 is beyond the 2 priority levels" in out.stderr, out
