"""Streaming voice conversion: ``StreamingToken2Wav`` / ``VCStreamer`` in process against
``CosyVoice2.token2wav_stream``, and the served ``cosyvoice_vc_stream`` (decoupled, gRPC stream) against both:
chunks on the official schedule, registered speakers, errors on the stream, cancellation, too many streams, the
HTTP side (infer refused; the generate-stream endpoint)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import PATIENCE_S, rel_err, speech_pair, vc_request, wait_until

from cosyvoice_triton.clients.client import VCClient, VCError
from cosyvoice_triton.loadtest.metrics import counter_total, scrape
from cosyvoice_triton.serving.stages.vc_stream import StreamCancelled, VCStreamer
from cosyvoice_triton.streaming import stream_chunk_ends

SEED = 3


@pytest.fixture(scope="module")
def speech():
    return speech_pair(4.0, 1.5)


@pytest.fixture(scope="module")
def local(local_pipeline):
    return local_pipeline


@pytest.fixture(scope="module")
def model(serving_library):
    return serving_library


def _request(src, ssr, prm, psr, seed=SEED):
    return vc_request(src, ssr, prm, psr, seed)


@pytest.fixture(scope="module")
def reference(model, speech):
    """The in-process streaming chunks (torch) of the module's pair."""
    src, ssr, prm, psr = speech
    inputs = model.frontend_vc(src, prm, source_sr=ssr, prompt_sr=psr)
    return inputs, list(model.token2wav_stream(inputs, seed=SEED))


def test_in_process_chunks_equal_token2wav_stream(local, speech, reference):
    graphs = {k: v.run for k, v in local.graphs.items()}
    streamer = VCStreamer(local.pre, local.flow, graphs)
    inputs, ref = reference
    prompt, tokens, _ = streamer.prepare(_request(*speech))
    np.testing.assert_array_equal(tokens, inputs.source_tokens)
    np.testing.assert_array_equal(prompt.prompt_tokens, inputs.prompt_tokens)
    chunks = list(streamer.stream(_request(*speech)))
    assert len(ref) == len(stream_chunk_ends(len(tokens), len(prompt.prompt_tokens), lookahead=3)) + 1 >= 3
    assert [len(c) for c in chunks] == [len(c) for c in ref]
    for got, want in zip(chunks, ref, strict=True):
        assert rel_err(got, want) < 1e-3  # the fp32 bar: onnxruntime graphs against the torch pipeline


def test_in_process_cancellation_stops_the_graph_calls(local, speech):
    calls = {"n": 0}

    def counted(fn):
        def call(feeds):
            calls["n"] += 1
            return fn(feeds)
        return call

    graphs = {k: counted(v.run) if k == "flow_encoder" else v.run for k, v in local.graphs.items()}
    streamer = VCStreamer(local.pre, local.flow, graphs)
    got = []
    with pytest.raises(StreamCancelled):
        for chunk in streamer.stream(_request(*speech), cancelled=lambda: len(got) >= 1):
            got.append(chunk)
    assert len(got) == 1 and calls["n"] == 1  # the second chunk's encoder call never happened


# ------------------------------------------------------------------------------------------ served
@pytest.fixture(scope="module")
def grpc(triton_server):
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
        yield c


def _stream_metric(triton_server, name: str, **labels: str) -> float:
    return counter_total(scrape(triton_server.metrics_url, timeout=30), name, model="cosyvoice_vc_stream", **labels)


def _chunk_count(triton_server) -> int:
    """hift_decoder calls: one per chunk (non-final chunks leave the flow graphs alone: the stream state)."""
    with VCClient(triton_server.http_url) as c:
        return int(c.statistics("hift_decoder")["model_stats"][0]["inference_count"])


def test_served_stream_equals_in_process(grpc, speech, reference):
    src, ssr, prm, psr = speech
    chunks = list(grpc.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=SEED))
    _, ref = reference
    assert [c.index for c in chunks] == list(range(len(ref)))
    assert all(c.sample_rate == 24000 for c in chunks)
    assert [len(c.waveform) for c in chunks] == [len(r) for r in ref]
    for got, want in zip(chunks, ref, strict=True):
        assert rel_err(got.waveform, want) < 1e-3
    times = [c.elapsed_s for c in chunks]
    assert times == sorted(times) and times[0] < times[-1]  # they arrived one by one


def test_served_stream_by_speaker_id(grpc, speech, model):
    src, ssr, prm, psr = speech
    grpc.register_speaker("stream_voice", prm, prompt_sr=psr)
    try:
        chunks = list(grpc.convert_stream(src, speaker_id="stream_voice", source_sr=ssr, seed=SEED))
    finally:
        grpc.delete_speaker("stream_voice")
    speaker = model.prompt(prm, prompt_sr=psr)  # what register computes, in process
    inputs = model.frontend_vc(src, prm, source_sr=ssr, prompt_sr=psr)
    inputs.prompt_tokens, inputs.prompt_mel = np.array(speaker.prompt_tokens), np.array(speaker.prompt_mel)
    ref = list(model.token2wav_stream(inputs, seed=SEED))
    assert len(chunks) == len(ref)
    assert rel_err(np.concatenate([c.waveform for c in chunks]), np.concatenate(ref)) < 1e-3


@pytest.mark.parametrize("case", ["unknown_speaker", "speaker_and_prompt", "bad_audio", "no_prompt"])
def test_errors_arrive_on_the_stream(grpc, speech, case):
    src, ssr, prm, psr = speech
    kw = {"unknown_speaker": {"speaker_id": "nobody_here"},
          "speaker_and_prompt": {"prompt": prm, "prompt_sr": psr, "speaker_id": "nobody_here"},
          "bad_audio": {"prompt": np.full(psr, np.nan, np.float32), "prompt_sr": psr},
          "no_prompt": {}}[case]
    want = {"unknown_speaker": "unknown speaker 'nobody_here'", "speaker_and_prompt": "not both",
            "bad_audio": "prompt_audio", "no_prompt": "prompt"}[case]
    with pytest.raises((VCError, ValueError)) as info:
        list(grpc.convert_stream(src, source_sr=ssr, **kw))
    assert want in str(info.value)
    assert grpc.is_ready()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cancel_stops_the_work(triton_server, speech, protocol):
    """Closing the stream early (gRPC: cancel; HTTP generate_stream: the connection closes) stops the server's
    work before its next chunk."""
    src, ssr, prm, psr = speech
    long_src = np.concatenate([src, src, src])  # 12 s: 300 tokens, 4 chunks
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    with VCClient(url, protocol=protocol, timeout=PATIENCE_S) as c:
        before = _chunk_count(triton_server)
        full = list(c.convert_stream(long_src, prm, source_sr=ssr, prompt_sr=psr))
        per_stream = _chunk_count(triton_server) - before
        assert len(full) == per_stream >= 4
        before = _chunk_count(triton_server)
        stopped = _stream_metric(triton_server, "cosyvoice_rejects_total", reason="cancelled")
        stream = c.convert_stream(long_src, prm, source_sr=ssr, prompt_sr=psr)
        next(stream)
        stream.close()  # cancels the request on the server
        # the chunk in flight finishes, then the stream sees the cancel before its next graph call and stops
        wait_until(lambda: _stream_metric(triton_server, "cosyvoice_rejects_total", reason="cancelled") > stopped,
                   "the server's stream counted as cancelled", interval=0.2)
        cancelled = _chunk_count(triton_server) - before
        time.sleep(2.0)
        assert _chunk_count(triton_server) - before == cancelled  # and nothing runs later
    assert cancelled <= 2 < per_stream, (cancelled, per_stream)


def test_too_many_streams_are_refused_at_once(triton_server, speech):
    """max_streams + max_waiting streams (4 + 4 by default) are taken; the next is refused with UNAVAILABLE,
    at once; then every stream is cancelled and the model still answers."""
    src, ssr, prm, psr = speech
    short = np.concatenate([src, src, src])  # long enough that no stream ends before all have arrived
    results, lock = [], threading.Lock()
    clients = [VCClient(triton_server.grpc_url, protocol="grpc", timeout=PATIENCE_S) for _ in range(10)]
    streams = [c.convert_stream(short, prm, source_sr=ssr, prompt_sr=psr) for c in clients]
    served_before = _stream_metric(triton_server, "cosyvoice_audio_out_seconds_total")

    def run(stream):
        served = None
        try:
            next(stream)
            out = "ok"
        except VCError as exc:
            out = str(exc)
            served = _stream_metric(triton_server, "cosyvoice_audio_out_seconds_total")  # counted as a stream ends
        except StopIteration:
            out = "ok"
        with lock:
            results.append((out, served))

    threads = [threading.Thread(target=run, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE_S + 30)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    refused = [(r, served) for r, served in results if "too many concurrent streams" in r]
    assert len(refused) == 2, results
    # answered at once, not after the others: when each refusal came back no stream had ended yet
    assert all(served == served_before for _, served in refused), (served_before, refused)
    for s in streams:
        s.close()
    for c in clients:
        c.close()
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
        assert len(list(c.convert_stream(src[: ssr * 2], prm, source_sr=ssr, prompt_sr=psr))) >= 1


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_stream_model_over_infer_is_refused(triton_server, speech, protocol):
    src, ssr, prm, psr = speech
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    with VCClient(url, protocol=protocol, model="cosyvoice_vc_stream", timeout=60) as c, \
            pytest.raises(VCError) as info:
        c.convert(src, prm, source_sr=ssr, prompt_sr=psr)
    assert "decoupled" in info.value.message.lower(), info.value


def test_stream_request_to_a_non_streaming_model(grpc, speech):
    """cosyvoice_vc over a gRPC stream answers once (whole audio, one 'chunk') and ends: no hang."""
    src, ssr, prm, psr = speech
    chunks = list(grpc.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, model="cosyvoice_vc"))
    assert len(chunks) == 1 and abs(len(chunks[0].waveform) / 24000 - 4.0) < 0.1


def test_http_generate_stream(triton_server, speech):
    """Triton 2.51's HTTP generate-stream endpoint serves the decoupled model: server-sent events, one per chunk.
    Its JSON maps each field to one input of batch 1: flat fields (a batch-major ``[[...]]`` layout is refused)."""
    src, ssr, prm, psr = speech
    body = {"source_audio": src.tolist(), "source_sample_rate": [ssr], "prompt_audio": prm.tolist(),
            "prompt_sample_rate": [psr], "seed": [SEED]}
    req = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/cosyvoice_vc_stream/generate_stream",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [json.loads(line[5:]) for line in resp.read().decode().splitlines() if line.startswith("data:")]
    assert not [e for e in events if "error" in e], events
    chunks = [e for e in events if "waveform" in e]
    assert [int(np.ravel(e["chunk_index"])[0]) for e in chunks] == list(range(len(chunks)))
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
        want = list(c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=SEED))
    assert len(chunks) == len(want) >= 3
    for event, chunk in zip(chunks, want, strict=True):
        np.testing.assert_allclose(np.ravel(event["waveform"]), chunk.waveform, atol=1e-6)  # JSON floats
