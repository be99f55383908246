"""Live text to speech: the LM's bistream decoding against the official ``Qwen2LM.inference_bistream``
(tests/fixtures/llm_oracle/bistream_*.npz, made by tests/oracle/make_llm_oracle.py --bistream-only), the text
pieces' tokenization and checks, ``CosyVoice2.tts_live`` and ``TTSService.live`` on the demo model."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from conftest import FIXTURES, rel_err
from lm_oracle import ORACLE, CountedDraws, oracle_config, oracle_meta

from cosyvoice_triton.errors import LLMError, TextError
from cosyvoice_triton.frontend.text.live import LiveText, piece_texts, piece_tokens
from cosyvoice_triton.models.bistream import STOP_REASONS, live_decode
from cosyvoice_triton.models.llm import load_llm
from cosyvoice_triton.shapes import GRAPHS

META = oracle_meta()
CASES = sorted(META["bistream_cases"])
LOGP_BAR = 1e-4
WAVE_BAR = 1e-3


def _case(name: str) -> dict[str, np.ndarray]:
    with np.load(ORACLE / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def _chunks(z) -> list[np.ndarray]:
    return [z["text"][a:b] for a, b in itertools.pairwise(np.cumsum([0, *z["chunk_sizes"]]))]


@pytest.fixture(scope="module")
def lm():
    return load_llm(ORACLE, oracle_config())


def _decode(lm, z, chunks=None, **options):
    draw, logps = CountedDraws(z["draws"]), []
    decode = live_decode(lm, _chunks(z) if chunks is None else chunks, z["prompt_text"], z["prompt_speech_token"],
                         draws=draw, on_step=lambda step, logp: logps.append(logp), **options)
    return list(decode), decode, draw, logps


def test_oracle_covers_the_cases():
    assert len(CASES) >= 7
    runout, left = _case("bistream_runout"), _case("bistream_left")
    # prompt speech runs out mid-text: 15 speech tokens per 5 text tokens, prompt text included
    assert len(runout["prompt_speech_token"]) <= 15 * ((len(runout["prompt_text"]) + len(runout["text"])) // 5)
    # ... and is left over when the text ends
    assert len(left["prompt_speech_token"]) > 15 * ((len(left["prompt_text"]) + len(left["text"])) // 5)
    assert len(_case("bistream_cross_lingual")["prompt_text"]) == 0
    assert max(_case("bistream_chunks")["chunk_sizes"]) > 1 and set(runout["chunk_sizes"]) == {1}
    assert 6563 in _case("bistream_sampled_fill")["sampled"].tolist()
    assert "6562" in str(_case("bistream_raises")["error"])


@pytest.mark.parametrize("name", CASES)
def test_tokens_draws_and_logp_equal_official(lm, name):
    z = _case(name)
    tokens, decode, draw, logps = _decode(lm, z)
    assert tokens == z["tokens"].tolist()
    assert decode.tokens == tokens
    assert draw.used == int(z["draws_used"])
    assert len(logps) == len(z["sampled"])  # one sampling call per official sampling_ids call (forced fills: none)
    for got, ref in zip(logps, z["logp"], strict=False):
        assert rel_err(got.numpy(), ref) < LOGP_BAR
    if str(z["error"]):  # the official code raised ValueError('should not get token 6562')
        assert decode.stop_reason == "unexpected_token" and decode.stop_token == 6562
    else:
        assert decode.stop_reason == "eos" and decode.stop_token == 6561
        assert decode.text_tokens == len(z["text"])
    assert decode.decoded[-1] == int(z["sampled"][-1])


def test_empty_chunks_of_one_token_pieces_change_nothing(lm):
    z = _case("bistream_runout")  # one-token chunks: no backlog of text for an empty chunk to release
    chunks = [c for chunk in _chunks(z) for c in (chunk, np.zeros(0, np.int32))]
    assert _decode(lm, z, chunks)[0] == z["tokens"].tolist()


def test_an_empty_chunk_releases_one_backlogged_text_block_as_officially(lm):
    """The official loop runs its mixing step on every chunk, empty ones included: after a fill, 5 backlogged
    text tokens go in and 15 speech tokens come out. A 12-token chunk then two empty ones: 15 tokens after the
    first chunk, 15 more after the first empty one, none after the second (2 tokens left: the final phase)."""
    made = []

    def chunks():
        yield np.arange(100, 112, dtype=np.int32)
        for _ in range(2):
            made.append(len(decode.tokens))
            yield np.zeros(0, np.int32)
        made.append(len(decode.tokens))

    decode = live_decode(lm, chunks(), draws=torch.Generator().manual_seed(0))
    tokens = list(decode)
    assert made == [15, 30, 30], (made, decode.stop_reason)
    assert decode.text_tokens == 12 and len(tokens) >= 30


def test_step_limit_stops_the_final_phase(lm):
    z = _case("bistream_cross_lingual")
    tokens, decode, _, _ = _decode(lm, z, max_token_text_ratio=3.0)  # the text phase gives 15 per 5: 45 here
    limit = 3 * len(z["text"])
    assert len(tokens) == limit < len(z["tokens"])
    assert tokens == z["tokens"][:limit].tolist()
    assert decode.stop_reason == "max_len" and decode.stop_token == -1


@pytest.mark.parametrize("case,cut", [("bistream_runout", 7), ("bistream_cross_lingual", -1)])
def test_max_tokens_stops_in_either_phase(lm, case, cut):
    """The room of the flow behind the LM: never more tokens than it takes, while text is read (the 7th token) or
    after it (one before the official end)."""
    z = _case(case)
    most = cut if cut > 0 else len(z["tokens"]) + cut
    tokens, decode, _, _ = _decode(lm, z, max_tokens=most)
    assert tokens == z["tokens"][:most].tolist() and decode.stop_reason == "max_len"
    with pytest.raises(LLMError, match="max_tokens"):
        live_decode(lm, _chunks(z), max_tokens=0)


def test_cancelled_stops_before_the_next_step(lm):
    z = _case("bistream_runout")
    holder = {}
    decode = live_decode(lm, _chunks(z), z["prompt_text"], z["prompt_speech_token"], draws=CountedDraws(z["draws"]),
                         cancelled=lambda: len(holder["d"].tokens) >= 7)
    holder["d"] = decode
    tokens = list(decode)
    assert tokens == z["tokens"][:7].tolist()
    assert decode.stop_reason == "cancelled"


def test_out_of_positions_stops(lm):
    z = _case("bistream_runout")
    config = lm.llm.model.config
    saved = config.max_position_embeddings
    config.max_position_embeddings = 60
    try:
        tokens, decode, _, _ = _decode(lm, z)
    finally:
        config.max_position_embeddings = saved
    assert decode.stop_reason == "max_positions"
    assert 0 < len(tokens) < len(z["tokens"]) and tokens == z["tokens"][: len(tokens)].tolist()


def test_bad_live_inputs(lm):
    with pytest.raises(LLMError, match="without a single text token"):
        list(live_decode(lm, [], (), (), draws=0))
    with pytest.raises(LLMError, match="outside"):
        list(live_decode(lm, [[lm.text_vocab_size]], (), (), draws=0))
    with pytest.raises(LLMError, match="prompt_speech_tokens"):
        live_decode(lm, [[1]], (), [6561], draws=0)
    assert set(STOP_REASONS) >= {"eos", "unexpected_token", "max_len", "max_positions", "cancelled"}


# --------------------------------------------------------------------------------------------- text pieces


def test_bytes_split_inside_characters_decode_whole():
    data = "你好, wörld".encode()
    pieces = [data[:1], data[1:4], data[4:5], data[5:9], data[9:]]
    assert "".join(piece_texts(pieces)) == "你好, wörld"
    assert list(piece_texts([b"\xe4", b"\xbd\xa0", "ok"])) == ["你", "ok"]


@pytest.mark.parametrize("pieces, words", [
    ([b"ok", b"\xff"], "invalid UTF-8 at byte 2"),
    ([b"ab", b"c\xe4\xbd", b"x"], "invalid UTF-8 at byte 3"),
    ([b"ok \xe4\xbd"], "ends inside a UTF-8 character"),
    ([b"ok \xe4", "str"], "str piece after bytes"),
    (["ok", "\ud800"], "lone surrogate"),
    (["ok", 5], "expected str or UTF-8 bytes"),
    (["  ", "\n"], "only whitespace"),
    ([], "empty"),
    (["hi [bogus]"], "unknown control tag"),
    (["a" * 6, "b" * 6], "more than the maximum 10"),
])
def test_bad_pieces_raise_text_error(pieces, words):
    with pytest.raises(TextError, match=words.replace("[", r"\[")):
        list(piece_texts(pieces, max_chars=10))


def test_live_text_blocks_until_put_and_ends_with_what_it_has():
    feed = LiveText(["a"])
    got = []
    reader = threading.Thread(target=lambda: got.extend(feed))
    reader.start()
    feed.put("b")
    feed.put(b"c")
    feed.end()
    reader.join(timeout=60)
    assert not reader.is_alive() and got == ["a", "b", b"c"] and not feed.timed_out
    with pytest.raises(TextError, match="after the end"):
        feed.put("d")
    waited = LiveText(["x"], wait_s=0.05)
    assert list(waited) == ["x"] and waited.timed_out and waited.ended


# ----------------------------------------------------------------------------------------- on the demo model


@pytest.fixture(scope="module")
def demo(serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2

    return CosyVoice2.from_pretrained(serving_assets["model_dir"], tts=True)


@pytest.fixture(scope="module")
def prompt_wave():
    import soundfile as sf

    wave, sr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return wave[: int(1.5 * sr)], sr


PIECES = ["Hello th", "ere, this is ", "a live", " test of streaming text in, ", "speech out, ",
          "while the words are still arriving from somewhere far away."]


def test_piece_tokens_tokenize_each_piece_as_given(demo):
    tok = demo._text().tokenizer
    want = [int(t) for p in PIECES for t in tok.encode(p)]
    assert list(piece_tokens(tok, PIECES)) == want
    assert want != tok.encode("".join(PIECES)).tolist()  # a word cut between pieces is two texts, as officially


def test_tts_live_starts_before_the_text_ends_and_equals_its_tokens_audio(demo, prompt_wave):
    wave, sr = prompt_wave
    read = []

    def pieces():
        for p in PIECES:
            read.append(p)
            yield p

    live = demo.tts_live(pieces(), prompt_audio=wave, prompt_sr=sr, prompt_text="the prompt says hello", seed=3)
    first = next(live)
    pieces_at_first = len(read)
    chunks = [first, *live]
    assert pieces_at_first < len(PIECES) and len(chunks) >= 2
    assert live.stop_reason in ("eos", "max_len")
    assert all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
    # the same tokens through the streaming token-to-wav path give the same audio
    speaker = demo.prompt(wave, prompt_sr=sr, prompt_text="the prompt says hello")
    from cosyvoice_triton.pipeline import TTSRequest

    inputs = TTSRequest("", np.zeros(0, np.int32), speaker.prompt_text_tokens, speaker.prompt_tokens,
                        speaker).flow_inputs()
    again = list(demo.tokens2wav_stream(inputs, list(live.decode.tokens), seed=3))
    assert [len(c) for c in again] == [len(c) for c in chunks]
    for a, b in zip(again, chunks, strict=True):
        np.testing.assert_array_equal(a, b)
    # and the LM's tokens are the live decode of the piece tokens with the seed's draws
    ref = live_decode(demo.llm, ([t] for t in piece_tokens(demo._text().tokenizer, PIECES)),
                      speaker.prompt_text_tokens, speaker.prompt_tokens, draws=torch.Generator().manual_seed(3))
    assert list(ref) == live.decode.tokens


def test_tts_live_cross_lingual_and_instruct(demo, prompt_wave):
    wave, sr = prompt_wave
    for kw in ({}, {"instruct": "Speak slowly.<|endofprompt|>"}):
        live = demo.tts_live(iter(PIECES[:3]), prompt_audio=wave, prompt_sr=sr, seed=1, **kw)
        audio = np.concatenate(list(live))
        assert audio.size and np.isfinite(audio).all() and live.stop_reason in ("eos", "max_len")
    with pytest.raises(TextError, match="invalid UTF-8"):
        list(demo.tts_live([b"ok \xff"], prompt_audio=wave, prompt_sr=sr))


@pytest.fixture(scope="module")
def service(serving_assets):
    from cosyvoice_triton.serving.stages.graphs import GraphRunner
    from cosyvoice_triton.serving.stages.tts import TTSService
    from cosyvoice_triton.shapes import GRAPHS

    onnx = serving_assets["onnx_dir"] / "fp32"
    graphs = {g: GraphRunner(g, onnx_path=onnx / f"{g}.onnx").run for g in GRAPHS}
    svc = TTSService(serving_assets["model_dir"], graphs)
    yield svc
    svc.close()


def _tensors(prompt_wave, **extra):
    wave, sr = prompt_wave
    t = {"prompt_audio": wave[None].astype(np.float32), "prompt_sample_rate": np.array([[sr]], np.int32),
         "prompt_text": np.array([[b"the prompt says hello"]], object), "seed": np.array([[4]], np.int64)}
    t.update(extra)
    return t


def test_service_live_equals_tts_live(service, demo, prompt_wave):
    wave, sr = prompt_wave
    feed = LiveText()
    responses = service.live(_tensors(prompt_wave), feed)
    for p in PIECES:
        feed.put(p.encode())
    feed.end()
    got = list(responses)
    ref_live = demo.tts_live(iter(PIECES), prompt_audio=wave, prompt_sr=sr, prompt_text="the prompt says hello",
                             seed=4)
    ref = list(ref_live)
    assert responses.decode.tokens == ref_live.decode.tokens
    assert responses.stop_reason == ref_live.stop_reason
    assert responses.decode.max_tokens == ref_live.decode.max_tokens < GRAPHS["flow_encoder"].axes["tokens"].max
    assert [r["chunk_index"].item() for r in got] == list(range(len(ref)))
    assert [r["waveform"].shape[1] for r in got] == [len(c) for c in ref]
    for r, c in zip(got, ref, strict=True):
        assert r["sample_rate"].item() == 24000
        assert rel_err(r["waveform"][0], c) < WAVE_BAR
    assert service.snapshot()["streams_finished"] >= 1


def test_service_live_cancel_and_bad_pieces(service, prompt_wave):
    from cosyvoice_triton.serving.stages.lm_engine import JobCancelled

    before = service.snapshot()["streams_cancelled"]
    n = {"steps": 0}

    def cancelled():
        n["steps"] += 1
        return n["steps"] > 30

    with pytest.raises(JobCancelled):
        list(service.live(_tensors(prompt_wave), iter(PIECES * 4), cancelled=cancelled))
    assert service.snapshot()["streams_cancelled"] == before + 1
    with pytest.raises(TextError, match="ends inside a UTF-8 character"):
        list(service.live(_tensors(prompt_wave), [b"hello \xc3"]))
    with pytest.raises(TextError, match="invalid UTF-8 at byte 6"):
        list(service.live(_tensors(prompt_wave), [b"hello ", b"\xff"]))
    with pytest.raises(TextError, match="voice prompt is needed"):
        service.live({}, ["hello"])
