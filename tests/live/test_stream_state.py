"""The streams' flow state (serving/stages/stream_state.py): in process, the served streamer with its state gives the
library's chunks and calls the flow graphs for the final chunk only, frees its bytes however the stream stops, and
falls back to the graphs at either cap; served, ``cosyvoice_vc_stream`` holds its state on a gauge that returns to
zero when a stream ends or is cancelled."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PATIENCE_S, rel_err, speech_pair, vc_request, wait_until

from cosyvoice_triton.clients.client import VCClient
from cosyvoice_triton.loadtest.metrics import counter_total, scrape
from cosyvoice_triton.serving.stages.stream_state import IncrementalFlow, StateBudget
from cosyvoice_triton.serving.stages.vc_stream import StreamCancelled, StreamPrompt, VCStreamer

SEED = 5


def _request(src, ssr, prm, psr):
    return vc_request(src, ssr, prm, psr, SEED)


@pytest.fixture(scope="module")
def speech():
    return speech_pair(6.0, 1.5)  # 150 source tokens: chunks after 25 + pad, 50 and the rest


def _streamer(local, model, *, stream_mb=2048.0, total_mb=4096.0, speaker_state=None):
    calls = {"flow_encoder": 0, "flow_estimator": 0, "hift_decoder": 0}

    def counted(name, fn):
        def call(feeds):
            if name in calls:
                calls[name] += 1
            return fn(feeds)
        return call

    graphs = {k: counted(k, v.run) for k, v in local.graphs.items()}
    inc = IncrementalFlow(model.flow, max_stream_bytes=int(stream_mb * 2**20),
                          budget=StateBudget(int(total_mb * 2**20)), speaker_state=speaker_state)
    return VCStreamer(local.pre, local.flow, graphs, incremental=inc), inc, calls


@pytest.fixture(scope="module")
def plain(local_pipeline, speech):
    """The chunks without stream state: every chunk through the flow graphs."""
    graphs = {k: v.run for k, v in local_pipeline.graphs.items()}
    return list(VCStreamer(local_pipeline.pre, local_pipeline.flow, graphs).stream(
        _request(*speech)))


def test_stateful_chunks_equal_the_library_and_call_the_flow_graphs_once(local_pipeline, serving_library, speech,
                                                                         plain):
    streamer, inc, calls = _streamer(local_pipeline, serving_library)
    _, tokens, _ = streamer.prepare(_request(*speech))
    inputs = serving_library.frontend_vc(*speech[::2], source_sr=speech[1], prompt_sr=speech[3])
    np.testing.assert_array_equal(tokens, inputs.source_tokens)
    assert serving_library.incremental_stream
    library = list(serving_library.token2wav_stream(inputs, seed=SEED))  # the library's incremental stream
    got = list(streamer.stream(_request(*speech)))
    assert len(got) == len(library) == len(plain) >= 3
    for a, b, c in zip(got, library, plain, strict=True):
        assert len(a) == len(b) == len(c)
        assert rel_err(a, b) < 1e-3  # the fp32 bar: HiFT on onnxruntime against torch, the flow the same code
        assert rel_err(a, c) < 1e-3  # and the recomputed chunks
    # non-final chunks from the state: one encoder call (the final chunk), its 10 Euler steps; HiFT every chunk
    steps = serving_library.config.flow.cfm.n_timesteps
    assert calls == {"flow_encoder": 1, "flow_estimator": steps, "hift_decoder": len(got)}, calls
    assert inc.budget.nbytes == 0 and inc.budget.streams == 0 and inc.budget.peak > 0


def test_the_state_is_freed_on_cancel_and_on_a_consumer_that_stops(local_pipeline, serving_library, speech):
    streamer, inc, _ = _streamer(local_pipeline, serving_library)
    held = []

    def cancelled():  # asked before each chunk
        held.append(inc.budget.nbytes)
        return len(held) >= 3

    with pytest.raises(StreamCancelled):
        for _ in streamer.stream(_request(*speech), cancelled=cancelled):
            pass
    assert held[0] == 0 and held[1] > 0 and inc.budget.nbytes == 0 and inc.budget.streams == 0
    stream = streamer.stream(_request(*speech))
    next(stream)
    assert inc.budget.streams == 1
    stream.close()  # a client that went away: the generator is closed
    assert inc.budget.nbytes == 0 and inc.budget.streams == 0


@pytest.mark.parametrize("cap", ["stream", "total"])
def test_a_stream_past_a_cap_recomputes_with_the_same_audio(local_pipeline, serving_library, speech, plain, cap):
    tiny = 1e-6  # a few bytes: no chunk fits
    cap_kw = {"stream_mb": tiny} if cap == "stream" else {"total_mb": tiny}
    streamer, inc, calls = _streamer(local_pipeline, serving_library, **cap_kw)
    got = list(streamer.stream(_request(*speech)))
    assert len(got) == len(plain)
    for a, c in zip(got, plain, strict=True):
        np.testing.assert_array_equal(a, c)  # the graphs' own chunks, bit for bit
    assert calls["flow_encoder"] == len(got)
    assert inc.budget.nbytes == 0 and inc.budget.peak == 0
    assert (inc.budget.refused > 0) == (cap == "total")


def test_a_registered_speaker_shares_its_settled_prompt_frames(local_pipeline, serving_library, speech):
    from cosyvoice_triton.speaker_state import SpeakerState

    shared = SpeakerState(64 << 20)
    streamer, inc, _ = _streamer(local_pipeline, serving_library, speaker_state=shared)
    prompt, tokens, _ = streamer.prepare(_request(*speech))
    registered = StreamPrompt(prompt.prompt_tokens, prompt.prompt_mel, prompt.embedding, registered=True)
    first = list(streamer.token2wav.stream(registered, tokens.tolist(), seed=SEED))
    again = list(streamer.token2wav.stream(registered, tokens.tolist(), seed=SEED))
    alone = list(streamer.token2wav.stream(prompt, tokens.tolist(), seed=SEED))
    assert len(prompt.prompt_tokens) >= 25 + 3  # the prompt settles at least one chunk
    assert shared.stats()["misses"] == 1 and shared.stats()["hits"] == 1 and shared.stats()["entries"] == 1
    for a, b, c in zip(first, again, alone, strict=True):
        np.testing.assert_array_equal(a, b)
        # the same mel frames computed in other pieces (1e-5 on the mel: tests/unit/test_speaker_state.py); here
        # after HiFT, whose phases carry the differences: 1.3e-4 measured, the fp32 waveform bar
        assert rel_err(a, c) < 1e-3
    assert inc.budget.nbytes == 0


def test_budget_accounting():
    told = []
    b = StateBudget(100, on_change=lambda streams, nbytes: told.append((streams, nbytes)))
    assert b.resize(1, 60) and b.resize(2, 40) and not b.resize(2, 41)
    assert b.nbytes == 100 and b.refused == 1
    assert b.resize(1, 10) and b.nbytes == 50
    b.release(1)
    b.release(1)  # twice: nothing more
    b.release(2)
    assert told == [(1, 60), (2, 100), (2, 50), (1, 40), (0, 0)] and b.peak == 100
    with pytest.raises(ValueError):
        StateBudget(-1)


# ------------------------------------------------------------------------------------------ served
def _gauge(triton_server, name: str) -> float:
    return counter_total(scrape(triton_server.metrics_url, timeout=30), name, model="cosyvoice_vc_stream")


def test_served_state_is_on_a_gauge_and_freed(triton_server, speech):
    src, ssr, prm, psr = speech
    long_src = np.concatenate([src, src])  # 12 s: 300 tokens, 5 chunks
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
        full = list(c.convert_stream(long_src, prm, source_sr=ssr, prompt_sr=psr, seed=SEED))
        assert len(full) >= 4
        wait_until(lambda: _gauge(triton_server, "cosyvoice_stream_states") == 0, "the ended stream's state freed",
                   interval=0.2)
        assert _gauge(triton_server, "cosyvoice_stream_state_bytes") == 0
        stream = c.convert_stream(long_src, prm, source_sr=ssr, prompt_sr=psr, seed=SEED)
        next(stream)
        wait_until(lambda: _gauge(triton_server, "cosyvoice_stream_state_bytes") > 0, "a stream holding its state",
                   interval=0.2)
        assert _gauge(triton_server, "cosyvoice_stream_states") == 1
        stream.close()  # cancels it on the server
        wait_until(lambda: _gauge(triton_server, "cosyvoice_stream_states") == 0, "the cancelled stream's state freed",
                   interval=0.2)
        assert _gauge(triton_server, "cosyvoice_stream_state_bytes") == 0


def test_the_declared_defaults_are_the_builders():
    from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
    from cosyvoice_triton.serving.stages.stream_state import DEFAULTS

    for name in ("cosyvoice_vc_stream", "cosyvoice_vc_live", "cosyvoice_tts_stream", "cosyvoice_tts_live"):
        declared = {p.name: p.default for p in MODEL_PARAMS[name]}
        assert {k: declared[k] for k in DEFAULTS} == DEFAULTS, name


def test_live_conversion_caches_its_window_and_frees_it(local_pipeline, serving_library, speech):
    """The live session's flow window from the state: the flow graphs run for the final chunk only, the piece sizes
    do not change the audio, and the state is freed at the end and on a cancel."""
    from cosyvoice_triton.serving.stages.live_vc import LiveSettings, LiveVC, convert_pieces

    src, ssr, prm, psr = speech
    first = {"source_sample_rate": np.array([[ssr]], np.int32), "prompt_audio": prm[None],
             "prompt_sample_rate": np.array([[psr]], np.int32), "seed": np.array([[SEED]], np.int64)}
    streamer, inc, calls = _streamer(local_pipeline, serving_library)
    live = LiveVC(streamer, LiveSettings(flow_context_tokens=50))
    out = {}
    for seconds in (0.2, 0.45):
        n = int(seconds * ssr)
        out[seconds] = convert_pieces(live, first, [src[i: i + n] for i in range(0, len(src), n)])
        assert inc.budget.nbytes == 0 and inc.budget.streams == 0 and inc.budget.peak > 0
    assert len(out[0.2]) >= 5 and calls["flow_encoder"] == 2  # the final chunk of each session
    np.testing.assert_array_equal(np.concatenate(out[0.2]), np.concatenate(out[0.45]))
    with pytest.raises(StreamCancelled):
        convert_pieces(live, first, [src[i: i + ssr // 5] for i in range(0, len(src), ssr // 5)],
                       cancelled=lambda: inc.budget.streams > 0)
    assert inc.budget.nbytes == 0 and inc.budget.streams == 0
