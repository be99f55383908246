"""Streamed answers honour the output options: one server rendered with ``output_sample_rate=16000`` and
``loudness_lufs=-23`` serves the streaming VC and TTS chunks at 16 kHz, resampled as one stream
(``postprocess.ChunkPostprocessor``), over a gRPC stream and HTTP ``generate_stream``.

The bar: the joined 16 kHz chunks against the in-process 24 kHz pipeline (``CosyVoice2``, PyTorch) resampled
whole by the non-streaming post-processing (``Postprocessor.waveform``): relative error 1e-3, the parity bar of
the 24 kHz streams. Resampling is linear and its gain stays at ~1 in the pass band, so the 24 kHz difference
between onnxruntime and PyTorch carries over unchanged, while the streaming resampler itself adds nothing (in
process it equals the one-shot call bit for bit, tested below). Resampling each chunk on its own, the click a
per-chunk resampler makes, is at ~0.2 of the peak here: far beyond the bar (the negative control below).
Loudness normalisation needs the whole utterance, so streams are not normalised and ``cosyvoice_tts`` (a whole
answer) is.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PATIENCE_S, rel_err, served, speech_pair

from cosyvoice_triton.clients.client import StreamStats, TTSClient, VCClient
from cosyvoice_triton.serving.stages.postprocess import Postprocessor, integrated_loudness

RATE, LUFS = 16000, -23.0
SEED = 4
TEXT = "Hello there, this is a test of the served pipeline."
PROMPT_TEXT = "the prompt says hello"
BAR = 1e-3


@pytest.fixture(scope="module")
def speech():
    return speech_pair(4.0, 1.5)


@pytest.fixture(scope="module")
def model(serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2

    return CosyVoice2.from_pretrained(serving_assets["model_dir"])


@pytest.fixture(scope="module")
def vc_reference(model, speech):
    """The in-process streaming VC chunks (24 kHz) of the module's pair."""
    src, ssr, prm, psr = speech
    return list(model.token2wav_stream(model.frontend_vc(src, prm, source_sr=ssr, prompt_sr=psr), seed=SEED))


def _resampled(wave: np.ndarray) -> np.ndarray:
    return Postprocessor(output_sample_rate=RATE).waveform(wave)


# ------------------------------------------------------------------------------------------ in process
def test_stream_resampling_equals_the_whole_answer_resampled(serving_assets, speech, vc_reference):
    from cosyvoice_triton.serving.stages.local import LocalPipeline
    from cosyvoice_triton.serving.stages.vc_stream import VCStreamer

    local = LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")
    graphs = {k: v.run for k, v in local.graphs.items()}
    src, ssr, prm, psr = speech
    request = {"source_audio": src[None], "source_sample_rate": np.array([[ssr]], np.int32),
               "prompt_audio": prm[None], "prompt_sample_rate": np.array([[psr]], np.int32),
               "seed": np.array([[SEED]], np.int64)}
    at_24k = list(VCStreamer(local.pre, local.flow, graphs).stream(request))
    streamer = VCStreamer(local.pre, local.flow, graphs, post=Postprocessor(output_sample_rate=RATE))
    assert streamer.sample_rate == RATE
    at_16k = list(streamer.stream(request))
    assert len(at_16k) == len(at_24k) >= 3
    joined = np.concatenate(at_16k)
    np.testing.assert_array_equal(joined, _resampled(np.concatenate(at_24k)))  # bit for bit
    # each chunk is its share, less the filter's held-back delay (given out with the last chunk)
    shares = [len(c) * RATE / 24000 for c in at_24k]
    assert all(0 < share - len(c) < 0.1 * RATE for c, share in zip(at_16k[:-1], shares[:-1], strict=True))
    assert len(at_16k[-1]) > shares[-1]
    # the negative control: resampling chunk by chunk breaks the joins, far beyond the bar
    per_chunk = np.concatenate([_resampled(c) for c in at_24k])
    ref = _resampled(np.concatenate(vc_reference))
    print(f"in process, 16 kHz against the torch reference: streamed {rel_err(joined, ref):.2e}, per-chunk "
          f"resampling {rel_err(per_chunk, ref):.2e}")
    assert rel_err(per_chunk, ref) > 10 * BAR
    assert rel_err(joined, ref) < BAR


def test_empty_chunks_and_options_not_streamed():
    post = Postprocessor(output_sample_rate=RATE, loudness_lufs=LUFS, output_format="wav")
    assert post.not_streamed == ["loudness_lufs=-23.0", "output_format='wav'"]
    x = (0.1 * np.sin(np.arange(24000) * 0.05)).astype(np.float32)
    chunks = [(x[:100], False), (x[100:12000], False), (x[12000:], True)]
    out = list(post.stream().run(chunks))
    assert len(out) == 2  # the 100-sample chunk stayed inside the filter's delay: no empty response
    np.testing.assert_array_equal(np.concatenate(out), Postprocessor(output_sample_rate=RATE).waveform(x))
    same = Postprocessor().stream()
    np.testing.assert_array_equal(same(x[:100], last=False), x[:100])  # equal rates: passed through
    same(x[100:], last=True)
    with pytest.raises(RuntimeError, match="after the last"):
        same(x, last=False)


# ------------------------------------------------------------------------------------------ served
@pytest.fixture(scope="module")
def server(serving_assets, tmp_path_factory):
    from cosyvoice_triton.serving.repository import render_repository

    repo = tmp_path_factory.mktemp("out16k") / "model_repository"
    render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      max_queue_delay_us=5000, output_sample_rate=RATE, loudness_lufs=LUFS)
    with served(repo) as s:
        yield s


@pytest.fixture(scope="module")
def vc_grpc_chunks(server, speech):
    src, ssr, prm, psr = speech
    stats = StreamStats()
    with VCClient(server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
        return list(c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=SEED, stats=stats)), stats


def test_vc_stream_at_16k_over_grpc(vc_grpc_chunks, vc_reference):
    chunks, stats = vc_grpc_chunks
    assert len(chunks) == len(vc_reference) and all(c.sample_rate == RATE for c in chunks)
    assert stats.sample_rate == RATE and stats.first_chunk_s is not None
    joined = np.concatenate([c.waveform for c in chunks])
    ref = _resampled(np.concatenate(vc_reference))
    print(f"served VC stream at 16 kHz (gRPC): {rel_err(joined, ref):.2e}; first chunk {stats.first_chunk_s:.2f} s")
    assert rel_err(joined, ref) < BAR
    # not loudness-normalised (a stream cannot be): the level is the model's
    assert abs(np.max(np.abs(joined)) / np.max(np.abs(ref)) - 1) < 0.01


def test_vc_stream_at_16k_over_http_equals_grpc(server, speech, vc_grpc_chunks):
    src, ssr, prm, psr = speech
    want, _ = vc_grpc_chunks
    with VCClient(server.http_url, protocol="http", timeout=PATIENCE_S) as c:
        got = list(c.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=SEED))
    assert [c.index for c in got] == [c.index for c in want] and all(c.sample_rate == RATE for c in got)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.waveform, b.waveform)  # float32 survives the JSON round trip


@pytest.fixture(scope="module")
def tts_reference(model, speech):
    _, _, prm, psr = speech
    kw = {"prompt_audio": prm, "prompt_sr": psr, "prompt_text": PROMPT_TEXT, "seed": SEED}
    return np.concatenate(list(model.tts_stream(TEXT, stream=True, **kw))), model.tts(TEXT, **kw)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tts_stream_at_16k(server, speech, tts_reference, protocol):
    _, _, prm, psr = speech
    url = server.grpc_url if protocol == "grpc" else server.http_url
    stats = StreamStats()
    with TTSClient(url, protocol=protocol, timeout=PATIENCE_S) as c:
        chunks = list(c.tts_stream(TEXT, prompt=prm, prompt_sr=psr, prompt_text=PROMPT_TEXT, seed=SEED, stats=stats))
    assert len(chunks) >= 2 and all(c.sample_rate == RATE for c in chunks)
    assert stats.first_chunk_s is not None and stats.first_chunk_s < stats.total_s
    streamed, _ = tts_reference
    err = rel_err(np.concatenate([c.waveform for c in chunks]), _resampled(streamed))
    print(f"served TTS stream at 16 kHz ({protocol}): {err:.2e}; first chunk {stats.first_chunk_s:.2f} s")
    assert err < BAR


def test_whole_tts_answer_is_resampled_and_normalised(server, speech, tts_reference):
    _, _, prm, psr = speech
    with TTSClient(server.http_url, protocol="http", timeout=PATIENCE_S) as c:
        res = c.tts(TEXT, prompt=prm, prompt_sr=psr, prompt_text=PROMPT_TEXT, seed=SEED)
    assert res.sample_rate == RATE
    _, whole = tts_reference
    want = Postprocessor(output_sample_rate=RATE, loudness_lufs=LUFS).waveform(whole)
    loud, peak = integrated_loudness(res.waveform, RATE), 20 * np.log10(np.max(np.abs(res.waveform)))
    print(f"served cosyvoice_tts at 16 kHz, {LUFS} LUFS: {rel_err(res.waveform, want):.2e}; {loud:.2f} LUFS, "
          f"peak {peak:.2f} dBFS")
    assert rel_err(res.waveform, want) < BAR
    assert abs(loud - LUFS) < 0.1 or abs(peak - -1.0) < 0.01  # the target, unless the peak ceiling capped the gain
