"""``cosyvoice2``, the official CosyVoice runtime's interface (``runtime/triton_trtllm``), against a real
``tritonserver`` (local flavor, tiny demo): the requests its clients send, and the official clients themselves.

One server for the module (explicit model control), rendered with the default ``cosyvoice2_decoupled=true``; the
offline tests reload ``cosyvoice2`` with the config that ``cosyvoice2_decoupled=false`` renders (a config override
of the load API), the streaming ones with the rendered decoupled one. The requests are the official clients': a
16 kHz ``reference_wav`` of shape [1, N] zero-padded past ``reference_wav_len`` [[len]], ``reference_text`` and
``target_text`` as [1, 1] BYTES of Python strings, ``waveform`` requested; the stream with
``enable_empty_final_response`` read until ``triton_final_response``. Equality: the answer of ``cosyvoice2`` is the
pipeline's own answer for the same prompt and text (``cosyvoice_tts_stream`` chunk by chunk, ``cosyvoice_tts``
whole), same server, sequential requests.

The official clients run from ``$COSYVOICE_OFFICIAL_GIT`` (a git folder of FunAudioLLM/CosyVoice holding commit
ace7c47); their tests skip without it.
"""

from __future__ import annotations

import json
import queue
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, run_official_client, served

REFERENCE_TEXT = "the prompt says hello"
TARGET_TEXT = "Hello there, this is a test of the official interface."
RATE_IN, RATE_OUT = 16000, 24000


# ------------------------------------------------------------------------------------------------ in process


def _request(wave, reference_text=REFERENCE_TEXT, target_text=TARGET_TEXT, pad_to=0):
    from cosyvoice_triton.serving.stages.official_api import official_request

    tensors = official_request(wave, reference_text, target_text)
    if pad_to:
        padded = np.zeros((1, pad_to), np.float32)
        padded[0, : wave.size] = wave
        tensors["reference_wav"] = padded
    return tensors


def test_pipeline_inputs_cut_the_padding_and_name_what_is_wrong():
    from cosyvoice_triton.errors import CosyVoiceError
    from cosyvoice_triton.serving.stages.official_api import pipeline_inputs

    wave = np.linspace(-0.5, 0.5, 1600, dtype=np.float32)
    out = pipeline_inputs(_request(wave, pad_to=16000))
    np.testing.assert_array_equal(out["prompt_audio"], wave[None])
    assert int(out["prompt_sample_rate"][0, 0]) == RATE_IN
    assert out["text"][0, 0].decode() == TARGET_TEXT and out["prompt_text"][0, 0].decode() == REFERENCE_TEXT
    assert "prompt_text" not in pipeline_inputs(_request(wave, reference_text=""))  # the official client's default
    kept = pipeline_inputs(_request(wave, reference_text=""), keep_empty_reference_text=True)  # CosyVoice3's rule
    assert kept["prompt_text"].tolist() == [[b""]]
    bad = {"reference_wav": ({"reference_wav": None}, "missing input(s) reference_wav"),
           "len": ({"reference_wav_len": None}, "missing input(s) reference_wav_len"),
           "larger": ({"reference_wav_len": np.array([[1601]], np.int32)}, "larger than reference_wav's 1600"),
           "zero": ({"reference_wav_len": np.array([[0]], np.int32)}, "reference_wav_len must be at least 1"),
           "empty": ({"target_text": np.array([[b" "]], object)}, "target_text is empty"),
           "utf8": ({"target_text": np.array([[b"\xff\xfe hi"]], object)}, "target_text: not valid UTF-8"),
           "ref_utf8": ({"reference_text": np.array([[b"\xc3"]], object)}, "reference_text: not valid UTF-8"),
           "shape": ({"reference_wav": wave[None, None]}, "expected [1, samples]")}
    for change, words in bad.values():
        with pytest.raises(CosyVoiceError, match=re.escape(words)):
            pipeline_inputs({**_request(wave), **change})


@pytest.fixture(scope="module")
def rendered_configs(serving_assets, tmp_path_factory) -> dict[bool, dict]:
    """``cosyvoice2``'s config as rendered with ``cosyvoice2_decoupled`` true and false."""
    from cosyvoice_triton.serving.repository import render_repository

    configs = {}
    for flag in (True, False):
        out = tmp_path_factory.mktemp(f"decoupled_{flag}")
        report = render_repository("local", out, model_dir=serving_assets["model_dir"],
                                   onnx_dir=serving_assets["onnx_dir"], cosyvoice2_decoupled=flag)
        assert report.models["cosyvoice2"] == ("python (decoupled)" if flag else "python")
        configs[flag] = _config_json(out / "cosyvoice2" / "config.pbtxt")
    return configs


def test_the_switch_changes_the_transaction_policy_only(rendered_configs, serving_assets, tmp_path):
    """``cosyvoice2_decoupled`` only changes the transaction policy; a deployment that does not answer 24 kHz gets
    no ``cosyvoice2`` (the official clients write 24 kHz whatever they get)."""
    from cosyvoice_triton.serving.repository import render_repository

    configs = {k: dict(v) for k, v in rendered_configs.items()}
    assert configs[True].pop("model_transaction_policy") == {"decoupled": True}
    assert "model_transaction_policy" not in configs[False] or not configs[False]["model_transaction_policy"].get(
        "decoupled")
    configs[False].pop("model_transaction_policy", None)
    assert configs[True] == configs[False]
    report = render_repository("local", tmp_path / "16k", model_dir=serving_assets["model_dir"],
                               onnx_dir=serving_assets["onnx_dir"], output_sample_rate=16000)
    assert "cosyvoice2" not in report.models and "cosyvoice_tts" in report.models


def test_the_tensors_are_the_official_configs(rendered_configs, official_runtime):
    configs = rendered_configs
    text = (official_runtime / "model_repo" / "cosyvoice2" / "config.pbtxt").read_text()

    text = re.sub(r"\$\{(\w+)\}", lambda m: {"triton_max_batch_size": "16", "max_queue_delay_microseconds": "0",
                                             "decoupled_mode": "true", "bls_instance_num": "1"}.get(m.group(1), "x"),
                  text)
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format
    from google.protobuf.json_format import MessageToDict

    official = MessageToDict(text_format.Parse(text, pb2.ModelConfig()), preserving_proto_field_name=True)

    def tensors(cfg, kind):
        return {t["name"]: (t["data_type"], t["dims"], bool(t.get("optional"))) for t in cfg[kind]}

    assert tensors(configs[True], "input") == tensors(official, "input")
    assert tensors(configs[True], "output") == tensors(official, "output")
    assert official["name"] == configs[True]["name"] == "cosyvoice2"


# ------------------------------------------------------------------------------------------------ fixtures


def _config_json(path: Path) -> dict:
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(text_format.Parse(path.read_text(), pb2.ModelConfig()), preserving_proto_field_name=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1.5 s of the bundled prompt at 16 kHz (the rate the official clients send), and it as a wav file."""
    from scipy.signal import resample_poly

    wave, sr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    assert sr == 22050
    wave = resample_poly(wave[: int(1.5 * sr)], 320, 441).astype(np.float32)  # 22050 * 320 / 441 = 16000
    path = tmp_path_factory.mktemp("reference") / "reference_16k.wav"
    sf.write(path, wave, RATE_IN, subtype="FLOAT")
    return wave, path


class Cosyvoice2Server:
    """The module's server and the mode ``cosyvoice2`` is loaded in (``ensure`` reloads it with the rendered
    config of the other mode)."""

    def __init__(self, server, configs):
        self.server, self.configs, self.mode = server, configs, "decoupled"

    def ensure(self, mode: str):
        if self.mode != mode:
            body = json.dumps({"parameters": {"config": json.dumps(self.configs[mode])}}).encode()
            status, text = self.server.request("POST", "/v2/repository/models/cosyvoice2/load", body=body,
                                               admin=True, timeout=PATIENCE_S)
            assert status == 200, text
            self.mode = mode
        status, text = self.server.request("GET", "/v2/models/cosyvoice2/config", admin=True, timeout=PATIENCE_S)
        assert status == 200, text
        assert bool(json.loads(text).get("model_transaction_policy", {}).get("decoupled")) == (mode == "decoupled")
        return self.server


@pytest.fixture(scope="module")
def cosyvoice2(serving_assets, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    root = tmp_path_factory.mktemp("cosyvoice2")
    render_repository("local", root / "offline", model_dir=serving_assets["model_dir"],
                      onnx_dir=serving_assets["onnx_dir"], cosyvoice2_decoupled=False, max_queue_delay_us=5000)
    repo = root / "model_repository"
    render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      max_queue_delay_us=5000)
    configs = {"offline": _config_json(root / "offline" / "cosyvoice2" / "config.pbtxt"),
               "decoupled": _config_json(repo / "cosyvoice2" / "config.pbtxt")}
    with served(repo, model_control="explicit", load_models=["*"]) as server:
        yield Cosyvoice2Server(server, configs)


@pytest.fixture()
def streaming(cosyvoice2):
    return cosyvoice2.ensure("decoupled")


@pytest.fixture()
def offline(cosyvoice2):
    return cosyvoice2.ensure("offline")


# ------------------------------------------------------------------------------------------------ clients


def _official_inputs(mod, tensors):
    """As the official clients build them: the strings as Python ``str`` objects, ``waveform`` requested."""
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in tensors.items():
        if arr.dtype == object:
            arr = np.array([[v.decode() if isinstance(v, bytes) and _utf8(v) else v for v in arr.reshape(-1)]],
                           object)
        t = mod.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs, [mod.InferRequestedOutput("waveform")]


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def _stream(server, model, inputs, outputs=None):
    """One gRPC stream as client_grpc.py --mode streaming reads it: (waveform chunks, error, final seen)."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    request_id = str(uuid.uuid4())
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    chunks, error, final = [], None, False
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, outputs=outputs,
                                  enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=PATIENCE_S)
            if error is not None:
                break
            response = result.get_response()
            assert response.id == request_id
            if response.parameters["triton_final_response"].bool_param:
                final = True
                break
            chunks.append(result.as_numpy("waveform"))
    finally:
        client.stop_stream()
        client.close()
    return chunks, error, final


def _pipeline_tensors(wave, stream=None):
    arrays = {"text": np.array([[TARGET_TEXT.encode()]], object), "prompt_audio": wave[None].astype(np.float32),
              "prompt_sample_rate": np.array([[RATE_IN]], np.int32),
              "prompt_text": np.array([[REFERENCE_TEXT.encode()]], object)}
    if stream is not None:
        arrays["stream"] = np.array([[stream]], bool)
    return arrays


def _plain_inputs(mod, arrays):
    out = []
    for name, arr in arrays.items():
        t = mod.InferInput(name, list(arr.shape), {"object": "BYTES", "float32": "FP32", "int32": "INT32",
                                                   "bool": "BOOL"}[str(arr.dtype)])
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _assert_speech(wave: np.ndarray, text: str = TARGET_TEXT):
    """24 kHz float speech of a plausible length: the LM speaks 2 to 20 speech tokens (25 a second) per text
    token, and a text has at most as many tokens as UTF-8 bytes."""
    assert wave.dtype == np.float32 and wave.ndim == 1 and wave.size > 0
    assert np.all(np.isfinite(wave)) and np.max(np.abs(wave)) > 0
    assert 2 / 25 <= wave.size / RATE_OUT <= 20 * len(text.encode()) / 25, wave.size / RATE_OUT


# ------------------------------------------------------------------------------------------------ streaming


def test_grpc_stream_as_client_grpc_equals_the_pipeline_stream(streaming, reference):
    import tritonclient.grpc as grpcclient

    wave, _ = reference
    inputs, outputs = _official_inputs(grpcclient, _request(wave, pad_to=10 * RATE_IN))  # padded to 10 s
    chunks, error, final = _stream(streaming, "cosyvoice2", inputs, outputs)
    assert error is None and final
    assert len(chunks) > 1 and all(c.ndim == 2 and c.shape[0] == 1 for c in chunks)
    joined = np.concatenate([c.reshape(-1) for c in chunks])
    _assert_speech(joined)
    own, error, final = _stream(streaming, "cosyvoice_tts_stream",
                                _plain_inputs(grpcclient, _pipeline_tensors(wave, stream=True)))
    assert error is None and final
    assert [c.size for c in chunks] == [c.size for c in own]
    for got, want in zip(chunks, own, strict=True):
        np.testing.assert_allclose(got.reshape(-1), want.reshape(-1), atol=1e-5)


BAD = [
    ({"reference_wav": None, "reference_wav_len": None, "reference_text": None}, "missing input(s) reference_wav"),
    ({"reference_wav_len": None}, "missing input(s) reference_wav_len"),
    ({"reference_wav_len": np.array([[10 ** 6]], np.int32)}, "larger than reference_wav"),
    ({"target_text": np.array([[b""]], object)}, "target_text is empty"),
    ({"target_text": np.array([[b"\xff\xfe hello"]], object)}, "target_text: not valid UTF-8"),
    ({"reference_text": np.array([[b"\xc3("]], object)}, "reference_text: not valid UTF-8"),
]
BAD_IDS = ["no_reference", "no_len", "len_too_large", "empty_target", "target_not_utf8", "reference_not_utf8"]


def _bad(wave, change):
    return {k: v for k, v in {**_request(wave), **change}.items() if v is not None}


@pytest.mark.parametrize("change, words", BAD, ids=BAD_IDS)
def test_bad_input_on_the_stream(streaming, reference, change, words):
    import tritonclient.grpc as grpcclient

    chunks, error, _ = _stream(streaming, "cosyvoice2", _official_inputs(grpcclient, _bad(reference[0], change))[0])
    assert error is not None and not chunks
    assert words in str(error), str(error)


def test_official_client_grpc_streaming(streaming, reference, official_runtime, tmp_path):
    path = reference[1]
    out = run_official_client(official_runtime / "client_grpc.py", "--server-addr", streaming.host,
                              "--server-port", str(streaming.ports["grpc"]), "--reference-audio", str(path),
                              "--reference-text", REFERENCE_TEXT, "--target-text", TARGET_TEXT,
                              "--model-name", "cosyvoice2", "--mode", "streaming", "--log-dir", str(tmp_path),
                              cwd=tmp_path)
    written, sr = sf.read(tmp_path / "test.wav", dtype="float32")
    assert sr == RATE_OUT, out
    import tritonclient.grpc as grpcclient

    own, error, _ = _stream(streaming, "cosyvoice_tts_stream",
                            _plain_inputs(grpcclient, _pipeline_tensors(_as_read(path), stream=True)))
    assert error is None
    _same_as_pcm16(written, np.concatenate([c.reshape(-1) for c in own]))
    assert "Mode: streaming" in out


def _as_read(path: Path) -> np.ndarray:
    return sf.read(path, dtype="float32")[0]  # what the clients read (their own float64, sent as float32)


def _same_as_pcm16(written: np.ndarray, want: np.ndarray):
    """The client's 16-bit file holds our answer: same length, each sample within a 16-bit step."""
    assert written.size == want.size > 0
    np.testing.assert_allclose(written, np.clip(want, -1, 1), atol=2 / 32768)


# ------------------------------------------------------------------------------------------------ offline


def test_grpc_and_http_as_the_clients_equal_the_pipeline(offline, reference):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    wave, _ = reference
    g = grpcclient.InferenceServerClient(offline.grpc_url)
    try:
        inputs, outputs = _official_inputs(grpcclient, _request(wave, pad_to=2 * RATE_IN))  # padded to whole seconds
        res = g.infer("cosyvoice2", inputs, request_id="100000000", outputs=outputs, client_timeout=PATIENCE_S)
        by_grpc = res.as_numpy("waveform")
        own = g.infer("cosyvoice_tts", _plain_inputs(grpcclient, _pipeline_tensors(wave)),
                      client_timeout=PATIENCE_S).as_numpy("waveform")
    finally:
        g.close()
    assert by_grpc.shape[0] == 1
    _assert_speech(by_grpc.reshape(-1))
    np.testing.assert_allclose(by_grpc.reshape(-1), own.reshape(-1), atol=1e-6)
    with httpclient.InferenceServerClient(offline.http_url, network_timeout=PATIENCE_S) as c:
        inputs, outputs = _official_inputs(httpclient, _request(wave))
        by_http = c.infer("cosyvoice2", inputs, request_id="0", outputs=outputs).as_numpy("waveform")
    np.testing.assert_allclose(by_http.reshape(-1), own.reshape(-1), atol=1e-6)


@pytest.mark.parametrize("change, words", BAD, ids=BAD_IDS)
def test_bad_input_offline_http_400_grpc_invalid_argument(offline, reference, change, words):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    tensors = _bad(reference[0], change)
    with httpclient.InferenceServerClient(offline.http_url, network_timeout=PATIENCE_S) as c:
        with pytest.raises(InferenceServerException) as info:
            c.infer("cosyvoice2", _official_inputs(httpclient, tensors)[0])
        assert info.value.status() == "400" and words in info.value.message(), info.value.message()
        assert c.is_model_ready("cosyvoice2")
    g = grpcclient.InferenceServerClient(offline.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            g.infer("cosyvoice2", _official_inputs(grpcclient, tensors)[0], client_timeout=PATIENCE_S)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and words in info.value.message()
    finally:
        g.close()


def test_official_clients_offline(offline, reference, official_runtime, tmp_path):
    import tritonclient.grpc as grpcclient

    path = reference[1]
    g = grpcclient.InferenceServerClient(offline.grpc_url)
    try:
        own = g.infer("cosyvoice_tts", _plain_inputs(grpcclient, _pipeline_tensors(_as_read(path))),
                      client_timeout=PATIENCE_S).as_numpy("waveform").reshape(-1)
    finally:
        g.close()
    out = run_official_client(official_runtime / "client_grpc.py", "--server-addr", offline.host,
                              "--server-port", str(offline.ports["grpc"]), "--reference-audio", str(path),
                              "--reference-text", REFERENCE_TEXT, "--target-text", TARGET_TEXT,
                              "--model-name", "cosyvoice2", "--mode", "offline", "--log-dir", str(tmp_path / "grpc"),
                              cwd=tmp_path)
    written, sr = sf.read(tmp_path / "grpc" / "test.wav", dtype="float32")
    assert sr == RATE_OUT and "Mode: offline" in out
    _same_as_pcm16(written, own)
    run_official_client(official_runtime / "client_http.py", "--server-url", offline.http_url,
                        "--reference-audio", str(path), "--reference-text", REFERENCE_TEXT, "--target-text",
                        TARGET_TEXT, "--model-name", "cosyvoice2", "--output-audio", str(tmp_path / "http.wav"),
                        cwd=tmp_path)
    written, sr = sf.read(tmp_path / "http.wav", dtype="float32")
    assert sr == RATE_OUT
    _same_as_pcm16(written, own)


# ------------------------------------------------------------------------------------------------ warm-up


@pytest.mark.parametrize("mode", ["decoupled", "offline"])
def test_the_warm_up_reaches_cosyvoice2(cosyvoice2, mode):
    from cosyvoice_triton.serving.launch.warmup import loaded_models, plan, warm_up

    server = cosyvoice2.ensure(mode)
    how = dict(plan(loaded_models(server)))["cosyvoice2"]
    assert how == ("official_stream" if mode == "decoupled" else "official")
    done = warm_up(server, timeout=PATIENCE_S)
    assert isinstance(done["cosyvoice2"], float), done["cosyvoice2"]
