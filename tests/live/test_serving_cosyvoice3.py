"""CosyVoice3 served beside CosyVoice2 (tunable ``cosyvoice3_dir``) by a real ``tritonserver``: the local flavor on
the tiny CosyVoice2 demo with the CosyVoice3 demo folder. ``cosyvoice3_tts_stream`` streams over gRPC the chunks of
the library's ``CosyVoice3`` in process; ``cosyvoice3_tts`` (HTTP) answers their concatenation with
``stream=false``; ``cosyvoice3`` takes the official runtime's requests and answers the chunks of
``cosyvoice3_tts_stream``; ``cosyvoice3_vc`` converts as the library does. Bad requests get 400 /
INVALID_ARGUMENT naming what is wrong, and the server keeps answering."""

from __future__ import annotations

import json
import queue
import uuid

import numpy as np
import pytest
import soundfile as sf
from conftest import PATIENCE_S, http_post, served, wait_until

TEXT = "Hello there, this is CosyVoice3 on Triton."
PROMPT_TEXT = "the prompt says hello"
ATOL = 1e-4  # another process, the same threads: float32 sums in another order at most


@pytest.fixture(scope="module")
def cv3_dir(cv3_demo_dir):
    return cv3_demo_dir


@pytest.fixture(scope="module")
def server(serving_assets, cv3_dir, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("cv3repo") / "model_repository"
    report = render_repository("local", repo, model_dir=serving_assets["model_dir"],
                               onnx_dir=serving_assets["onnx_dir"], max_queue_delay_us=5000,
                               cosyvoice3_dir=str(cv3_dir))
    assert {"cosyvoice3_tts_stream", "cosyvoice3_tts", "cosyvoice3_vc", "cosyvoice3", "cosyvoice_vc"} <= set(
        report.models)
    assert report.models["cosyvoice3_tts_live"] == report.models["cosyvoice3_vc_live"] == "python (decoupled)"
    with served(repo) as s:
        yield s


@pytest.fixture(scope="module")
def library(cv3_dir):
    from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service

    return Cv3Service.load(cv3_dir)


@pytest.fixture(scope="module")
def speech(en_speech):
    return en_speech


def _tts(speech, **extra) -> dict:
    p, psr, _, _ = speech
    return {"text": np.array([[TEXT.encode()]], object), "prompt_audio": p[None],
            "prompt_sample_rate": np.array([[psr]], np.int32),
            "prompt_text": np.array([[PROMPT_TEXT.encode()]], object), **extra}


def _inputs(mod, arrays):
    out = []
    for name, arr in arrays.items():
        t = mod.InferInput(name, list(arr.shape), {"object": "BYTES", "float32": "FP32", "int32": "INT32",
                                                   "int64": "INT64", "bool": "BOOL"}[str(arr.dtype)])
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _stream(server, model, arrays):
    """One request on a gRPC stream: (waveform chunks, error, final seen)."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    chunks, error, final = [], None, False
    try:
        client.async_stream_infer(model, _inputs(grpcclient, arrays), request_id=str(uuid.uuid4()),
                                  outputs=[grpcclient.InferRequestedOutput("waveform")],
                                  enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=PATIENCE_S)
            if error is not None:
                break
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = True
                break
            chunks.append(result.as_numpy("waveform").reshape(-1))
    finally:
        client.stop_stream()
        client.close()
    return chunks, error, final


def _http_json(server, model, arrays):
    inputs = []
    for name, arr in arrays.items():
        dtype = {"object": "BYTES", "float32": "FP32", "int32": "INT32", "int64": "INT64", "bool": "BOOL"}[
            str(arr.dtype)]
        data = [v.decode() for v in arr.reshape(-1)] if arr.dtype == object else arr.reshape(-1).tolist()
        inputs.append({"name": name, "shape": list(arr.shape), "datatype": dtype, "data": data})
    status, body = http_post(server.http_url, f"/v2/models/{model}/infer", json.dumps({"inputs": inputs}).encode())
    return status, json.loads(body)


def test_the_stream_is_the_library_stream(server, library, speech):
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream", _tts(speech))
    assert error is None and final
    want = [c["waveform"][0] for c in library.responses(_tts(speech))]
    assert len(chunks) == len(want) >= 2 and [c.size for c in chunks] == [w.size for w in want]
    for got, w in zip(chunks, want, strict=True):
        np.testing.assert_allclose(got, w, atol=ATOL)


def test_a_streams_flow_state_is_on_the_gauge_and_freed_when_cancelled(server, speech):
    """The stream's non-final chunks run from its cached DiT state (models/cosyvoice3/incremental.py): the
    instance's ``cosyvoice_stream_state_bytes`` holds it while the stream runs and drops to 0 when the client
    cancels it mid-stream (and the server streams on for others)."""
    import tritonclient.grpc as grpcclient

    from cosyvoice_triton.loadtest.metrics import counter_total, scrape

    def gauge(name):
        return counter_total(scrape(server.metrics_url, timeout=30), name, model="cosyvoice3_tts_stream")

    long_text = " ".join([TEXT] * 6)
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("cosyvoice3_tts_stream", _inputs(grpcclient, _tts(speech, text=np.array(
            [[long_text.encode()]], object))), request_id=str(uuid.uuid4()),
            outputs=[grpcclient.InferRequestedOutput("waveform")])
        _, error = answers.get(timeout=PATIENCE_S)
        assert error is None
        wait_until(lambda: gauge("cosyvoice_stream_state_bytes") > 0, "the stream holding its flow state",
                   interval=0.05)
        assert gauge("cosyvoice_stream_states") == 1
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    wait_until(lambda: gauge("cosyvoice_stream_states") == 0, "the cancelled stream's state freed", interval=0.2)
    assert gauge("cosyvoice_stream_state_bytes") == 0
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream", _tts(speech))
    assert error is None and final and len(chunks) >= 2


def test_whole_answer_over_http_is_the_unstreamed_library_answer(server, library, speech):
    status, body = _http_json(server, "cosyvoice3_tts", _tts(speech))
    assert status == 200, body
    out = {o["name"]: o for o in body["outputs"]}
    got = np.asarray(out["waveform"]["data"], np.float32)
    want = np.concatenate([c["waveform"][0] for c in library.responses(_tts(speech, stream=np.array([[False]])))])
    assert got.size == want.size and out["sample_rate"]["data"] == [24000]
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_the_official_interface_answers_the_stream_chunks(server, speech):
    """``cosyvoice3`` streams ``cosyvoice3_tts_stream``'s chunks on the official CosyVoice3 Triton runtime's hops
    (tunable ``cosyvoice3_stream_schedule``, default runtime): 15 tokens first, not the official class's 25 + pad."""
    from scipy.signal import resample_poly

    from cosyvoice_triton.streaming import RuntimeSchedule

    p, psr, _, _ = speech
    assert psr == 22050
    ref16 = resample_poly(p, 320, 441).astype(np.float32)
    official = {"reference_wav": ref16[None], "reference_wav_len": np.array([[ref16.size]], np.int32),
                "reference_text": np.array([[PROMPT_TEXT.encode()]], object),
                "target_text": np.array([[TEXT.encode()]], object)}
    chunks, error, final = _stream(server, "cosyvoice3", official)
    assert error is None and final and len(chunks) >= 2
    request = {"text": official["target_text"], "prompt_audio": ref16[None],
               "prompt_sample_rate": np.array([[16000]], np.int32), "prompt_text": official["reference_text"]}
    own, error, final = _stream(server, "cosyvoice3_tts_stream",
                                {**request, "stream_schedule": np.array([[b"runtime"]], object)})
    assert error is None and final
    assert [c.size for c in chunks] == [c.size for c in own]
    for got, want in zip(chunks, own, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    held = 8  # the vocoder's held-back mel frames (finalize=False)
    assert chunks[0].size == (RuntimeSchedule().first_hop * 2 - held) * 480
    default, error, final = _stream(server, "cosyvoice3_tts_stream", request)
    assert error is None and final and default[0].size > chunks[0].size


def test_an_empty_reference_text_is_zero_shot_with_the_system_prompt_as_officially(server, library, speech):
    """The official CosyVoice3 runtime puts its system prompt before a reference_text without ``<|endofprompt|>``,
    an empty one included, and speaks zero-shot: the prompt's speech tokens lead the LM. ``cosyvoice3`` does the
    same (not the cross-lingual answer an absent transcript gets from cosyvoice3_tts_stream)."""
    from scipy.signal import resample_poly

    from cosyvoice_triton.frontend.text.cosyvoice3 import zero_shot_prompt_text

    p, _, _, _ = speech
    ref16 = resample_poly(p, 320, 441).astype(np.float32)
    official = {"reference_wav": ref16[None], "reference_wav_len": np.array([[ref16.size]], np.int32),
                "reference_text": np.array([[b""]], object), "target_text": np.array([[TEXT.encode()]], object)}
    chunks, error, final = _stream(server, "cosyvoice3", official)
    assert error is None and final and chunks
    prompt = {"text": official["target_text"], "prompt_audio": ref16[None],
              "prompt_sample_rate": np.array([[16000]], np.int32)}
    system_only = np.array([[zero_shot_prompt_text("").encode()]], object)
    want = [c["waveform"][0] for c in library.responses({**prompt, "prompt_text": system_only})]
    assert [c.size for c in chunks] == [w.size for w in want]
    for got, w in zip(chunks, want, strict=True):
        np.testing.assert_allclose(got, w, atol=ATOL)
    cross = np.concatenate([c["waveform"][0] for c in library.responses(prompt)])
    assert cross.size != sum(w.size for w in want) or not np.allclose(cross, np.concatenate(want), atol=ATOL)


def test_the_official_grpc_client_runs_unchanged_on_cosyvoice3(server, speech, official_runtime, tmp_path):
    """``client_grpc.py --model-name cosyvoice3 --mode streaming``, as the official run_cosyvoice3.sh benchmarks it
    (here with one reference and one text instead of its dataset): the WAV it writes is cosyvoice3_tts_stream's
    answer to the same request on the official runtime's hops, within 16-bit rounding."""
    from conftest import run_official_client
    from scipy.signal import resample_poly

    p, _, _, _ = speech
    ref16 = resample_poly(p, 320, 441).astype(np.float32)
    path = tmp_path / "reference_16k.wav"
    sf.write(path, ref16, 16000, subtype="FLOAT")
    out = run_official_client(official_runtime / "client_grpc.py", "--server-addr", server.host, "--server-port",
                              str(server.ports["grpc"]), "--reference-audio", str(path), "--reference-text",
                              PROMPT_TEXT, "--target-text", TEXT, "--model-name", "cosyvoice3", "--mode", "streaming",
                              "--log-dir", str(tmp_path), cwd=tmp_path)
    written, sr = sf.read(tmp_path / "test.wav", dtype="float32")
    assert sr == 24000 and "Mode: streaming" in out
    sent = sf.read(path, dtype="float32")[0]  # what the client read and sent
    own, error, final = _stream(server, "cosyvoice3_tts_stream", {
        "text": np.array([[TEXT.encode()]], object), "prompt_audio": sent[None],
        "prompt_sample_rate": np.array([[16000]], np.int32), "prompt_text": np.array([[PROMPT_TEXT.encode()]], object),
        "stream_schedule": np.array([[b"runtime"]], object)})
    assert error is None and final
    want = np.clip(np.concatenate(own), -1, 1)
    assert written.size == want.size > 0
    np.testing.assert_allclose(written, want, atol=2 / 32768)


def test_conversion_is_the_library_conversion(server, library, speech):
    p, psr, s, ssr = speech
    arrays = {"source_audio": s[None], "source_sample_rate": np.array([[ssr]], np.int32),
              "prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32)}
    status, body = _http_json(server, "cosyvoice3_vc", arrays)
    assert status == 200, body
    got = np.asarray({o["name"]: o for o in body["outputs"]}["waveform"]["data"], np.float32)
    want = library.convert(arrays)["waveform"][0]
    assert got.size == want.size
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_bad_requests_name_what_is_wrong_and_the_server_stays(server, speech):
    status, body = _http_json(server, "cosyvoice3_vc", {
        "source_audio": speech[2][None], "source_sample_rate": np.array([[speech[3]]], np.int32),
        "prompt_audio": speech[0][None], "prompt_sample_rate": np.array([[speech[1]]], np.int32),
        "seed": np.array([[3]], np.int64)})
    assert status == 400 and "seed" in body["error"], body
    status, body = _http_json(server, "cosyvoice3_tts", _tts(speech, mode=np.array([[b"sft"]], object)))
    assert status == 400 and "mode must be one of" in body["error"], body
    status, body = _http_json(server, "cosyvoice3_tts", _tts(speech, text=np.array([[b"word " * 401]], object)))
    assert status == 400 and "more than the maximum 2000" in body["error"], body  # tunable max_text_chars
    status, body = _http_json(server, "cosyvoice3_vc", {
        "source_audio": speech[2][None], "source_sample_rate": np.array([[0]], np.int32),
        "prompt_audio": speech[0][None], "prompt_sample_rate": np.array([[speech[1]]], np.int32)})
    assert status == 400 and "source_sample_rate" in body["error"], body
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream",
                                   _tts(speech, speaker_id=np.array([[b"alice"]], object)))
    assert error is not None and not chunks
    assert "give prompt audio or a speaker_id, not both" in str(error), str(error)
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream", {
        "text": np.array([[TEXT.encode()]], object), "speaker_id": np.array([[b"nobody-here"]], object)})
    assert error is not None and not chunks and str(error).startswith("unknown speaker 'nobody-here'"), str(error)
    status, body = _http_json(server, "cosyvoice3_tts", {"text": np.array([[TEXT.encode()]], object),
                                                         "speaker_id": np.array([[b"nobody-here"]], object)})
    assert status == 400 and "unknown speaker 'nobody-here'" in body["error"], body
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream", _tts(speech))
    assert error is None and final and chunks


def test_the_gateway_speaks_cosyvoice3_by_model_name(server, speech, tmp_path):
    import base64
    import io

    from conftest import gateway_process

    p, psr, _, _ = speech
    buf = io.BytesIO()
    sf.write(buf, p, psr, format="WAV", subtype="FLOAT")
    body = {"model": "cosyvoice3", "input": TEXT, "reference_audio": base64.b64encode(buf.getvalue()).decode(),
            "reference_text": PROMPT_TEXT, "response_format": "wav"}
    status, direct = _http_json(server, "cosyvoice3_tts", _tts(speech))
    assert status == 200, direct
    want = np.asarray({o["name"]: o for o in direct["outputs"]}["waveform"]["data"], np.float32)
    with gateway_process(server, tmp_path / "gateway.log", "--models", "cosyvoice2,cosyvoice3,tts-1") as urls:
        status, wav = http_post(urls.http, "/v1/audio/speech", json.dumps(body).encode(),
                                {"Content-Type": "application/json"})
        assert status == 200, wav[:500]
        got, rate = sf.read(io.BytesIO(wav), dtype="float32")
        assert rate == 24000 and got.size == want.size
        np.testing.assert_allclose(got, np.clip(want, -1, 1), atol=2 / 32768)
        status, text = http_post(urls.http, "/v1/audio/speech", json.dumps(
            {"model": "cosyvoice3", "input": TEXT, "voice": "alloy"}).encode(), {"Content-Type": "application/json"})
        assert status == 400 and b"alloy" in text, text  # no such voice registered
    with gateway_process(server, tmp_path / "gateway2.log") as urls:  # not named in --models: refused at the door
        status, text = http_post(urls.http, "/v1/audio/speech", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
        assert status == 400 and b"cosyvoice3" in text and b"not served here" in text, text


def test_registered_speakers_speak_cosyvoice3(server, library, cv3_dir, speech, tmp_path):
    """A speaker registered with ``cosyvoice3_speakers`` speaks through ``speaker_id`` on ``cosyvoice3_tts_stream``
    the library's answer with the prompt the same front end computes in process (zero-shot with its transcript)."""
    from cosyvoice_triton.clients.client import VCClient
    from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
    from cosyvoice_triton.serving.stages.speakers import build_service

    p, psr, _, _ = speech
    with VCClient(server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
        served = c.register_speaker("carol", p, prompt_sr=psr, prompt_text=PROMPT_TEXT, family="cosyvoice3")
        assert "carol" in c.list_speakers(family="cosyvoice3") and "carol" not in c.list_speakers()
        assert served.family == "cosyvoice3" and served.prompt_text.endswith("<|endofprompt|>" + PROMPT_TEXT)
    local = build_service({"model_dir": str(cv3_dir), "family": "cosyvoice3", "capacity": 10, "min_seconds": 0.1,
                           "max_seconds": 30.0, "prompt_cache_entries": 0, "prompt_cache_mb": 0.0,
                           "speaker_dir": str(tmp_path / "speakers")}, graph_fn=None)
    local.store.put("carol", local.prompt(p[None], np.array([[psr]], np.int32), None, PROMPT_TEXT))
    want = [c["waveform"][0] for c in Cv3Service(library.model, speakers=local.get).responses(
        {"text": np.array([[TEXT.encode()]], object), "speaker_id": np.array([[b"carol"]], object)})]
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream", {
        "text": np.array([[TEXT.encode()]], object), "speaker_id": np.array([[b"carol"]], object)})
    assert error is None and final, error
    assert [c.size for c in chunks] == [w.size for w in want] and len(want) >= 2
    for got, w in zip(chunks, want, strict=True):
        np.testing.assert_allclose(got, w, atol=ATOL)
    with VCClient(server.http_url, protocol="http", timeout=PATIENCE_S) as c:
        assert c.get_speaker("carol", family="cosyvoice3").prompt_text == served.prompt_text
        c.delete_speaker("carol", family="cosyvoice3")
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream", {
        "text": np.array([[TEXT.encode()]], object), "speaker_id": np.array([[b"carol"]], object)})
    assert error is not None and "carol" in str(error) and not chunks


def test_the_gateways_voices_speak_both_families_per_tenant(server, speech, tmp_path):
    """A voice registered at the gateway is registered with both families' speakers models: ``model="cosyvoice3"``
    speaks it (CosyVoice3's prompt, the tenant's id), ``cosyvoice2`` too; another tenant cannot; deleting it
    removes it from both."""
    import io

    import requests
    from conftest import gateway_process

    from cosyvoice_triton.gateway.tenants import Namespace

    p, psr, _, _ = speech
    buf = io.BytesIO()
    sf.write(buf, p, psr, format="WAV", subtype="FLOAT")
    keys = {"acme": "key-acme-cv3", "other": "key-other-cv3"}
    with gateway_process(server, tmp_path / "gateway.log", "--models", "cosyvoice2,cosyvoice3",
                         tenants=keys) as urls:
        base = f"http://{urls.http}"

        def auth(tenant):
            return {"authorization": f"Bearer {keys[tenant]}"}

        def speak(tenant, model):
            return requests.post(f"{base}/v1/audio/speech", headers=auth(tenant), timeout=PATIENCE_S, json={
                "model": model, "input": TEXT, "voice": "dana", "response_format": "wav"})

        r = requests.post(f"{base}/v1/audio/voices", headers=auth("acme"), timeout=PATIENCE_S,
                       data={"id": "dana", "text": PROMPT_TEXT}, files={"audio": ("dana.wav", buf.getvalue())})
        assert r.status_code == 201, r.text
        r3 = speak("acme", "cosyvoice3")
        assert r3.status_code == 200, r3.text[:500]
        got, rate = sf.read(io.BytesIO(r3.content), dtype="float32")
        status, direct = _http_json(server, "cosyvoice3_tts", {
            "text": np.array([[TEXT.encode()]], object),
            "speaker_id": np.array([[Namespace("acme").scoped("dana").encode()]], object)})
        assert status == 200, direct
        want = np.asarray({o["name"]: o for o in direct["outputs"]}["waveform"]["data"], np.float32)
        assert rate == 24000 and got.size == want.size
        np.testing.assert_allclose(got, np.clip(want, -1, 1), atol=2 / 32768)
        assert speak("acme", "cosyvoice2").status_code == 200
        refused = speak("other", "cosyvoice3")
        assert refused.status_code == 400 and "dana" in refused.text, refused.text
        deleted = requests.delete(f"{base}/v1/audio/voices/dana", headers=auth("acme"), timeout=PATIENCE_S)
        assert deleted.status_code == 200, deleted.text
        gone = speak("acme", "cosyvoice3")
        assert gone.status_code == 400 and "dana" in gone.text, gone.text
        assert speak("acme", "cosyvoice2").status_code == 400


def test_cosyvoice3_has_the_official_configs_tensors(serving_assets, cv3_dir, tmp_path):
    """``cosyvoice3``'s tensors are those of the official runtime's ``model_repo_cosyvoice3/cosyvoice3`` (ace7c47)."""
    import re
    import subprocess

    from conftest import official_git
    from google.protobuf import text_format
    from google.protobuf.json_format import MessageToDict

    from cosyvoice_triton.serving.repository import render_repository

    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    shown = subprocess.run(["git", "-C", str(official_git()), "show",
                            "ace7c47:runtime/triton_trtllm/model_repo_cosyvoice3/cosyvoice3/config.pbtxt"],
                           capture_output=True, text=True, check=False)
    if shown.returncode != 0:
        pytest.skip(f"the official git folder has no ace7c47 with model_repo_cosyvoice3: {shown.stderr[:200]}")
    text = re.sub(r"\$\{(\w+)\}", lambda m: {"triton_max_batch_size": "16", "max_queue_delay_microseconds": "0",
                                             "decoupled_mode": "true", "bls_instance_num": "1"}.get(m.group(1), "x"),
                  shown.stdout)
    official = MessageToDict(text_format.Parse(text, pb2.ModelConfig()), preserving_proto_field_name=True)
    render_repository("local", tmp_path / "repo", model_dir=serving_assets["model_dir"],
                      onnx_dir=serving_assets["onnx_dir"], cosyvoice3_dir=str(cv3_dir))
    ours = MessageToDict(text_format.Parse((tmp_path / "repo" / "cosyvoice3" / "config.pbtxt").read_text(),
                                           pb2.ModelConfig()), preserving_proto_field_name=True)

    def tensors(cfg, kind):
        return {t["name"]: (t["data_type"], t["dims"], bool(t.get("optional"))) for t in cfg[kind]}

    assert ours["name"] == official["name"] == "cosyvoice3"
    assert tensors(ours, "input") == tensors(official, "input")
    assert tensors(ours, "output") == tensors(official, "output")
    assert ours["model_transaction_policy"] == {"decoupled": True}


def test_the_flow_precision_tunable_reaches_both_models(serving_assets, cv3_dir, tmp_path):
    """``cosyvoice3_flow_precision`` is rendered into the parameters of both models that load the flow; the
    speakers model has no flow."""
    import re

    from cosyvoice_triton.serving.repository import render_repository

    for value in ("int8", "fp32"):
        repo = tmp_path / value
        render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                          cosyvoice3_dir=str(cv3_dir), cosyvoice3_flow_precision=value)
        for model in ("cosyvoice3_vc", "cosyvoice3_tts_stream", "cosyvoice3_tts_live", "cosyvoice3_vc_live"):
            text = (repo / model / "config.pbtxt").read_text()
            found = re.search(r'key: "flow_precision"\s*value: \{\s*string_value: "(\w+)"', text)
            assert found and found.group(1) == value, (model, text[:2000])
        assert "flow_precision" not in (repo / "cosyvoice3_speakers" / "config.pbtxt").read_text()


# ------------------------------------------------------------------------------------------------- live TTS
LIVE_PIECES = ["Hello there, ", "this is ", "CosyVoice3 ", "speaking ", "a text ", "that arrives ", "in pieces."]


def test_live_text_is_spoken_as_it_arrives_and_equals_the_library(server, library, speech):
    """``cosyvoice3_tts_live`` over a gRPC stream (sequence batcher, one piece per request): the chunks are
    ``Cv3Service.live``'s in process with the same pieces and seed (tests/unit/test_cv3_live.py: they start before
    the text ends), each on the newest piece's sender."""
    import time

    from test_serving_live import Stream
    from test_serving_tts_live import _chunks, _collect, _text

    from cosyvoice_triton.frontend.text.live import LiveText

    p, psr, _, _ = speech
    first = {"prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32),
             "prompt_text": np.array([[PROMPT_TEXT.encode()]], object), "seed": np.array([[5]], np.int64)}
    s = Stream(server, 301, model="cosyvoice3_tts_live")
    try:
        for k, piece in enumerate(LIVE_PIECES):
            s.send({**(first if k == 0 else {}), **_text(piece)}, start=k == 0)
            time.sleep(0.2)  # paced like a writer
        s.send(_text(b""), end=True)
        outs, errors, _ = _collect(s, [], len(LIVE_PIECES) + 1)
    finally:
        s.close()
    assert not errors, errors
    chunks = _chunks(outs)
    assert [c[0] for c in chunks] == list(range(len(chunks))) and chunks
    feed = LiveText([piece.encode() for piece in LIVE_PIECES])
    feed.end()
    want = list(library.live(first, feed))
    assert len(chunks) == len(want)
    for (_, _, o), w in zip(chunks, want, strict=True):
        np.testing.assert_allclose(o["waveform"][0], w["waveform"][0], atol=ATOL)
    for _, rid, o in chunks:  # each chunk on the sender of the newest piece when it was computed
        assert int(o["text_pieces"].ravel()[0]) == int(rid[1:]) + 1, rid


def test_live_bad_first_piece_is_invalid_argument(server, speech):
    from test_serving_live import Stream
    from test_serving_tts_live import _collect, _text

    p, psr, _, _ = speech
    s = Stream(server, 302, model="cosyvoice3_tts_live")
    try:
        s.send({"prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32),
                "mode": np.array([[b"sft"]], object), **_text("Hello.")}, start=True)
        s.send(_text(b""), end=True)
        _, errors, _ = _collect(s, [], 2)
    finally:
        s.close()
    assert any(e.startswith("INVALID_ARGUMENT: ") and "mode must be one of" in e for e in errors), errors
    chunks, error, final = _stream(server, "cosyvoice3_tts_stream", _tts(speech))  # the server still answers
    assert error is None and final and chunks


def test_live_sessions_through_the_gateway_are_the_tenants_own(server, library, speech, tmp_path):
    """``cosyvoice3_tts_live`` at the gateway's gRPC entry point with two tenants' keys: tenant A's piece without a
    start on tenant B's open sequence id is refused as an unknown id, B's session goes on and answers what it
    answers alone; A then opens its own session on the same id and gets its own audio."""
    from conftest import gateway_process, wait_until
    from test_gateway_sessions_live import Tenant

    from cosyvoice_triton.frontend.text.live import LiveText

    model, sid = "cosyvoice3_tts_live", 77
    p, psr, _, _ = speech
    pieces = ["Hello there, ", "this is ", "a live session."]

    def first(seed):
        return {"prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32),
                "seed": np.array([[seed]], np.int64)}

    def text(piece):
        return {"text": np.array([[piece.encode()]], object)}

    def alone(seed):
        feed = LiveText([piece.encode() for piece in pieces])
        feed.end()
        return np.concatenate([r["waveform"][0] for r in library.live(first(seed), feed)])

    with gateway_process(server, tmp_path / "gateway.log", tenants={"a": "sk-cv3-a", "b": "sk-cv3-b"}) as urls:
        a, b = Tenant(urls, "sk-cv3-a"), Tenant(urls, "sk-cv3-b")
        try:
            b.send(model, {**first(1), **text(pieces[0])}, sid, start=True)
            a.send(model, text("not yours"), sid)
            wait_until(lambda: a.pump() >= 1, "A's piece answered")
            assert a.errors and "START" in a.errors[0] and not a.audio, a.errors
            for piece in pieces[1:]:
                b.send(model, text(piece), sid)
            b.send(model, text(""), sid, end=True)
            b.wait_answered("B's session")
            assert not b.errors, b.errors
            np.testing.assert_allclose(b.waveform(), alone(1), atol=ATOL)
            a.errors.clear()
            a.sent = len(a.finals)
            for k, piece in enumerate(pieces):
                a.send(model, {**(first(2) if k == 0 else {}), **text(piece)}, sid, start=k == 0)
            a.send(model, text(""), sid, end=True)
            a.wait_answered("A's session")
            assert not a.errors, a.errors
            np.testing.assert_allclose(a.waveform(), alone(2), atol=ATOL)
        finally:
            a.close()
            b.close()


def test_live_speech_over_the_gateways_websocket_with_model_cosyvoice3(server, speech, tmp_path):
    """``/v1/audio/speech/live`` with ``model: cosyvoice3`` (in the gateway's ``--models``): the session runs on
    ``cosyvoice3_tts_live`` and its audio equals a direct gRPC live session's (the Python client with
    ``model="cosyvoice3_tts_live"``); without ``model`` the same start speaks CosyVoice2."""
    import base64
    import io

    ws_client = pytest.importorskip("websockets.sync.client")
    from conftest import gateway_process

    from cosyvoice_triton.clients.live import LiveClient

    p, psr, _, _ = speech
    buf = io.BytesIO()
    sf.write(buf, p, psr, format="WAV", subtype="FLOAT")
    prompt = buf.getvalue()
    texts = ["Hello there, ", "this is ", "CosyVoice3 live."]
    start = {"type": "session.start", "reference_audio": base64.b64encode(prompt).decode(),
             "reference_text": PROMPT_TEXT, "seed": 9, "output_format": "f32le"}

    def over_socket(urls, **extra):
        with ws_client.connect(f"ws://{urls.http}/v1/audio/speech/live", proxy=None, max_size=None,
                               open_timeout=PATIENCE_S) as ws:
            ws.send(json.dumps({**start, **extra}))
            started = json.loads(ws.recv(timeout=PATIENCE_S))
            for t in texts:
                ws.send(json.dumps({"type": "input.text", "text": t}))
            ws.send(json.dumps({"type": "input.end"}))
            frames, events = [], []
            for message in ws:  # until the server closes
                (frames if isinstance(message, bytes) else events).append(message)
        assert json.loads(events[-1])["type"] == "speech.audio.done", events[-2:]
        return started["session"]["model"], np.frombuffer(b"".join(frames), "<f4")

    with LiveClient(server.grpc_url, timeout=PATIENCE_S) as c:
        chunks = c.tts_live(texts, prompt=prompt, encoded=True, seed=9, prompt_text=PROMPT_TEXT,
                            model="cosyvoice3_tts_live")
        want = np.concatenate([ch.waveform for ch in chunks])
    with gateway_process(server, tmp_path / "gateway.log", "--models", "cosyvoice2,cosyvoice3") as urls:
        model, got = over_socket(urls, model="cosyvoice3")
        assert model == "cosyvoice3_tts_live" and got.size == want.size
        np.testing.assert_allclose(got, want, atol=ATOL)
        model, cv2 = over_socket(urls)
        assert model == "cosyvoice_tts_live" and cv2.size


# ------------------------------------------------------------------------------------------------- live VC
def _vc_first(speech) -> dict:
    p, psr, _, ssr = speech
    return {"source_sample_rate": np.array([[ssr]], np.int32), "prompt_audio": p[None],
            "prompt_sample_rate": np.array([[psr]], np.int32)}


def _vc_pieces(speech, seconds: float = 0.2) -> list[np.ndarray]:
    _, _, src, ssr = speech
    n = int(seconds * ssr)
    return [src[i: i + n] for i in range(0, len(src), n)]


def _live_gauge(server, model: str) -> float:
    import urllib.request

    from cosyvoice_triton.loadtest.metrics import parse_prometheus

    with urllib.request.urlopen(server.metrics_url, timeout=30) as r:
        series = parse_prometheus(r.read().decode())
    return sum(x.value for x in series if x.name == "cosyvoice_live_sessions" and x.labels.get("model") == model)


def test_live_voice_conversion_equals_the_library(server, library, speech):
    """``cosyvoice3_vc_live`` over a gRPC stream (sequence batcher, one piece of source audio per request, paced in
    real time): converted while the source still arrives, each chunk on the sender of the piece that completed it,
    the chunks equal to ``Cv3LiveVC`` in process for the same pieces; the session is freed at its end."""
    from test_serving_live import Stream, send_paced

    from cosyvoice_triton.serving.stages.cosyvoice3_live_vc import Cv3LiveVC
    from cosyvoice_triton.serving.stages.live_vc import convert_pieces

    pieces = _vc_pieces(speech)
    s = Stream(server, 311, model="cosyvoice3_vc_live")
    try:
        outs, errors, first_at, last_sent = send_paced(s, _vc_first(speech), pieces)
    finally:
        s.close()
    assert not errors, errors
    chunks = sorted((int(o["chunk_index"].ravel()[0]), rid, o) for rid, os in outs.items() for o in os)
    assert [c[0] for c in chunks] == list(range(len(chunks))) and len(chunks) >= 4
    assert first_at < last_sent
    ssr = speech[3]
    for _, rid, o in chunks:
        k = int(rid[1:])
        assert float(o["source_seconds"].ravel()[0]) == pytest.approx(sum(map(len, pieces[: k + 1])) / ssr, abs=1e-3)
    want = convert_pieces(Cv3LiveVC(library), _vc_first(speech), pieces)
    assert len(chunks) == len(want)
    for (_, _, o), w in zip(chunks, want, strict=True):
        assert int(o["sample_rate"].ravel()[0]) == 24000
        np.testing.assert_allclose(o["waveform"][0], w, atol=ATOL)
    from conftest import wait_until

    wait_until(lambda: _live_gauge(server, "cosyvoice3_vc_live") == 0, "the ended session freed")


def test_live_voice_conversion_refuses_a_seed_and_a_bad_piece_alone(server, speech):
    from test_serving_live import Stream

    pieces = _vc_pieces(speech, 1.0)
    s = Stream(server, 312, model="cosyvoice3_vc_live")
    try:
        s.send({**_vc_first(speech), "seed": np.array([[1]], np.int64), "source_audio": pieces[0][None]}, start=True,
               end=True)
        _, errors, _ = s.collect(1)
        assert any("INVALID_ARGUMENT: seed" in e for e in errors), errors
        s.send({**_vc_first(speech), "source_audio": pieces[0][None]}, start=True, sequence_id=313)
        s.send({"source_audio": np.zeros((1, 0), np.float32)}, sequence_id=313)
        s.send({"source_audio": pieces[1][None]}, sequence_id=313, end=True)
        outs, errors, _ = s.collect(3)
    finally:
        s.close()
    assert any("INVALID_ARGUMENT: " in e and "empty piece" in e for e in errors), errors
    got = sum(o["waveform"].shape[1] for os in outs.values() for o in os)
    assert got == (len(pieces[0]) + len(pieces[1])) * 24000 // speech[3]


def test_live_voice_conversion_over_the_gateways_websocket_with_model_cosyvoice3(server, speech, tmp_path):
    """``/v1/audio/voice-conversion/live`` with ``model: cosyvoice3``: the session runs on ``cosyvoice3_vc_live``
    and its audio equals a direct gRPC live session's (the Python client with ``model="cosyvoice3_vc_live"``)."""
    import base64
    import io

    ws_client = pytest.importorskip("websockets.sync.client")
    from conftest import gateway_process

    from cosyvoice_triton.clients.live import LiveClient

    p, psr, _, ssr = speech
    buf = io.BytesIO()
    sf.write(buf, p, psr, format="WAV", subtype="FLOAT")
    prompt = buf.getvalue()
    pieces = _vc_pieces(speech)
    start = {"type": "session.start", "reference_audio": base64.b64encode(prompt).decode(), "sample_rate": ssr,
             "sample_format": "f32le", "output_format": "f32le", "model": "cosyvoice3"}
    with LiveClient(server.grpc_url, timeout=PATIENCE_S) as c:
        chunks = c.convert_live(pieces, prompt=prompt, encoded=True, sample_rate=ssr, model="cosyvoice3_vc_live")
        want = np.concatenate([ch.waveform for ch in chunks])
    with gateway_process(server, tmp_path / "gateway.log", "--models", "cosyvoice2,cosyvoice3") as urls, \
            ws_client.connect(f"ws://{urls.http}/v1/audio/voice-conversion/live", proxy=None, max_size=None,
                              open_timeout=PATIENCE_S) as ws:
        ws.send(json.dumps(start))
        started = json.loads(ws.recv(timeout=PATIENCE_S))
        for piece in pieces:
            ws.send(piece.astype("<f4").tobytes())
        ws.send(json.dumps({"type": "input.end"}))
        frames, events = [], []
        for message in ws:
            (frames if isinstance(message, bytes) else events).append(message)
    assert started["session"]["model"] == "cosyvoice3_vc_live", started
    assert json.loads(events[-1])["type"] == "speech.audio.done", events[-2:]
    got = np.frombuffer(b"".join(frames), "<f4")
    assert got.size == want.size == len(speech[2]) * 24000 // ssr
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_the_command_line_client_registers_and_speaks_cosyvoice3(server, library, speech, tmp_path):
    """``cosyvoice-triton client speaker add ... --family cosyvoice3`` registers with ``cosyvoice3_speakers`` (not
    CosyVoice2's ``speakers``), ``tts --family cosyvoice3 --speaker`` speaks through ``cosyvoice3_tts_stream``: the
    file holds the library's answer for that speaker, 16-bit."""
    import subprocess
    import sys

    p, psr, _, _ = speech
    prompt = tmp_path / "prompt.wav"
    sf.write(prompt, p, psr, subtype="FLOAT")
    cli = [sys.executable, "-m", "cosyvoice_triton", "client"]

    def run(*args):
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=PATIENCE_S)

    url = ["--url", server.http_url]
    proc = run("speaker", *url, "add", "cli3", "--prompt", str(prompt), "--prompt-text", PROMPT_TEXT,
               "--family", "cosyvoice3")
    assert proc.returncode == 0 and "registered 'cli3'" in proc.stdout, proc.stderr
    try:
        assert "cli3" in run("speaker", *url, "list", "--family", "cosyvoice3").stdout.split()
        assert "cli3" not in run("speaker", *url, "list").stdout.split()
        out = tmp_path / "cli3.wav"
        proc = run("tts", "--url", server.grpc_url, "--text", TEXT, "--speaker", "cli3", "--family", "cosyvoice3",
                   "--stream", "--seed", "4", "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        got, rate = sf.read(out, dtype="float32")
        speaker = library.model.prompt(p, prompt_sr=psr, prompt_text=with_system_prompt3(PROMPT_TEXT))
        want = np.concatenate(list(library.model.tts_stream("zero_shot", TEXT, speaker=speaker, seed=4)))
        assert rate == 24000 and got.size == want.size
        np.testing.assert_allclose(got, np.clip(want, -1, 1), atol=2 / 32768)
    finally:
        assert run("speaker", *url, "delete", "cli3", "--family", "cosyvoice3").returncode == 0


def test_the_command_line_client_converts_live_with_cosyvoice3(server, library, speech, tmp_path):
    """``cosyvoice-triton client vc --live FILE --family cosyvoice3`` runs a ``cosyvoice3_vc_live`` session: the file
    holds ``Cv3LiveVC``'s answer for the same 200 ms pieces, 16-bit."""
    import subprocess
    import sys

    from cosyvoice_triton.serving.stages.cosyvoice3_live_vc import Cv3LiveVC
    from cosyvoice_triton.serving.stages.live_vc import convert_pieces

    p, psr, src, ssr = speech
    prompt, source, out = tmp_path / "prompt.wav", tmp_path / "source.wav", tmp_path / "live3.wav"
    sf.write(prompt, p, psr, subtype="FLOAT")
    sf.write(source, src, ssr, subtype="FLOAT")
    proc = subprocess.run([sys.executable, "-m", "cosyvoice_triton", "client", "vc", "--url", server.grpc_url,
                           "--live", str(source), "--no-pace", "--prompt", str(prompt), "--family", "cosyvoice3",
                           "-o", str(out)], capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stderr
    got, rate = sf.read(out, dtype="float32")
    first = {"source_sample_rate": np.array([[ssr]], np.int32), "prompt_audio_bytes":
             np.array([[prompt.read_bytes()]], object)}
    want = np.concatenate(convert_pieces(Cv3LiveVC(library), first, _vc_pieces(speech)))
    assert rate == 24000 and got.size == want.size
    np.testing.assert_allclose(got, np.clip(want, -1, 1), atol=2 / 32768)


def with_system_prompt3(transcript: str) -> str:
    from cosyvoice_triton.frontend.text.cosyvoice3 import zero_shot_prompt_text

    return zero_shot_prompt_text(transcript)


def test_the_warm_up_reaches_both_families_speakers(server):
    """The warm-up lists each speakers model's own store: ``cosyvoice3_speakers`` is called, not ``speakers`` twice
    (Triton's inference count of each goes up by one); every pipeline warms without an error."""
    from cosyvoice_triton.serving.launch.warmup import loaded_models, plan, warm_up

    def count(model):
        status, body = _get(server, f"/v2/models/{model}/stats")
        assert status == 200, body
        return json.loads(body)["model_stats"][0]["inference_stats"]["success"]["count"]

    todo = dict(plan(loaded_models(server)))
    assert todo["speakers"] == todo["cosyvoice3_speakers"] == "speakers"
    assert "cosyvoice3_tts_live" not in todo and "cosyvoice3_vc_live" not in todo  # live: sequences only
    before = {m: count(m) for m in ("speakers", "cosyvoice3_speakers")}
    done = warm_up(server, timeout=PATIENCE_S)
    assert isinstance(done["cosyvoice3_speakers"], float), done["cosyvoice3_speakers"]
    assert {m: count(m) - before[m] for m in before} == {"speakers": 1, "cosyvoice3_speakers": 1}
    # every pipeline warmed without an error: cosyvoice3_vc takes no seed (it was sent one and refused it)
    assert not {m: r for m, r in done.items() if not isinstance(r, float)}, done


def _get(server, path):
    import urllib.error
    import urllib.request

    from cosyvoice_triton.serving.launch.server import admin_headers

    request = urllib.request.Request(f"http://{server.http_url}{path}", headers=admin_headers())
    try:
        with urllib.request.urlopen(request, timeout=PATIENCE_S) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
