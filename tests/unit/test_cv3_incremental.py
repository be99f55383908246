"""CosyVoice3's incremental streamed flow (``models/cosyvoice3/incremental.py``) against the official recompute.

Each non-final chunk computed from the stream's state equals ``flow.inference`` on every token so far (float
rounding), on the official hops and on the official Triton runtime's (whose first hop ends inside an attention
chunk), while the DiT runs only on the frames the state does not hold; the whole stream (with the vocoder window)
equals the official streaming path; the state's bytes are what the budget was asked for, its caps make the stream
recompute from there, and it is released however the stream ends. Served: the TTS models' budget and gauge.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FEAT_BAR, FIXTURES, oracle_meta, rel_err, waveform_bar

from cosyvoice_triton.models.cosyvoice3.flow import Flow3Dims
from cosyvoice_triton.models.cosyvoice3.incremental import Flow3StreamState, cache_bytes_per_frame3, incremental_chunk3
from cosyvoice_triton.models.cosyvoice3.token2wav import Token2Wav3, stream_chunk_ends
from cosyvoice_triton.streaming import RuntimeSchedule

CHUNK_BAR = FEAT_BAR  # a chunk's mel against the recompute (relative max error; measured ~2e-7)
#: The audio: the vocoder's phase accumulation turns the mel's float rounding into ~5e-4 of the waveform (measured
#: 5e-4 to 7e-4 here, the vocoder window alone 4e-7), so the bar of the official parity's streamed zero-shot case.
STREAM_BAR = waveform_bar(oracle_meta(FIXTURES / "cv3_pipeline_oracle")["cases"]["zero_shot_stream"]["waveform_spread"])


@pytest.fixture(scope="module")
def model(cv3_demo_dir):
    from cosyvoice_triton.models.cosyvoice3.pipeline import CosyVoice3

    return CosyVoice3.from_pretrained(cv3_demo_dir)


@pytest.fixture(scope="module")
def t2w(model) -> Token2Wav3:
    return model.token2wav_model


def _inputs(flow, prompt_tokens: int = 37, source: int = 260, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = flow.dims.vocab_size
    pt = torch.randint(0, vocab, (1, prompt_tokens), generator=g, dtype=torch.int32)
    pf = torch.randn(1, 2 * prompt_tokens, 80, generator=g) - 5
    emb = torch.randn(1, 192, generator=g)
    src = torch.randint(0, vocab, (1, source), generator=g, dtype=torch.int32)
    return src, pt, pf, emb


class _FrameCount:
    """Counts the frames the DiT's input projection sees (every step, both CFG rows)."""

    def __init__(self, dit):
        self.frames: list[int] = []
        self.handle = dit.input_embed.proj.register_forward_hook(lambda m, i, o: self.frames.append(o.shape[1]))

    def close(self):
        self.handle.remove()


@pytest.mark.parametrize("schedule", ["official", "runtime"])
def test_each_chunk_equals_the_recompute_and_computes_only_what_it_lacks(t2w, schedule):
    flow = t2w.flow
    src, pt, pf, emb = _inputs(flow)
    sched = RuntimeSchedule() if schedule == "runtime" else t2w.schedule
    ends = stream_chunk_ends(src.shape[1], pt.shape[1], flow.dims, schedule=sched)
    assert len(ends) >= 3
    n_steps, chunk, look = flow.decoder.config.n_timesteps, flow.decoder.estimator.static_chunk_size, 3
    state, count = Flow3StreamState(), _FrameCount(flow.decoder.estimator)
    partial = 0
    try:
        for end in ends:
            tokens = src[:, : end + look]
            lo = state.frames
            with torch.inference_mode():
                ref, _ = flow.inference(tokens, pt, pf, emb, streaming=True, finalize=False)
                count.frames.clear()
                got = incremental_chunk3(flow, state, tokens, pt, pf, emb)
            assert got is not None and got.shape == ref.shape
            assert float((got - ref).abs().max() / ref.abs().max()) < CHUNK_BAR
            total = 2 * (pt.shape[1] + end)
            # the DiT saw only the frames from the first unsettled one on, at every step
            assert count.frames == [total - lo] * n_steps
            assert state.frames == total // chunk * chunk
            partial += state.frames != total
            assert state.nbytes() == _expected_bytes(flow, state.frames, total)
    finally:
        count.close()
    assert state.chunks == len(ends)
    if schedule == "runtime":  # its 15-token first hop ends inside an attention chunk: recomputed next time
        assert partial >= 1


def _expected_bytes(flow, settled: int, capacity: int) -> int:
    """The settled frames' mel, the keys / values of ``capacity`` frames (the last call's), the convolutions' tails."""
    d, n = flow.dims.dit, flow.decoder.config.n_timesteps
    tails = 4 * n * 2 * 2 * (d.conv_pos_kernel - 1) * d.dim
    mel = 4 * d.out_channels
    return settled * mel + capacity * (cache_bytes_per_frame3(flow.dims, n) - mel) + tails


def test_release_dims_figure():
    # 10 steps x 2 CFG rows x 22 blocks x (K + V) x 1024 x 4 bytes, plus the frame's mel
    assert cache_bytes_per_frame3(Flow3Dims.full()) == 4 * (10 * 2 * 22 * 2 * 1024 + 80) == 3_604_800


def _stream(t2w, src, pt, pf, emb, **kw) -> list[np.ndarray]:
    return list(t2w.token2wav_stream(src[0].tolist(), pt[0].numpy(), pf[0].numpy(), emb[0].numpy(), **kw))


class _Budget:
    def __init__(self, limit: int = 1 << 40):
        self.limit, self.held, self.asked, self.released = limit, 0, [], 0

    def reserve(self, n: int) -> bool:
        self.asked.append(n)
        if n > self.limit:
            return False
        self.held = n
        return True

    def release(self):
        self.released += 1
        self.held = 0

    def state(self, max_bytes: int = 1 << 40) -> Flow3StreamState:
        return Flow3StreamState(max_bytes, reserve=self.reserve, release=self.release)


@pytest.mark.parametrize("schedule", [None, RuntimeSchedule()], ids=["official", "runtime"])
def test_the_stream_equals_the_official_recompute(t2w, schedule):
    src, pt, pf, emb = _inputs(t2w.flow, source=230, seed=1)
    official = _stream(t2w, src, pt, pf, emb, schedule=schedule)
    budget = _Budget()
    state = budget.state()
    got = _stream(t2w, src, pt, pf, emb, schedule=schedule, state=state)
    assert [len(c) for c in got] == [len(c) for c in official] and len(got) >= 3
    assert rel_err(np.concatenate(got), np.concatenate(official)) < STREAM_BAR
    assert state.chunks == len(got) - 1  # every non-final chunk from the state; the final one recomputed
    assert not state.active and state.nbytes() == 0 and budget.released == 1 and budget.held == 0
    # the budget was asked, before each chunk, for exactly what the state then held: the settled frames (whole
    # attention chunks) and the keys / values of every frame of the call
    ends = stream_chunk_ends(src.shape[1], pt.shape[1], t2w.flow.dims, schedule=schedule or t2w.schedule)
    totals = [2 * (pt.shape[1] + end) for end in ends]
    assert budget.asked == [_expected_bytes(t2w.flow, t // 50 * 50, t) for t in totals]


@pytest.mark.parametrize("how", ["cap", "budget"])
def test_a_stream_past_its_cap_recomputes_from_there(t2w, how):
    src, pt, pf, emb = _inputs(t2w.flow, source=230, seed=2)
    official = _stream(t2w, src, pt, pf, emb)
    first = 2 * (pt.shape[1] + t2w.stream_chunk_ends(src.shape[1], pt.shape[1])[0])
    room = _expected_bytes(t2w.flow, first // 50 * 50, first)  # the first chunk fits, the second does not
    budget = _Budget(limit=room if how == "budget" else 1 << 40)
    state = budget.state(max_bytes=room if how == "cap" else 1 << 40)
    stream = t2w.token2wav_stream(src[0].tolist(), pt[0].numpy(), pf[0].numpy(), emb[0].numpy(), state=state)
    got = [next(stream), next(stream)]
    # the second chunk found no room: the state is given back at once, not when the stream ends
    assert state.chunks == 1 and not state.active and budget.released == 1 and budget.held == 0
    got += list(stream)
    assert budget.released == 1
    assert [len(c) for c in got] == [len(c) for c in official]
    assert rel_err(np.concatenate(got), np.concatenate(official)) < STREAM_BAR


def test_a_stream_left_early_releases_its_state(t2w):
    src, pt, pf, emb = _inputs(t2w.flow, source=230, seed=3)
    budget = _Budget()
    state = budget.state()
    stream = t2w.token2wav_stream(src[0].tolist(), pt[0].numpy(), pf[0].numpy(), emb[0].numpy(), state=state)
    next(stream)
    assert budget.held > 0 and state.nbytes() == budget.held
    stream.close()  # the client went away
    assert budget.released == 1 and budget.held == 0 and state.nbytes() == 0


def test_served_budget_and_gauge(model):
    from cosyvoice_triton.serving.stages.cosyvoice3 import stream_states

    told = []
    prompt = {"prompt_wav": str(FIXTURES / "prompt_en_3s.wav"),
              "prompt_text": "You are a helpful assistant.<|endofprompt|>Hello there, this is my voice."}
    text = "A stream long enough for several chunks of speech, one after the other."
    try:
        model.incremental_stream = False
        official = list(model.tts_zero_shot_stream(text, seed=4, **prompt))
        budget = stream_states(model, {"stream_state_mb": 2048.0, "stream_state_total_mb": 4096.0},
                               on_change=lambda streams, nbytes: told.append((streams, nbytes)))
        assert model.incremental_stream and budget is not None
        got = list(model.tts_zero_shot_stream(text, seed=4, **prompt))
        assert len(official) >= 2 and [len(c) for c in got] == [len(c) for c in official]
        assert rel_err(np.concatenate(got), np.concatenate(official)) < STREAM_BAR
        assert budget.peak > 0 and budget.nbytes == 0 and budget.streams == 0
        assert told[0][0] == 1 and told[0][1] > 0 and told[-1] == (0, 0)
        # off: the official recompute, no budget
        assert stream_states(model, {"stream_state": False}) is None and not model.incremental_stream
    finally:
        model.incremental_stream, model.stream_state = True, None


def test_the_bench_runs_both_paths_on_cosyvoice3(cv3_demo_dir):
    from cosyvoice_triton.bench.incremental import run

    r = run(str(cv3_demo_dir), tokens=120, prompt_tokens=30, rounds=1, threads=1)
    assert r["family"] == "cosyvoice3" and len(r["chunk_ends"]) >= 2
    assert r["recompute_s"] > 0 and r["incremental_s"] > 0 and 0 < r["audio_rel_diff"] < STREAM_BAR
    # one time per chunk, the final one included
    assert len(r["chunk_recompute_s"]) == len(r["chunk_incremental_s"]) == len(r["chunk_ends"]) + 1
    assert min(r["chunk_incremental_s"]) > 0
    assert r["cache_mb_per_frame"] == cache_bytes_per_frame3(Flow3Dims.tiny()) / 1e6

