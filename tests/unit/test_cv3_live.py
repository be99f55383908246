"""CosyVoice3 live text to speech, in process on the CosyVoice3 demo folder: ``CosyVoice3.tts_live`` (the text in
pieces, decoded by the bistream LM on CosyVoice3's layout: the decoding itself is checked against the official
``inference_bistream`` in test_cv3_llm.py) and ``Cv3Service.live`` (what ``cosyvoice3_tts_live`` serves)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cosyvoice_triton.errors import TextError
from cosyvoice_triton.frontend.text.cosyvoice3 import cross_lingual_text, instruct_text, zero_shot_prompt_text
from cosyvoice_triton.frontend.text.live import LiveText, piece_tokens
from cosyvoice_triton.models.bistream import live_decode
from cosyvoice_triton.models.cosyvoice3.incremental import Flow3StreamState
from cosyvoice_triton.models.cosyvoice3.llm import drop_long_silences
from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
from cosyvoice_triton.serving.stages.lm_engine import JobCancelled

PIECES = ["Hello there, ", "this is a live ", "text that arrives ", "in pieces, ", "as an LLM writes it."]
PROMPT_TEXT = "A short prompt."


@pytest.fixture(scope="module")
def service(cv3_demo_dir) -> Cv3Service:
    return Cv3Service.load(cv3_demo_dir)


@pytest.fixture(scope="module")
def model(service):
    return service.model


def _b(text: str) -> np.ndarray:
    return np.array([[text.encode()]], object)


def _reference_tokens(model, pieces, prompt_text_tokens, prompt_speech_tokens, seed):
    tokens = piece_tokens(model._text().tokenizer, pieces)
    return list(live_decode(model.llm, ([t] for t in tokens), prompt_text_tokens, prompt_speech_tokens,
                            draws=torch.Generator().manual_seed(seed)))


def test_audio_starts_before_the_text_ends_and_is_its_tokens_audio(model, en_speech):
    p, psr, _, _ = en_speech
    read = []

    def pieces():
        for piece in PIECES:
            read.append(piece)
            yield piece

    prompt_text = zero_shot_prompt_text(PROMPT_TEXT)
    live = model.tts_live("zero_shot", pieces(), prompt_wav=p, prompt_sr=psr, prompt_text=prompt_text, seed=2)
    first = next(live)
    at_first = len(read)
    chunks = [first, *live]
    assert at_first < len(PIECES) and len(chunks) >= 2
    assert live.stop_reason in ("eos", "max_len", "unexpected_token")
    speaker = model.prompt(p, prompt_sr=psr, prompt_text=prompt_text)
    # the LM: the official bistream layout (system prompt first), the pieces tokenized one by one
    want = _reference_tokens(model, PIECES, speaker.prompt_text_tokens, speaker.prompt_tokens, 2)
    assert live.decode.tokens == want
    # the audio: those tokens, less long silent runs, through the streaming token-to-wav (incremental, as the
    # model streams by default)
    again = list(model.token2wav_model.token2wav_stream(list(drop_long_silences(want)), speaker.prompt_tokens,
                                                        speaker.prompt_mel, speaker.embedding,
                                                        state=Flow3StreamState()))
    assert [len(c) for c in again] == [len(c) for c in chunks]
    for a, b in zip(again, chunks, strict=True):
        np.testing.assert_array_equal(a, b)


def test_cross_lingual_takes_the_system_prompt_as_its_prompt_text(model, en_speech):
    """The official code asserts a prompt text holding <|endofprompt|>; cross-lingual has none, so the system prompt
    the official examples put in front of a cross-lingual text is its prompt text here (no prompt speech)."""
    p, psr, _, _ = en_speech
    live = model.tts_live("cross_lingual", iter(PIECES), prompt_wav=p, prompt_sr=psr, seed=1)
    audio = np.concatenate(list(live))
    assert audio.size and np.isfinite(audio).all()
    system = model._text().tokenizer.encode(cross_lingual_text(""))
    assert live.decode.tokens == _reference_tokens(model, PIECES, system, [], 1)


def test_instruct2_puts_the_instruction_first(model, en_speech):
    p, psr, _, _ = en_speech
    instruct = instruct_text("Speak slowly.")
    live = model.tts_live("instruct2", iter(PIECES), prompt_wav=p, prompt_sr=psr, instruct_text=instruct, seed=0)
    assert np.concatenate(list(live)).size
    want = _reference_tokens(model, PIECES, model._text().tokenizer.encode(instruct), [], 0)
    assert live.decode.tokens == want


def test_bad_live_requests(model, en_speech):
    p, psr, _, _ = en_speech
    with pytest.raises(TextError, match=r"<\|endofprompt\|> in the prompt text \(zero_shot\)"):
        model.tts_live("zero_shot", iter(PIECES), prompt_wav=p, prompt_sr=psr, prompt_text=PROMPT_TEXT)
    with pytest.raises(TextError, match="invalid UTF-8"):
        list(model.tts_live("cross_lingual", [b"ok \xff"], prompt_wav=p, prompt_sr=psr))
    with pytest.raises(TextError, match="mode must be one of"):
        model.tts_live("sft", iter(PIECES), prompt_wav=p, prompt_sr=psr)


# ------------------------------------------------------------------------------------------------- served


def _first(speech, **extra) -> dict:
    p, psr, _, _ = speech
    return {"prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32),
            "seed": np.array([[4]], np.int64), **extra}


def test_service_live_equals_the_library(service, model, en_speech):
    p, psr, _, _ = en_speech
    feed = LiveText()
    responses = service.live(_first(en_speech, prompt_text=_b(PROMPT_TEXT)), feed)
    for piece in PIECES:
        feed.put(piece.encode())
    feed.end()
    got = list(responses)
    ref = model.tts_live("zero_shot", iter(PIECES), prompt_wav=p, prompt_sr=psr,
                         prompt_text=zero_shot_prompt_text(PROMPT_TEXT), seed=4)
    want = list(ref)
    assert responses.decode.tokens == ref.decode.tokens and responses.stop_reason == ref.stop_reason
    assert [int(r["chunk_index"][0, 0]) for r in got] == list(range(len(want)))
    for r, w in zip(got, want, strict=True):
        assert int(r["sample_rate"][0, 0]) == 24000
        np.testing.assert_array_equal(r["waveform"][0], w)
    assert service._lock.acquire(blocking=False)  # the session gave the instance back
    service._lock.release()


def test_a_session_waiting_for_text_does_not_hold_the_instance(service, en_speech):
    """Session A is open and waits for its next piece; session B on the same instance runs to its end meanwhile
    (it would wait ``wait_timeout_s`` and be refused if A kept the instance), and both answer what they answer
    alone."""
    from cosyvoice_triton.serving.stages.lm_engine import EngineBusy

    waiting = threading.Event()

    class Feed(LiveText):
        def __next__(self):
            if self.asked:
                waiting.set()
            self.asked += 1
            return super().__next__()

    def alone(pieces, seed):
        return [r["waveform"][0] for r in service.live(_first(en_speech, seed=np.array([[seed]], np.int64)),
                                                       iter(pieces))]

    want_a, want_b = alone(PIECES[:2], 1), alone(PIECES[2:], 2)
    feed = Feed([PIECES[0]])
    feed.asked = 0
    got_a: list = []
    a = threading.Thread(target=lambda: got_a.extend(r["waveform"][0] for r in service.live(
        _first(en_speech, seed=np.array([[1]], np.int64)), feed)), daemon=True)
    before = service.wait_timeout_s
    service.wait_timeout_s = 120.0  # far longer than B takes; refused only if A kept the instance
    try:
        a.start()
        assert waiting.wait(120), "A never asked for its second piece"
        try:
            got_b = alone(PIECES[2:], 2)
        except EngineBusy as exc:
            pytest.fail(f"B waited for A's idle session: {exc}")
        feed.put(PIECES[1])
    finally:
        feed.end()
        a.join(120)
        service.wait_timeout_s = before
    assert not a.is_alive()
    for got, want in ((got_a, want_a), (got_b, want_b)):
        assert len(got) == len(want) >= 1
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert service._lock.acquire(blocking=False)
    service._lock.release()


def test_service_live_cancel_bad_pieces_and_bad_first_tensors(service, en_speech):
    feed = LiveText([" ".join(PIECES).encode()], wait_s=60)  # the served session ends its text on a cancel
    gone = threading.Event()
    responses = service.live(_first(en_speech), feed, cancelled=gone.is_set)
    next(responses)  # cross-lingual: the system prompt is in, the LM speaks from the first piece on
    gone.set()
    feed.end()
    with pytest.raises(JobCancelled):
        next(responses)
    assert responses.stop_reason == "cancelled"
    assert service._lock.acquire(blocking=False)
    service._lock.release()
    with pytest.raises(TextError, match="invalid UTF-8"):
        list(service.live(_first(en_speech), iter([b"ok \xff"])))
    with pytest.raises(TextError, match="mode must be one of"):
        service.live(_first(en_speech, mode=_b("sft")), iter(PIECES))
    with pytest.raises(TextError, match="instruct2 needs instruct_text"):  # the library's check, at the first chunk
        list(service.live(_first(en_speech, mode=_b("instruct2")), iter(PIECES)))
    assert service._lock.acquire(blocking=False)
    service._lock.release()
