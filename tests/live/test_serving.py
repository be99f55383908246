"""The served ``cosyvoice_vc`` ensemble against a real ``tritonserver`` (local flavor, tiny demo model).

One server per session (``triton_server`` in conftest.py); skipped with the reason when ``nvidia-pytriton`` or
``tritonclient`` is not installed. Covers HTTP and gRPC, parity with the in-process pipeline, batching evidence
from Triton's statistics, invalid requests (HTTP 400 / gRPC INVALID_ARGUMENT with a message naming the
problem, server still ready) and hostile-but-valid audio.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, rel_err

from cosyvoice_triton.clients.client import AsyncVCClient, VCClient, VCError, build_inputs

SOURCE_SECONDS, PROMPT_SECONDS = 2.0, 1.5


@pytest.fixture(scope="module")
def speech():
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: int(SOURCE_SECONDS * ssr)], ssr, prm[: int(PROMPT_SECONDS * psr)], psr


@pytest.fixture(scope="module", params=["http", "grpc"])
def client(request, triton_server):
    url = triton_server.http_url if request.param == "http" else triton_server.grpc_url
    with VCClient(url, protocol=request.param, timeout=PATIENCE_S) as c:
        yield c


@pytest.fixture(scope="module")
def http(triton_server):
    with VCClient(triton_server.http_url, timeout=PATIENCE_S) as c:
        yield c


@pytest.fixture(scope="module")
def served(http, speech):
    src, ssr, prm, psr = speech
    return http.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=3)


def test_happy_path(client, speech, served):
    src, ssr, prm, psr = speech
    out = client.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=3)
    assert out.sample_rate == 24000
    assert out.waveform.dtype == np.float32 and np.isfinite(out.waveform).all()
    assert abs(out.seconds - SOURCE_SECONDS) < 0.1
    np.testing.assert_array_equal(out.waveform, served.waveform)  # HTTP and gRPC: the same answer


def test_files_and_bytes_inputs(client, tmp_path):
    a = client.convert(FIXTURES / "source_en_5s.wav", FIXTURES / "prompt_en_3s.wav")
    b = client.convert((FIXTURES / "source_en_5s.wav").read_bytes(), (FIXTURES / "prompt_en_3s.wav").read_bytes())
    np.testing.assert_array_equal(a.waveform, b.waveform)
    # the files sent as they are (*_audio_bytes), decoded by the server: the same answer
    c = client.convert(FIXTURES / "source_en_5s.wav", FIXTURES / "prompt_en_3s.wav", encoded=True)
    np.testing.assert_array_equal(a.waveform, c.waveform)
    path = a.write(tmp_path / "out.wav")
    y, sr = sf.read(path)
    assert sr == 24000 and len(y) == len(a.waveform)


def test_parity_with_in_process_pipeline(served, speech, serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2
    from cosyvoice_triton.serving.stages.local import LocalPipeline

    src, ssr, prm, psr = speech
    local = LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")
    np.testing.assert_array_equal(served.waveform, local.convert(src, ssr, prm, psr, seed=3))
    ref = CosyVoice2.from_pretrained(serving_assets["model_dir"]).convert(src, prm, source_sr=ssr, prompt_sr=psr,
                                                                          seed=3)
    assert served.waveform.shape == ref.shape
    assert rel_err(served.waveform, ref) < 1e-3  # the fp32 bar of the whole token-to-wav path


def test_seed_input_and_parameter(http, speech, served):
    src, ssr, prm, psr = speech
    by_param = http.convert(src, prm, source_sr=ssr, prompt_sr=psr, parameters={"seed": 3})
    np.testing.assert_array_equal(by_param.waveform, served.waveform)
    default = http.convert(src, prm, source_sr=ssr, prompt_sr=psr)
    zero = http.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=0)
    np.testing.assert_array_equal(default.waveform, zero.waveform)
    assert not np.array_equal(default.waveform, served.waveform)


def _counts(client, model):
    """(inferences executed, executions, requests answered from Triton's response cache): ``inference_count``
    leaves the cache hits out (when a render turns the response cache on for the prompt-side graphs)."""
    s = client.statistics(model)["model_stats"][0]
    hits = int(s.get("inference_stats", {}).get("cache_hit", {}).get("count", 0))
    return int(s["inference_count"]), int(s["execution_count"]), hits


def test_dynamic_batching_forms_batches_of_different_lengths(triton_server, speech):
    src, ssr, prm, psr = speech
    with VCClient(triton_server.http_url, timeout=PATIENCE_S, concurrency=8) as c:
        before = {m: _counts(c, m) for m in ("preprocess", "flow", "hift", "speech_tokenizer")}
        pairs = [{"source": src[: int(ssr * (0.8 + 0.15 * i))], "prompt": prm, "source_sr": ssr, "prompt_sr": psr}
                 for i in range(8)]
        results = c.convert_many(pairs)
        assert all(not isinstance(r, VCError) for r in results), results
        assert len({len(r.waveform) for r in results}) == 8
        after = {m: _counts(c, m) for m in before}
    for m in before:
        inferences = after[m][0] - before[m][0]
        executions = after[m][1] - before[m][1]
        hits = after[m][2] - before[m][2]  # the repeated prompt's tokenizer requests: answered from the cache
        assert inferences + hits == (16 if m == "speech_tokenizer" else 8), (m, inferences, hits)
        assert executions < inferences, f"{m}: {inferences} requests in {executions} executions: no batching"
    # and a batched answer is the answer alone
    alone = VCClient(triton_server.http_url).convert(**pairs[5])
    np.testing.assert_allclose(results[5].waveform, alone.waveform, atol=1e-5)


def test_async_clients(triton_server, speech, served):
    src, ssr, prm, psr = speech

    async def go(url, protocol):
        async with AsyncVCClient(url, protocol=protocol, timeout=PATIENCE_S) as c:
            one = await c.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=3)
            many = await c.convert_many([{"source": src, "prompt": prm, "source_sr": ssr, "prompt_sr": psr},
                                         {"source": src[:5], "prompt": prm, "source_sr": ssr, "prompt_sr": psr}])
            return one, many

    for url, protocol in ((triton_server.http_url, "http"), (triton_server.grpc_url, "grpc")):
        one, many = asyncio.run(go(url, protocol))
        np.testing.assert_array_equal(one.waveform, served.waveform)
        assert not isinstance(many[0], VCError)
        assert isinstance(many[1], VCError) and many[1].invalid_argument and "too short" in many[1].message


# ------------------------------------------------------------------------------------ invalid requests

def _inputs(module, speech, **override):
    """The four inputs with some replaced (name -> (array, triton dtype)) or removed (name -> None)."""
    src, ssr, prm, psr = speech
    base = {"source_audio": (src[None].astype(np.float32), "FP32"),
            "source_sample_rate": (np.array([[ssr]], np.int32), "INT32"),
            "prompt_audio": (prm[None].astype(np.float32), "FP32"),
            "prompt_sample_rate": (np.array([[psr]], np.int32), "INT32")}
    base.update(override)
    out = []
    for name, spec in base.items():
        if spec is None:
            continue
        arr, dtype = spec
        t = module.InferInput(name, list(arr.shape), dtype)
        if dtype == "BYTES":
            t.set_data_from_numpy(arr.astype(object))
        else:
            t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _f32(x):
    return (np.asarray(x, np.float32).reshape(1, -1), "FP32")


def _rate(v):
    return (np.array([[v]], np.int32), "INT32")


_NOISE = np.random.default_rng(0).uniform(-0.5, 0.5, 16000 * 40).astype(np.float32)
INVALID = {
    "empty audio": ({"source_audio": _f32([])}, ["source_audio", "empty"]),
    "one sample": ({"source_audio": _f32([0.1])}, ["source_audio", "too short"]),
    "40 s": ({"source_audio": _f32(_NOISE), "source_sample_rate": _rate(16000)}, ["source_audio", "too long"]),
    "NaN": ({"prompt_audio": _f32(np.where(np.arange(16000) == 7, np.nan, 0.1))}, ["prompt_audio", "NaN"]),
    "Inf": ({"source_audio": _f32(np.where(np.arange(16000) == 9, np.inf, 0.1))}, ["source_audio", "infinite"]),
    "rate 0": ({"source_sample_rate": _rate(0)}, ["source_sample_rate", "positive"]),
    "rate negative": ({"prompt_sample_rate": _rate(-16000)}, ["prompt_sample_rate", "positive"]),
    "rate 1 Hz": ({"source_sample_rate": _rate(1)}, ["source_sample_rate", "outside"]),
    "rate 1 MHz": ({"prompt_sample_rate": _rate(1_000_000)}, ["prompt_sample_rate", "outside"]),
    "wrong dtype": ({"source_audio": (np.zeros((1, 16000), np.float64), "FP64")}, ["source_audio", "FP64"]),
    "wrong rank": ({"prompt_audio": (np.zeros((1, 2, 8000), np.float32), "FP32")}, ["prompt_audio", "shape"]),
    "missing input": ({"prompt_audio": None}, ["prompt_audio"]),
    "non-numeric rate": ({"source_sample_rate": (np.array([[b"16k"]], object), "BYTES")},
                         ["source_sample_rate", "BYTES"]),
    "garbage bytes": ({"source_audio": None, "source_sample_rate": None,
                       "source_audio_bytes": (np.array([[b"RIFF\x00\x01 not a wav"]], object), "BYTES")},
                      ["source_audio_bytes", "not a readable"]),
    "bytes and samples": ({"prompt_audio_bytes": (np.array([[b"RIFF"]], object), "BYTES")},
                          ["prompt", "either"]),
    "rate without audio": ({"source_audio": None}, ["source_audio", "missing"]),
    "batch of 2": ({"source_audio": (np.full((2, 16000), 0.1, np.float32), "FP32"),
                    "source_sample_rate": (np.full((2, 1), 16000, np.int32), "INT32"),
                    "prompt_audio": (np.full((2, 16000), 0.1, np.float32), "FP32"),
                    "prompt_sample_rate": (np.full((2, 1), 16000, np.int32), "INT32")}, ["batch"]),
    "seed of wrong type": ({"seed": (np.array([[1.5]], np.float32), "FP32")}, ["seed", "FP32"]),
    "negative seed": ({"seed": (np.array([[-1]], np.int64), "INT64")}, ["seed", "outside"]),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_request_is_refused_with_a_clear_message(client, speech, case, triton_server):
    override, words = INVALID[case]
    with pytest.raises(VCError) as info:
        client.infer_raw(_inputs(client._module, speech, **override))
    err = info.value
    assert err.invalid_argument, f"{case}: status {err.status}: {err.message}"
    for w in words:
        assert w.lower() in err.message.lower(), f"{case}: {w!r} not in {err.message!r}"
    assert triton_server.is_ready() and triton_server.running


def test_good_request_batched_with_bad_ones_succeeds(triton_server, speech, served):
    src, ssr, prm, psr = speech
    good = {"source": src, "prompt": prm, "source_sr": ssr, "prompt_sr": psr, "seed": 3}
    bad_nan = {**good, "source": np.where(np.arange(len(src)) == 3, np.nan, src)}
    bad_rate = {**good, "prompt_sr": 3}
    with VCClient(triton_server.http_url, timeout=PATIENCE_S, concurrency=6) as c:
        before = _counts(c, "preprocess")
        res = c.convert_many([bad_nan, good, bad_rate, good, bad_nan, good])
        after = _counts(c, "preprocess")
    for i in (1, 3, 5):
        assert not isinstance(res[i], VCError), res[i]
        np.testing.assert_allclose(res[i].waveform, served.waveform, atol=1e-5)
    for i in (0, 2, 4):
        assert isinstance(res[i], VCError) and res[i].invalid_argument
    assert "NaN" in res[0].message and "prompt_sample_rate" in res[2].message
    assert after[1] - before[1] < 6  # some of them shared an execute()


# ------------------------------------------------------------------------------------ hostile but valid

def test_silence_is_a_clear_error(http, speech):
    _, _, prm, psr = speech
    with pytest.raises(VCError) as info:
        http.convert(np.zeros(16000, np.float32), prm, source_sr=16000, prompt_sr=psr)
    assert info.value.invalid_argument and "silent" in info.value.message


@pytest.mark.parametrize("case", ["clipped noise", "0.5 s prompt", "8 kHz telephone", "int16 stereo 44.1 kHz"])
def test_hostile_but_valid_audio_converts(http, speech, case, triton_server):
    src, ssr, prm, psr = speech
    rng = np.random.default_rng(1)
    if case == "clipped noise":
        args = (np.sign(rng.standard_normal(32000)).astype(np.float32), prm, 16000, psr)
    elif case == "0.5 s prompt":
        args = (src, prm[: psr // 2], ssr, psr)
    elif case == "8 kHz telephone":
        import soxr

        args = (soxr.resample(src, ssr, 8000), soxr.resample(prm, psr, 8000), 8000, 8000)
    else:
        import soxr

        stereo = soxr.resample(src, ssr, 44100)
        args = ((np.stack([stereo, stereo * 0.5], 1) * 32767).astype(np.int16), prm, 44100, psr)
    out = http.convert(args[0], args[1], source_sr=args[2], prompt_sr=args[3])
    assert np.isfinite(out.waveform).all() and out.waveform.size > 0
    assert triton_server.is_ready()


def test_build_inputs_shapes():
    import tritonclient.http as th

    inputs = build_inputs(th, np.zeros(10, np.float32), 16000, np.zeros(5, np.float32), 8000, seed=1)
    assert [(i.name(), i.shape(), i.datatype()) for i in inputs] == [
        ("source_audio", [1, 10], "FP32"), ("source_sample_rate", [1, 1], "INT32"),
        ("prompt_audio", [1, 5], "FP32"), ("prompt_sample_rate", [1, 1], "INT32"), ("seed", [1, 1], "INT64")]


# ------------------------------------------------------------------------------------ command lines

def test_client_cli_converts_several_files_and_reports_failures(triton_server, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "not_audio.wav"
    bad.write_bytes(b"RIFF garbage")
    cli = [sys.executable, "-m", "cosyvoice_triton", "client", "--url", triton_server.grpc_url,
           "--protocol", "grpc", "--prompt", str(FIXTURES / "prompt_en_3s.wav"), "-o", str(tmp_path / "out")]
    proc = subprocess.run([*cli, "--source", str(FIXTURES / "source_en_5s.wav"), str(FIXTURES / "speech_engb_16k.wav"),
                           str(bad)], capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one of three failed
    assert (tmp_path / "out" / "source_en_5s.wav").is_file() and (tmp_path / "out" / "speech_engb_16k.wav").is_file()
    assert "not_audio.wav: error" in proc.stderr and "not a readable" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cosyvoice_triton", "client", "--url", "127.0.0.1:1",
                           "--source", "x.wav", "--prompt", "y.wav", "-o", "z.wav"], capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 2 and "not ready" in proc.stderr


def test_run_demo_end_to_end(serving_assets, tmp_path, capsys):
    from cosyvoice_triton.serving.launch.serve_demo import run_demo

    report = run_demo(serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      repository=tmp_path / "model_repository", output=tmp_path / "demo.wav", repeats=2,
                      tts_output=tmp_path / "tts.wav")
    out = capsys.readouterr().out
    assert report.output.is_file() and abs(report.seconds - 5.0) < 0.1 and len(report.latencies) == 2
    assert report.tts_output == tmp_path / "tts.wav" and report.tts_output.is_file() and report.tts_seconds > 0.1
    assert "through cosyvoice_tts" in out
    names = {s["name"] for s in report.statistics["model_stats"]}
    assert {"cosyvoice_vc", "preprocess", "flow", "flow_estimator", "hift", "postprocess"} <= names
    assert "latency: first" in out and "flow_estimator" in out
