"""Streaming clients and the CLI against a live server: sync and asyncio streams over gRPC and HTTP
``generate_stream`` (the same chunks, first-chunk latency, early close, errors with the server's message), the
CLI's ``--stream`` to a wav or raw PCM on stdout over either protocol, ``speaker add|list|delete``, a stream
request to a non-streaming model and the reverse, and the TTS calls (skipped with the reason while the server has
no TTS models)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES

from cosyvoice_triton.clients.client import AsyncTTSClient, AsyncVCClient, StreamStats, TTSClient, VCClient, VCError

CLI = [sys.executable, "-m", "cosyvoice_triton", "client"]
SOURCE, PROMPT = FIXTURES / "source_en_5s.wav", FIXTURES / "prompt_en_3s.wav"


@pytest.fixture(scope="module")
def speech():
    src, ssr = sf.read(SOURCE, dtype="float32")
    prm, psr = sf.read(PROMPT, dtype="float32")
    return src[: int(3.0 * ssr)], ssr, prm[: int(1.5 * psr)], psr


@pytest.fixture(scope="module")
def sync_chunks(triton_server, speech):
    src, ssr, prm, psr = speech
    stats = StreamStats()
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
        chunks = list(c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=5, stats=stats))
    return chunks, stats


def test_sync_stream_records_first_chunk_latency(sync_chunks):
    chunks, stats = sync_chunks
    assert len(chunks) >= 2 and stats.chunks == len(chunks)
    assert stats.first_chunk_s == chunks[0].elapsed_s < stats.total_s == chunks[-1].elapsed_s
    assert stats.samples == sum(len(c.waveform) for c in chunks) and stats.sample_rate == 24000
    assert stats.rtf > 0


def test_async_stream_equals_sync(triton_server, speech, sync_chunks):
    src, ssr, prm, psr = speech

    async def run():
        stats = StreamStats()
        async with AsyncTTSClient(triton_server.grpc_url, protocol="grpc", timeout=120) as c:
            got = [ch async for ch in c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=5, stats=stats)]
            # closing early cancels, and the client stays usable
            early = c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr)
            first = await early.__anext__()
            await early.aclose()
            again = [ch async for ch in c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=5)]
        return got, stats, first, again

    got, stats, first, again = asyncio.run(run())
    want, _ = sync_chunks
    assert [c.index for c in got] == [c.index for c in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.waveform, b.waveform)  # same server, same seed: the same audio
    assert stats.first_chunk_s is not None and stats.first_chunk_s < stats.total_s
    assert first.index == 0 and len(again) == len(want)


def test_async_stream_error(triton_server, speech):
    src, ssr, _, _ = speech

    async def run():
        async with AsyncVCClient(triton_server.grpc_url, protocol="grpc", timeout=60) as c:
            return [ch async for ch in c.convert_stream(src, source_sr=ssr, speaker_id="no_such_voice")]

    with pytest.raises(VCError, match="unknown speaker 'no_such_voice'"):
        asyncio.run(run())


def _cli(*args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, timeout=timeout)


def test_cli_stream_to_stdout_and_to_a_file(triton_server, tmp_path, sync_chunks):
    url = ["--url", triton_server.grpc_url]
    proc = _cli("vc", *url, "--source", str(SOURCE), "--prompt", str(PROMPT), "--stream", "-o", "-")
    assert proc.returncode == 0, proc.stderr.decode()
    pcm = np.frombuffer(proc.stdout, "<i2")
    report = proc.stderr.decode()
    assert "first chunk after" in report and "raw s16le" in report
    out = tmp_path / "streamed.wav"
    proc = _cli("vc", *url, "--source", str(SOURCE), "--prompt", str(PROMPT), "--stream", "-o", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    assert "first chunk after" in proc.stdout.decode()
    wave, sr = sf.read(out, dtype="int16")
    assert sr == 24000 and len(wave) == len(pcm) > 24000 * 4.5  # the whole 5 s source, both ways
    assert np.abs(wave.astype(np.int32) - pcm).max() <= 2  # the same audio; 16-bit scaling differs by a unit


def test_cli_speakers_and_stream_by_speaker(triton_server, tmp_path):
    url = ["--url", triton_server.http_url]
    proc = _cli("speaker", *url, "add", "cli_voice", "--prompt", str(PROMPT))
    assert proc.returncode == 0 and "registered 'cli_voice'" in proc.stdout.decode(), proc.stderr.decode()
    assert "cli_voice" in _cli("speaker", *url, "list").stdout.decode().split()
    out = tmp_path / "by_speaker.wav"
    proc = _cli("vc", "--url", triton_server.grpc_url, "--source", str(SOURCE), "--speaker", "cli_voice", "--stream",
                "-o", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    assert sf.info(out).duration > 4.5
    assert _cli("speaker", *url, "delete", "cli_voice").returncode == 0
    proc = _cli("speaker", *url, "delete", "cli_voice")
    assert proc.returncode == 1 and "unknown speaker 'cli_voice'" in proc.stderr.decode()
    proc = _cli("speaker", *url, "add", "bad/id", "--prompt", str(PROMPT))
    assert proc.returncode == 1 and "invalid" in proc.stderr.decode()


def test_cli_stream_over_http_equals_grpc(triton_server, tmp_path):
    outs = {}
    for protocol, url in (("http", triton_server.http_url), ("grpc", triton_server.grpc_url)):
        outs[protocol] = tmp_path / f"{protocol}.wav"
        proc = _cli("vc", "--url", url, "--protocol", protocol, "--source", str(SOURCE), "--prompt", str(PROMPT),
                    "--seed", "7", "--stream", "-o", str(outs[protocol]))
        assert proc.returncode == 0, proc.stderr.decode()
        assert "first chunk after" in proc.stdout.decode()
    http, sr = sf.read(outs["http"], dtype="int16")
    grpc, _ = sf.read(outs["grpc"], dtype="int16")
    assert sr == 24000 and len(http) > 24000 * 4.5
    np.testing.assert_array_equal(http, grpc)


# ------------------------------------------------------------------------------- HTTP generate_stream
def test_http_stream_equals_grpc(triton_server, speech, sync_chunks):
    src, ssr, prm, psr = speech
    want, _ = sync_chunks
    stats = StreamStats()
    with VCClient(triton_server.http_url, protocol="http", timeout=120) as c:
        got = list(c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=5, stats=stats))
        encoded = list(c.convert_stream(SOURCE, PROMPT, seed=5, encoded=True))  # files: decoded here for JSON
    assert [ch.index for ch in got] == [ch.index for ch in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.waveform, b.waveform)  # float32 survives the JSON round trip
    assert stats.chunks == len(got) and stats.sample_rate == 24000
    assert 0 < stats.first_chunk_s == got[0].elapsed_s < stats.total_s == got[-1].elapsed_s
    print(f"first chunk over HTTP generate_stream after {stats.first_chunk_s:.2f} s, total {stats.total_s:.2f} s")
    assert sum(len(ch.waveform) for ch in encoded) > 24000 * 4.5


def test_async_http_stream_equals_grpc(triton_server, speech, sync_chunks):
    src, ssr, prm, psr = speech

    async def run():
        stats = StreamStats()
        async with AsyncVCClient(triton_server.http_url, protocol="http", timeout=120) as c:
            got = [ch async for ch in c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=5, stats=stats)]
            early = c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr)
            first = await early.__anext__()
            await early.aclose()  # closes the connection; the session stays usable
            again = [ch async for ch in c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=5)]
        return got, stats, first, again

    got, stats, first, again = asyncio.run(run())
    want, _ = sync_chunks
    for a, b, c in zip(got, want, again, strict=True):
        np.testing.assert_array_equal(a.waveform, b.waveform)
        np.testing.assert_array_equal(c.waveform, b.waveform)
    assert stats.first_chunk_s is not None and 0 < stats.first_chunk_s < stats.total_s
    assert first.index == 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_stream_errors_carry_the_server_message(triton_server, speech, protocol):
    src, ssr, _, _ = speech
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    with VCClient(url, protocol=protocol, timeout=60) as c:
        with pytest.raises(VCError) as info:
            list(c.convert_stream(src, source_sr=ssr, speaker_id="no_such_voice"))
        assert "unknown speaker 'no_such_voice'" in info.value.message
        if protocol == "http":  # a gRPC stream's error carries only its message (ModelStreamInferResponse)
            assert info.value.status == "400" and info.value.invalid_argument
        assert len(list(c.convert_stream(src[: ssr * 2], PROMPT, source_sr=ssr))) >= 1  # still serving


class _MidStreamError:
    """A local HTTP server that answers generate_stream as Triton does when a model fails after its first chunk:
    status 200, one chunk event, then an error event."""

    def __enter__(self):
        import http.server
        import json
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.end_headers()
                chunk = {"chunk_index": 0, "sample_rate": 24000, "waveform": [0.25] * 480}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                self.wfile.write(b'data: {"error":"internal error: RuntimeError: the vocoder failed"}\n\n')

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_error_mid_stream_is_raised_after_the_chunks_before_it(speech):
    src, ssr, prm, psr = speech
    with _MidStreamError() as url:
        got = []
        with VCClient(url, protocol="http", timeout=30) as c, pytest.raises(VCError) as info:
            for chunk in c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr):
                got.append(chunk)
        assert len(got) == 1 and got[0].waveform.shape == (480,)
        assert info.value.message == "cosyvoice_vc_stream: internal error: RuntimeError: the vocoder failed"
        assert info.value.status == "stream" and not info.value.invalid_argument

        async def run():
            seen = []
            async with AsyncVCClient(url, protocol="http", timeout=30) as c:
                async for chunk in c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr):
                    seen.append(chunk)
            return seen

        with pytest.raises(VCError, match="the vocoder failed"):
            asyncio.run(run())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_wrong_kind_of_request_for_the_model(triton_server, speech, protocol):
    """A whole-answer request to the streaming model is refused with a message that says so; a stream request to
    the whole-answer model is served as a stream of one chunk (Triton allows it), over both protocols."""
    src, ssr, prm, psr = speech
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    with VCClient(url, protocol=protocol, model="cosyvoice_vc_stream", timeout=120) as c:
        with pytest.raises(VCError) as info:
            c.convert(src, prm, source_sr=ssr, prompt_sr=psr)
        assert "decoupled" in info.value.message, info.value
        chunks = list(c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, model="cosyvoice_vc"))
    assert len(chunks) == 1 and abs(len(chunks[0].waveform) / 24000 - 3.0) < 0.1


# ------------------------------------------------------------------------------------------------ TTS
@pytest.fixture(scope="module")
def tts_client(triton_server):
    c = TTSClient(triton_server.grpc_url, protocol="grpc", timeout=300)
    try:
        if not c.is_ready() or not c._client.is_model_ready("cosyvoice_tts_stream"):
            pytest.skip("the server has no cosyvoice_tts / cosyvoice_tts_stream models (TTS serving not rendered)")
    except Exception as exc:
        pytest.skip(f"TTS models not available: {exc}")
    yield c
    c.close()


def test_tts_stream_over_http_equals_grpc(tts_client, triton_server, speech):
    _, _, prm, psr = speech
    want = list(tts_client.tts_stream("Hello there.", prompt=prm, prompt_sr=psr, seed=3))
    stats = StreamStats()
    with TTSClient(triton_server.http_url, protocol="http", timeout=300) as c:
        got = list(c.tts_stream("Hello there.", prompt=prm, prompt_sr=psr, seed=3, stats=stats))
    assert len(got) == len(want) >= 1 and stats.first_chunk_s is not None
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.waveform, b.waveform)


def test_tts_whole_and_streamed(tts_client, speech):
    _, _, prm, psr = speech
    whole = tts_client.tts("Hello there.", prompt=prm, prompt_sr=psr, seed=1)
    assert whole.sample_rate == 24000 and len(whole.waveform) > 0 and np.isfinite(whole.waveform).all()
    stats = StreamStats()
    chunks = list(tts_client.tts_stream("Hello there.", prompt=prm, prompt_sr=psr, seed=1, stats=stats))
    assert chunks and stats.first_chunk_s is not None and stats.samples == sum(len(c.waveform) for c in chunks)


def test_tts_by_speaker_id_and_cli(tts_client, triton_server, speech, tmp_path):
    _, _, prm, psr = speech
    tts_client.register_speaker("tts_voice", prm, prompt_sr=psr)
    try:
        chunks = list(tts_client.tts_stream("Good morning.", speaker_id="tts_voice", seed=2))
        assert chunks
        out = tmp_path / "tts.wav"
        proc = _cli("tts", "--url", triton_server.grpc_url, "--text", "Good morning.", "--speaker", "tts_voice",
                    "--stream", "-o", str(out))
        assert proc.returncode == 0 and "first chunk after" in proc.stdout.decode(), proc.stderr.decode()
        assert sf.info(out).frames > 0
        with pytest.raises(VCError, match="unknown speaker"):
            list(tts_client.tts_stream("Good morning.", speaker_id="nobody_at_all"))
    finally:
        tts_client.delete_speaker("tts_voice")
