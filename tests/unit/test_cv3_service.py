"""``Cv3Service``, CosyVoice3 behind the served tensors (``cosyvoice3_tts_stream``, ``cosyvoice3_vc``), in process
on the CosyVoice3 demo folder: the answers are the library's ``CosyVoice3`` answers, and bad requests name what
is wrong."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.frontend.text.cosyvoice3 import resolve_mode, with_system_prompt
from cosyvoice_triton.frontend.text.tokenizer import ENDOFPROMPT
from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
from cosyvoice_triton.serving.stages.lm_engine import EngineBusy, JobCancelled

TEXT = "Hello there, how are you today?"
PROMPT_TEXT = "A short prompt."


@pytest.fixture(scope="module")
def folder(cv3_demo_dir):
    return cv3_demo_dir


@pytest.fixture(scope="module")
def service(folder) -> Cv3Service:
    return Cv3Service.load(folder)


@pytest.fixture(scope="module")
def speech(en_speech):
    return en_speech


def _b(text: str) -> np.ndarray:
    return np.array([[text.encode()]], object)


def _tts(speech, **extra) -> dict:
    p, psr, _, _ = speech
    return {"text": _b(TEXT), "prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32), **extra}


def test_mode_from_the_inputs_and_cosyvoice2_name():
    assert resolve_mode(None, "p", None) == "zero_shot"
    assert resolve_mode(None, None, "be calm") == "instruct2"
    assert resolve_mode(None, None, None) == "cross_lingual"
    assert resolve_mode(" instruct ", None, "x") == "instruct2"
    with pytest.raises(CosyVoiceError, match="mode must be one of"):
        resolve_mode("sft", None, None)


def test_system_prompt_added_only_where_missing():
    text, prompt, instruct = with_system_prompt("zero_shot", TEXT, PROMPT_TEXT, None)
    assert prompt.endswith(ENDOFPROMPT + PROMPT_TEXT) and text == TEXT and instruct is None
    given = "Speak slowly." + ENDOFPROMPT + PROMPT_TEXT
    assert with_system_prompt("zero_shot", TEXT, given, None)[1] == given
    assert with_system_prompt("instruct2", TEXT, None, "Speak slowly.")[2].endswith("Speak slowly." + ENDOFPROMPT)
    assert ENDOFPROMPT in with_system_prompt("cross_lingual", TEXT, None, None)[0]


def test_stream_chunks_are_the_library_chunks(service, speech):
    p, psr, _, _ = speech
    got = list(service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT))))
    want = list(service.model.tts_stream("zero_shot", TEXT, prompt_text=with_system_prompt(
        "zero_shot", TEXT, PROMPT_TEXT, None)[1], prompt_wav=p, prompt_sr=psr, stream=True, seed=0))
    assert len(got) == len(want) >= 2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["waveform"].shape == (1, w.size) and g["waveform"].dtype == np.float32
        np.testing.assert_array_equal(g["waveform"][0], w)
        assert int(g["chunk_index"][0, 0]) == i and int(g["sample_rate"][0, 0]) == service.sample_rate == 24000


def test_whole_answer_with_speed_and_seed(service, speech):
    p, psr, _, _ = speech
    req = _tts(speech, instruct_text=_b("Speak slowly."), stream=np.array([[False]]),
               speed=np.array([[1.5]], np.float32), seed=np.array([[7]], np.int64))
    got = np.concatenate([r["waveform"][0] for r in service.responses(req)])
    want = np.concatenate(list(service.model.tts_stream(
        "instruct2", TEXT, instruct_text=with_system_prompt("instruct2", TEXT, None, "Speak slowly.")[2],
        prompt_wav=p, prompt_sr=psr, stream=False, speed=1.5, seed=7)))
    np.testing.assert_array_equal(got, want)


def test_conversion_is_the_library_conversion(service, speech):
    p, psr, s, ssr = speech
    out = service.convert({"source_audio": s[None], "source_sample_rate": np.array([[ssr]], np.int32),
                           "prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32)})
    np.testing.assert_array_equal(out["waveform"][0], service.model.vc(s, p, source_sr=ssr, prompt_sr=psr))
    assert int(out["sample_rate"][0, 0]) == 24000


@pytest.mark.parametrize("extra, drop, match", [
    ({}, "text", "text: missing"),
    ({}, "prompt_audio", "prompt_audio"),
    ({"mode": _b("sft")}, None, "mode must be one of"),
    ({"speed": np.array([[2.0]], np.float32)}, None, "speed: only non-streaming"),
    ({"speaker_id": _b("alice")}, None, "speaker_id: registered speakers are not served for CosyVoice3"),
    ({"prompt_sample_rate": np.array([[0]], np.int32)}, None, "prompt_sample_rate"),
])
def test_bad_tts_requests_name_what_is_wrong(service, speech, extra, drop, match):
    req = {**_tts(speech), **extra}
    if drop:
        req.pop(drop)
    if drop == "prompt_audio":
        req.pop("prompt_sample_rate")
        match = "a voice prompt is needed"
    with pytest.raises(CosyVoiceError, match=match):
        list(service.responses(req))


def test_conversion_refuses_a_seed(service, speech):
    p, psr, s, ssr = speech
    with pytest.raises(CosyVoiceError, match="seed: CosyVoice3's vocoder noise"):
        service.convert({"source_audio": s[None], "source_sample_rate": np.array([[ssr]], np.int32),
                         "prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32),
                         "seed": np.array([[1]], np.int64)})


def test_a_busy_instance_refuses_after_its_wait(service, speech):
    held, release = threading.Event(), threading.Event()

    def hold():
        with service._held():
            held.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(60)
        service.wait_timeout_s, before = 0.05, service.wait_timeout_s
        try:
            with pytest.raises(EngineBusy, match="busy"):
                list(service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT))))
        finally:
            service.wait_timeout_s = before
    finally:
        release.set()
        t.join(60)
    assert len(list(service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT))))) >= 1  # the lock came back


def test_a_cancelled_stream_stops_and_frees_the_instance(service, speech):
    with pytest.raises(JobCancelled):
        list(service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT)), cancelled=lambda: True))
    assert service._lock.acquire(timeout=1)
    service._lock.release()


def test_output_rate_resamples(service, speech):
    low = Cv3Service(service.model, output_sample_rate=16000)
    chunks = list(low.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT))))
    assert all(int(c["sample_rate"][0, 0]) == 16000 for c in chunks)
    full = list(service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT))))
    n_low, n_full = sum(c["waveform"].size for c in chunks), sum(c["waveform"].size for c in full)
    assert abs(n_low - n_full * 2 / 3) <= 2 * len(chunks)


def test_text_limits_are_the_services(service, folder, speech):
    small = Cv3Service(service.model)
    limited = Cv3Service.load(folder, text_limits={"max_chars": 40, "max_digit_run": 4})
    long_text = {"text": _b("word " * 9)}  # 45 characters
    with pytest.raises(CosyVoiceError, match="40"):
        list(limited.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT), **long_text)))
    with pytest.raises(CosyVoiceError, match="digit"):
        list(limited.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT), text=_b("call 123456"))))
    assert len(list(small.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT), **long_text)))) >= 1
