"""Live voice conversion in process (``serving.stages.live_vc``): the source in pieces against the whole source.

The piece sizes do not change the output; the tokenizer windows are aligned with the whole-utterance tokens (a
tokenizer with local context gives exactly its tokens); chunk ends on the flow's 25-token blocks give exactly the
official streaming schedule's mel (and unaligned ends do not); the state stays bounded over a long stream; bad
pieces are refused naming what is wrong; and the cost of going live against offline conversion (token agreement
with the demo's stand-in tokenizer, log-mel distance, seams), printed and held to bars."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err, speech_pair

from cosyvoice_triton.bench import live_vc as bench
from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.serving.stages.live_vc import (
    SAMPLES_PER_TOKEN,
    LiveSettings,
    LiveVC,
    LiveVCSession,
    convert_pieces,
)
from cosyvoice_triton.serving.stages.vc_stream import VCStreamer
from cosyvoice_triton.streaming import stream_chunk_ends

SEED = 3


@pytest.fixture(scope="module")
def local(serving_assets):
    from cosyvoice_triton.serving.stages.local import LocalPipeline

    return LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")


@pytest.fixture(scope="module")
def speech():
    return speech_pair(5.0, 2.0)


def _streamer(local, **overrides):
    graphs = {k: v.run for k, v in local.graphs.items()}
    graphs.update(overrides)
    return VCStreamer(local.pre, local.flow, graphs)


def _first(ssr, prm, psr):
    return {"source_sample_rate": np.array([[ssr]], np.int32), "prompt_audio": prm[None],
            "prompt_sample_rate": np.array([[psr]], np.int32), "seed": np.array([[SEED]], np.int64)}


def _pieces(y, sizes):
    out, i, k = [], 0, 0
    while i < len(y):
        n = sizes[k % len(sizes)]
        out.append(y[i: i + n])
        i, k = i + n, k + 1
    return out


def test_piece_sizes_do_not_change_the_output(local, speech):
    src, ssr, prm, psr = speech
    live = LiveVC(_streamer(local))
    even = np.concatenate(convert_pieces(live, _first(ssr, prm, psr), _pieces(src, [ssr // 10])))
    ragged = np.concatenate(convert_pieces(live, _first(ssr, prm, psr), _pieces(src, [37, 9001, 2400, 555])))
    assert len(even) == len(ragged) == int(np.ceil(len(src) * 16000 // ssr // 160 / 4)) * 960
    np.testing.assert_allclose(even, ragged, atol=1e-5)


def _local_tokenizer(feeds):
    """A tokenizer whose token i depends on Whisper frames 4i..4i+3 only: the loudest mel bin of their mean."""
    mel, n = np.asarray(feeds["whisper_mel"])[0], int(np.asarray(feeds["whisper_mel_len"]).reshape(-1)[0])
    mel = mel[:, :n]
    tokens = [int(np.argmax(mel[:, i: i + 4].mean(axis=1))) for i in range(0, n, 4)]
    return {"speech_tokens": np.array([tokens], np.int32)}


def test_tokenizer_windows_are_aligned_with_the_whole_utterance(local, speech):
    src, ssr, prm, psr = speech
    streamer = _streamer(local, speech_tokenizer=_local_tokenizer)
    live = LiveVC(streamer, LiveSettings(tokenizer_context_tokens=4, tokenizer_lookahead_tokens=2))
    _, tokens = bench.live_tokens(live, _first(ssr, prm, psr), _pieces(src, [ssr // 5]))
    whole = streamer.tokens(local.pre.source_features(src, ssr))
    np.testing.assert_array_equal(tokens, whole)
    # a window one token off would not be: the check can fail
    shifted = np.concatenate([whole[1:], whole[-1:]])
    assert np.mean(shifted == whole) < 0.9


def _mel_of(streamer, run):
    """The mel frames HiFT is given while ``run()`` runs, joined."""
    t2w, got = streamer.token2wav, []
    hift = t2w._hift

    def recording(mel, cache, generator, *, final):
        got.append(np.array(mel))
        return hift(mel, cache, generator, final=final)

    t2w._hift = recording
    try:
        run()
    finally:
        del t2w._hift
    return np.concatenate(got, axis=1)


@pytest.mark.parametrize("chunk_tokens", [25, 50, 10])
def test_aligned_chunk_ends_keep_the_official_frames(local, speech, chunk_tokens):
    """With the whole-utterance tokens and a flow window covering everything, chunks that end on the flow's 25-token
    blocks give the mel of the official schedule (hops 25, 50, 100) to float rounding; 10-token chunks do not (the
    frames before an unaligned end are computed without the rest of their block)."""
    src, ssr, prm, psr = np.concatenate(speech[0:1] * 2), *speech[1:]
    streamer = _streamer(local)
    whole = streamer.tokens(local.pre.source_features(src, ssr))
    prompt = streamer.prompt(prm, psr)
    official = _mel_of(streamer, lambda: list(streamer.token2wav.chunks(prompt, whole.tolist(), seed=SEED)))

    def commit(self, upto):
        end = len(whole) if upto is None else upto
        self.tokens = np.concatenate([self.tokens, whole[self.committed: end]])

    live = LiveVC(streamer, LiveSettings(chunk_tokens=chunk_tokens, flow_context_tokens=400))

    def run():
        session = LiveVCSession(live, prompt, ssr, seed=SEED)
        session._commit = commit.__get__(session)
        for p in _pieces(src, [ssr // 5]):
            list(session.feed(p))
        list(session.finish())
        assert session.chunks >= 4

    got = _mel_of(streamer, run)
    assert got.shape == official.shape == (80, 2 * len(whole))
    # the final chunks run without the chunk-causal masks (as officially): compare the frames before the official
    # schedule's final chunk, which both computed chunk-causally
    end = 2 * stream_chunk_ends(len(whole), len(prompt.prompt_tokens), lookahead=3)[-1]
    assert end >= 2 * 150
    err = rel_err(got[:, :end], official[:, :end])
    if chunk_tokens % 25 == 0:
        assert err < 1e-4, err
    else:
        assert err > 1e-2, err


def test_state_stays_bounded_over_a_long_stream(local, speech):
    src, ssr, prm, psr = speech
    long = np.concatenate([src] * 6)  # 30 s
    s = LiveSettings(chunk_tokens=25, tokenizer_context_tokens=50, tokenizer_lookahead_tokens=5,
                     flow_context_tokens=50)
    live = LiveVC(_streamer(local), s)
    session = live.open(_first(ssr, prm, psr))
    piece = ssr // 4
    most_wave = (s.tokenizer_context_tokens + 2 * s.chunk_tokens + 25 + 3 + s.tokenizer_lookahead_tokens
                 + piece * 25 // ssr + 2) * SAMPLES_PER_TOKEN
    most_tokens = s.flow_context_tokens + 25 + 2 * s.chunk_tokens + 25 + 3
    out = []
    for i in range(0, len(long), piece):
        out.extend(session.feed(long[i: i + piece]))
        assert len(session.wave) <= most_wave and len(session.tokens) <= most_tokens
    out.extend(session.finish())
    assert session.chunks >= 30
    assert sum(len(c) for c in out) == int(np.ceil(len(long) * 16000 // ssr // 160 / 4)) * 960


@pytest.mark.parametrize("case", ["rate", "empty", "oversized", "after_end", "prompt_again", "rank", "nan"])
def test_bad_pieces_are_refused_and_the_session_goes_on(local, speech, case):
    src, ssr, prm, psr = speech
    live = LiveVC(_streamer(local))
    session = live.open(_first(ssr, prm, psr))
    good = {"source_audio": src[None, : ssr // 2]}
    list(live.piece(session, good, first=True, last=False))
    bad = {"rate": {"source_audio": src[None, :100], "source_sample_rate": np.array([[16000]], np.int32)},
           "empty": {"source_audio": np.zeros((1, 0), np.float32)},
           "oversized": {"source_audio": np.zeros((1, 6 * ssr), np.float32)},
           "after_end": good, "prompt_again": {**good, "prompt_audio": prm[None]},
           "rank": {"source_audio": np.zeros((2, 100), np.float32)},
           "nan": {"source_audio": np.full((1, 100), np.nan, np.float32)}}[case]
    want = {"rate": "started at", "empty": "empty piece", "oversized": "longer than", "after_end": "has ended",
            "prompt_again": "only the first piece", "rank": "mono", "nan": "finite"}[case]
    if case == "after_end":
        list(live.piece(session, good, first=False, last=True))
    before = (session.received, len(session.wave))
    with pytest.raises(CosyVoiceError) as info:
        list(live.piece(session, bad, first=False, last=False))
    assert want in str(info.value)
    assert (session.received, len(session.wave)) == before  # nothing of the bad piece was taken
    if case != "after_end":
        assert sum(len(c) for c in live.piece(session, {"source_audio": src[None, ssr // 2:]}, first=False,
                                              last=True)) > 0


@pytest.mark.parametrize("case", ["no_rate", "no_prompt", "too_short"])
def test_bad_sessions_are_refused(local, speech, case):
    src, ssr, prm, psr = speech
    live = LiveVC(_streamer(local))
    first = _first(ssr, prm, psr)
    if case == "no_rate":
        first.pop("source_sample_rate")
    if case == "no_prompt":
        first = {"source_sample_rate": first["source_sample_rate"]}
    want = {"no_rate": "source_sample_rate", "no_prompt": "prompt", "too_short": "too short"}[case]
    with pytest.raises(CosyVoiceError) as info:
        convert_pieces(live, first, [src[:200]])
    assert want in str(info.value)


def test_the_cost_of_going_live(local, speech, capsys, serving_assets):
    """Against offline conversion of the same source, per bundled speech fixture (printed: ``pytest -s``)."""
    import soundfile as sf
    from conftest import FIXTURES

    from cosyvoice_triton.serving.stages.stream_state import build_incremental

    _, _, prm, psr = speech
    incremental = build_incremental({}, serving_assets["model_dir"], local.config)
    for name in ("source_en_5s.wav", "speech_engb_16k.wav"):
        src, ssr = sf.read(FIXTURES / name, dtype="float32")
        r = bench.measure(local, src, ssr, prm, psr, piece_seconds=0.2, incremental=incremental)
        with capsys.disabled():
            print(f"\n{name}: {r}")
        assert r["tokens_live"] == r["tokens_whole"] and r["samples_live"] == r["samples_offline"]
        # the cached window (served default) computes other frames than the recomputed one, as the window moves
        assert r["log_mel_cached_vs_recompute"] > 0 and np.isfinite(r["log_mel_recompute_vs_offline"])
        # the stand-in tokenizer's every token depends on the whole utterance's mean: agreement is partial
        assert 0 < r["tokens_equal_pct"] <= 100
        assert r["seam_click_max"] <= 1.5 and r["seam_level_min"] >= 0.5 and r["seam_level_max"] <= 2.0
        assert np.isfinite(r["log_mel_live_vs_offline"])
