"""The official streaming schedule (cosyvoice_triton.streaming), shared by the pipeline and the served streams."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.streaming import stream_chunk_ends, stream_chunks


@pytest.mark.parametrize(("n", "prompt", "ends"), [
    (27, 25, []),                       # 25 + 3 look-ahead tokens not there yet: one final chunk
    (28, 0, [25]),
    (60, 13, [37]),                     # first hop padded by 12 so that prompt + chunk = 50
    (300, 49, [26, 76, 176, 276]),      # hops 25 (+1), 50, 100, 100
    (1000, 1, [49, 99, 199, 299, 399, 499, 599, 699, 799, 899]),
])
def test_chunk_ends_follow_the_official_hops(n, prompt, ends):
    assert stream_chunk_ends(n, prompt, lookahead=3) == ends


def test_chunks_carry_the_lookahead_and_end_with_every_token():
    chunks = list(stream_chunks(iter(range(300)), 49, lookahead=3))  # tokens arriving one by one
    assert [c.offset for c in chunks] == [0, 26, 76, 176, 276]
    assert [len(c.tokens) for c in chunks] == [29, 79, 179, 279, 300]
    assert [c.final for c in chunks] == [False] * 4 + [True]
    np.testing.assert_array_equal(chunks[-1].tokens, np.arange(300, dtype=np.int32))
    assert chunks[0].tokens.dtype == np.int32


def _official_runtime_loop(n_tokens: int, lookahead: int = 3) -> list[tuple[int, int]]:
    """The official CosyVoice3 Triton runtime's streaming loop (model_repo_cosyvoice3/cosyvoice3/1/model.py,
    ``_process_request_streaming`` with dynamic_chunk_strategy "exponential") on ``n_tokens`` tokens arriving one
    by one: (token_offset, tokens passed to token2wav) of each non-final chunk."""
    calls, offset, hop, index = [], 0, 15, 0
    for got in range(1, n_tokens + 1):
        while got - offset >= hop + lookahead:
            calls.append((offset, offset + hop + lookahead))
            offset += hop
            hop = 25 * 2 ** index
            index += 1
    return calls


@pytest.mark.parametrize(("n", "prompt"), [(17, 30), (18, 0), (60, 13), (400, 49), (3000, 1)])
def test_the_runtime_schedule_is_the_official_runtime_s(n, prompt):
    from cosyvoice_triton.streaming import SCHEDULES, RuntimeSchedule

    chunks = list(stream_chunks(iter(range(n)), prompt, lookahead=3, schedule=RuntimeSchedule()))
    assert [(c.offset, len(c.tokens)) for c in chunks[:-1]] == _official_runtime_loop(n)
    assert chunks[-1].final and len(chunks[-1].tokens) == n
    assert SCHEDULES["runtime"] == RuntimeSchedule()
    if n == 400:
        assert [c.offset for c in chunks] == [0, 15, 40, 90, 190, 390]  # no pad, whatever the prompt


def test_no_tokens_is_an_error():
    with pytest.raises(CosyVoiceError, match="no speech tokens"):
        list(stream_chunks([], 10, lookahead=3))
    assert stream_chunk_ends(0, 10, lookahead=3) == []


# ------------------------------------------------------------------------------------ tunable schedules


@pytest.mark.parametrize(("n", "prompt"), [(27, 25), (60, 13), (300, 49), (1000, 1), (777, 0), (5000, 24)])
def test_the_default_schedule_is_the_official_one(n, prompt):
    from cosyvoice_triton.streaming import StreamSchedule

    official = stream_chunk_ends(n, prompt, lookahead=3)
    assert stream_chunk_ends(n, prompt, lookahead=3, schedule=StreamSchedule()) == official
    assert stream_chunk_ends(n, prompt, lookahead=3, schedule=StreamSchedule(25, 2, 100, chunk=25)) == official


@pytest.mark.parametrize(("schedule", "prompt", "ends"), [
    ((10, 5, 100), 13, [12, 62, 162, 262]),      # 10 padded by 2 (13 + 12 = 25), then 50, 100, 100
    ((5, 5, 100), 0, [25, 50, 150, 250]),         # 5 padded to the boundary 25, then 25, 100, 100
    ((25, 1, 25), 0, [25, 50, 75, 100, 125, 150, 175, 200, 225, 250, 275]),
    ((50, 2, 200), 10, [65, 165]),                # 50 padded by 15, then 100, then 200 (after 165 + 200 + 3 > 300)
])
def test_tunable_schedules_keep_every_chunk_on_a_boundary(schedule, prompt, ends):
    from cosyvoice_triton.streaming import StreamSchedule

    s = StreamSchedule(*schedule)
    got = stream_chunk_ends(300, prompt, lookahead=3, schedule=s)
    assert got == ends
    assert all((prompt + e) % 25 == 0 for e in got)
    assert got[0] == s.first_chunk(prompt)
    chunks = list(stream_chunks(iter(range(300)), prompt, lookahead=3, schedule=s))
    assert [c.offset for c in chunks] == [0, *got] and chunks[-1].final
    assert [len(c.tokens) for c in chunks[:-1]] == [e + 3 for e in got]


def test_random_schedules_and_prompts_stay_aligned():
    from cosyvoice_triton.streaming import StreamSchedule

    g = np.random.default_rng(0)
    for _ in range(200):
        first, growth = int(g.integers(1, 60)), int(g.integers(1, 6))
        max_hop = 25 * int(g.integers(max(1, -(-first // 25)), 9))
        try:
            s = StreamSchedule(first, growth, max_hop)
        except Exception:
            continue
        prompt, n = int(g.integers(0, 200)), int(g.integers(1, 800))
        ends = stream_chunk_ends(n, prompt, lookahead=3, schedule=s)
        assert all((prompt + e) % 25 == 0 for e in ends)
        hops = np.diff([0, *ends])
        assert all(h <= max(max_hop, s.first_chunk(prompt)) for h in hops)
        assert not ends or ends[-1] + 3 <= n


@pytest.mark.parametrize(("args", "words"), [
    ((15, 2, 100), "30 is not"),                  # the official Triton runtime's first hop, doubled: off the grid
    ((25, 2, 110), "110 is not"),
    ((10, 2, 100), "20 is not"),
    ((25, 1, 100), None),                         # valid: constant hops of 25
    ((0, 2, 100), "stream_first_hop must be an integer >= 1"),
    ((25, 0, 100), "stream_hop_growth must be an integer >= 1"),
    ((50, 2, 25), "stream_max_hop .25. must be >= stream_first_hop .50."),
    ((True, 2, 100), "stream_first_hop must be an integer"),
])
def test_schedules_off_the_chunk_grid_are_config_errors(args, words):
    from cosyvoice_triton.errors import ConfigError
    from cosyvoice_triton.streaming import StreamSchedule

    if words is None:
        assert StreamSchedule(*args).later_hops() == [25]
        return
    with pytest.raises(ConfigError, match=words):
        StreamSchedule(*args)


def test_tunables_render_the_schedule_and_refuse_a_bad_one():
    from cosyvoice_triton.serving.repository import RenderError, Tunables
    from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS

    names = {"stream_first_hop", "stream_hop_growth", "stream_max_hop"}
    for model in ("cosyvoice_tts_stream", "cosyvoice_vc_stream"):
        assert names <= {p.name for p in MODEL_PARAMS[model]}
    assert Tunables(stream_first_hop=10, stream_hop_growth=5).stream_params() == {
        "stream_first_hop": 10, "stream_hop_growth": 5, "stream_max_hop": 100}
    with pytest.raises(RenderError, match="tunables stream_.*30 is not"):
        Tunables(stream_first_hop=15)
    with pytest.raises(RenderError, match="lm_precision must be fp32 or int8"):
        Tunables(lm_precision="int4")


def _vc_inputs(model, n=120, prompt=37):
    from cosyvoice_triton.pipeline import VCInputs

    g = np.random.default_rng(1)
    vocab = model.config.flow.vocab_size
    return VCInputs(source_tokens=g.integers(0, vocab, n).astype(np.int32),
                    prompt_tokens=g.integers(0, vocab, prompt).astype(np.int32),
                    prompt_mel=g.normal(-6, 2, (2 * prompt, 80)).astype(np.float32),
                    embedding=g.normal(size=192).astype(np.float32))


def test_pipeline_schedule_default_equals_today_and_a_profile_differs(oracle_model):
    from cosyvoice_triton.bench.stream_schedule import measure
    from cosyvoice_triton.errors import ConfigError
    from cosyvoice_triton.streaming import StreamSchedule

    inputs = _vc_inputs(oracle_model)
    today = list(oracle_model.token2wav_stream(inputs, seed=2))
    explicit = list(oracle_model.token2wav_stream(inputs, seed=2, schedule=StreamSchedule()))
    assert len(today) == len(explicit) == 3  # ends 38, 88 after a prompt of 37
    for a, b in zip(today, explicit, strict=True):
        np.testing.assert_array_equal(a, b)
    rows = measure(oracle_model, inputs, [StreamSchedule(), StreamSchedule(10, 5, 100)], seed=2)
    assert rows[0]["log_mel_distance"] == 0.0 and rows[0]["chunk_ends"] == [38, 88]
    assert rows[1]["chunk_ends"] == [13, 63] and rows[1]["first_chunk_tokens"] == 16
    assert rows[1]["samples"] == rows[0]["samples"]  # the same audio length, chunked elsewhere
    assert 0 < rows[1]["log_mel_distance"] < 5
    with pytest.raises(ConfigError, match="aligned to 50-token chunks"):
        list(oracle_model.token2wav_stream(inputs, schedule=StreamSchedule(50, 2, 100, chunk=50)))


def test_served_streamer_takes_the_schedule(oracle_model, tiny_dir):
    from cosyvoice_triton.errors import ConfigError
    from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
    from cosyvoice_triton.serving.stages.vc_stream import build_streamer, stream_schedule
    from cosyvoice_triton.streaming import StreamSchedule

    params = {"stream_first_hop": 10, "stream_hop_growth": 5, "stream_max_hop": 100}
    assert stream_schedule(params, oracle_model.config) == StreamSchedule(10, 5, 100)
    defaults = {p.name: p.default for p in MODEL_PARAMS["cosyvoice_vc_stream"]}
    streamer = build_streamer({**defaults, "model_dir": str(tiny_dir), **params}, lambda model, graph: None, None)
    assert streamer.token2wav.schedule == StreamSchedule(10, 5, 100)
    assert stream_schedule({}) == StreamSchedule()
    with pytest.raises(ConfigError, match="30 is not"):
        stream_schedule({"stream_first_hop": 15}, oracle_model.config)
