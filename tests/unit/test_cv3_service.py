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


def test_a_request_may_ask_for_the_official_runtime_s_hops(service, speech):
    """``stream_schedule=runtime``: the library's stream with :class:`RuntimeSchedule` (15 tokens first);
    ``official``: the default hops."""
    from cosyvoice_triton.streaming import RuntimeSchedule

    p, psr, _, _ = speech
    prompt_text = with_system_prompt("zero_shot", TEXT, PROMPT_TEXT, None)[1]
    runtime = [r["waveform"][0] for r in service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT),
                                                                 stream_schedule=_b("runtime")))]
    want = list(service.model.tts_stream("zero_shot", TEXT, prompt_text=prompt_text, prompt_wav=p, prompt_sr=psr,
                                         stream=True, seed=0, schedule=RuntimeSchedule()))
    assert [g.size for g in runtime] == [w.size for w in want] and len(want) >= 2
    assert runtime[0].size == (2 * 15 - 8) * 480
    np.testing.assert_array_equal(np.concatenate(runtime), np.concatenate(want))
    official = [r["waveform"][0] for r in service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT),
                                                                  stream_schedule=_b("official")))]
    default = [r["waveform"][0] for r in service.responses(_tts(speech, prompt_text=_b(PROMPT_TEXT)))]
    assert [g.size for g in official] == [g.size for g in default] != [g.size for g in runtime]


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
    ({"speaker_id": _b("alice")}, "prompt_audio", "speaker_id: this server has no CosyVoice3 speakers model"),
    ({"speaker_id": _b("alice")}, None, "prompt audio or a speaker_id, not both"),
    ({"prompt_sample_rate": np.array([[0]], np.int32)}, None, "prompt_sample_rate"),
    ({"stream_schedule": _b("fast")}, None, "stream_schedule must be one of official, runtime"),
    ({"stream_schedule": _b("runtime"), "stream": np.array([[False]])}, None, "only streamed answers"),
])
def test_bad_tts_requests_name_what_is_wrong(service, speech, extra, drop, match):
    req = {**_tts(speech), **extra}
    if drop:
        req.pop(drop)
    if drop == "prompt_audio":
        req.pop("prompt_sample_rate")
        match = match if "speaker_id" in extra else "a voice prompt is needed"
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


class _Gate:
    """The CosyVoice3 model with its ``vc`` and ``tts_stream`` held at a gate: each call waits until ``parties``
    calls are inside (a barrier: a serialised service never gets there) and then until :attr:`release` is set."""

    def __init__(self, model, parties: int):
        self._model, self.inside, self.release = model, threading.Barrier(parties, timeout=120), threading.Event()
        self.all_in = threading.Event()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _wait(self):
        if self.inside.wait() == 0:
            self.all_in.set()
        assert self.release.wait(120)

    def vc(self, *a, **k):
        self._wait()
        return self._model.vc(*a, **k)

    def tts_stream(self, *a, **k):
        self._wait()
        yield from self._model.tts_stream(*a, **k)


def test_requests_computing_at_once_in_one_instance_get_their_answers_alone(service, speech):
    """``concurrency=3``: two conversions and a streamed TTS request compute at the same time on one copy of the
    weights (all three inside the model at once) and each answer is bit for bit the one computed alone; a fourth
    request finds every place taken and is refused after ``wait_timeout_s``."""
    p, psr, s, ssr = speech

    def vc(seconds):
        return {"source_audio": s[None, :int(seconds * ssr)], "source_sample_rate": np.array([[ssr]], np.int32),
                "prompt_audio": p[None], "prompt_sample_rate": np.array([[psr]], np.int32)}

    def run(svc, kind, t):
        if kind == "vc":
            return svc.convert(t)["waveform"]
        return np.concatenate([r["waveform"].reshape(-1) for r in svc.responses(t)])

    jobs = [("vc", vc(5.0)), ("vc", vc(3.0)), ("tts", _tts(speech, prompt_text=_b(PROMPT_TEXT)))]
    alone = [run(service, *job) for job in jobs]
    gate = _Gate(service.model, 3)
    wide = Cv3Service(gate, concurrency=3, wait_timeout_s=0.05)
    out: list = [None] * 3
    errors: list = []

    def work(i):
        try:
            out[i] = run(wide, *jobs[i])
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        assert gate.all_in.wait(120), f"the three requests never computed at once: {errors}"
        with pytest.raises(EngineBusy, match=r"3 request\(s\) at a time per instance"):
            wide.convert(vc(2.0))
    finally:
        gate.release.set()
        for t in threads:
            t.join(300)
    assert not errors, errors
    for got, want in zip(out, alone, strict=True):
        np.testing.assert_array_equal(got, want)


def test_tts_requests_at_once_decode_in_one_lm_batch_and_get_their_answers_alone(service, speech):
    """``concurrency=3``: three TTS requests (seeds 1-3, different texts) submit their LM requests together (a
    barrier) to the instance's in-flight batch; the engine stepped them together (widest batch 3, more request steps
    than steps) and each answer is bit for bit the one computed alone on a decoder of its own."""
    texts = ["Hello there, this is a test.", "Another sentence, a bit longer than the first one.", "Short."]
    jobs = [_tts(speech, text=_b(t), prompt_text=_b(PROMPT_TEXT), seed=np.array([[i + 1]], np.int64))
            for i, t in enumerate(texts)]

    def run(svc, t):
        return np.concatenate([r["waveform"].reshape(-1) for r in svc.responses(t)])

    model = service.model
    assert model.lm_submit is None and service.engine is None  # concurrency 1: no engine
    alone = [run(service, t) for t in jobs]
    wide = Cv3Service(model, concurrency=3)
    together = threading.Barrier(3, timeout=120)
    model.lm_submit = lambda request: (together.wait(), wide.engine.stream(request))[1]
    out: list = [None] * 3
    errors: list = []

    def work(i):
        try:
            out[i] = run(wide, jobs[i])
        except Exception as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stats = wide.engine.snapshot()
    finally:
        model.lm_submit = None
        wide.close()
    assert not errors, errors
    assert stats["max_batch"] == 3 and stats["request_steps"] > stats["steps"] and stats["finished"] == 3, stats
    for got, want in zip(out, alone, strict=True):
        np.testing.assert_array_equal(got, want)


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


# ------------------------------------------------------------------------------------- registered speakers
@pytest.fixture(scope="module")
def speakers(folder, tmp_path_factory):
    """``cosyvoice3_speakers``' service on the demo folder (its store in a temporary folder)."""
    from cosyvoice_triton.serving.stages.speakers import build_service

    params = {"model_dir": str(folder), "family": "cosyvoice3", "capacity": 10, "min_seconds": 0.1,
              "max_seconds": 30.0, "prompt_cache_entries": 0, "prompt_cache_mb": 0.0,
              "speaker_dir": str(tmp_path_factory.mktemp("cv3speakers"))}
    return build_service(params, graph_fn=None)


def _register(speakers, speech, speaker_id, text=None):
    p, psr, _, _ = speech
    req = {"action": _b("register"), "speaker_id": _b(speaker_id), "prompt_audio": p[None],
           "prompt_sample_rate": np.array([[psr]], np.int32)}
    if text is not None:
        req["prompt_text"] = _b(text)
    return speakers.handle(req)


def test_a_registered_speaker_is_the_librarys_prompt(service, speakers, speech):
    """The CosyVoice3 speakers model computes what ``CosyVoice3.prompt`` does (the transcript with the system prompt
    in front) and marks it CosyVoice3; a CosyVoice2 speakers model's prompt is refused by name."""
    p, psr, _, _ = speech
    _register(speakers, speech, "alice", PROMPT_TEXT)
    got = speakers.get("alice")
    want = service.model.prompt(p, prompt_sr=psr, prompt_text=with_system_prompt("zero_shot", "", PROMPT_TEXT,
                                                                                  None)[1])
    assert got.family == "cosyvoice3" and got.prompt_text == want.prompt_text and ENDOFPROMPT in got.prompt_text
    np.testing.assert_array_equal(got.prompt_tokens, want.prompt_tokens)
    np.testing.assert_array_equal(got.prompt_text_tokens, want.prompt_text_tokens)
    np.testing.assert_array_equal(got.prompt_mel, want.prompt_mel)
    np.testing.assert_allclose(got.embedding, want.embedding, atol=1e-5)  # the fbank's mean subtracted twice
    from cosyvoice_triton.serving.stages.speakers import SpeakerService

    cv2 = SpeakerService(speakers.store, speakers.pre, speakers.graphs)  # the same store read as CosyVoice2's
    with pytest.raises(CosyVoiceError, match="registered with a cosyvoice3 model"):
        cv2.get("alice")


def test_tts_with_a_speaker_id_is_tts_with_its_prompt(service, speakers, speech):
    """``speaker_id`` speaks zero-shot with the registered transcript (no mode given), as the same prompt given
    to the library; one registered without a transcript speaks cross-lingually."""
    _register(speakers, speech, "alice", PROMPT_TEXT)
    _register(speakers, speech, "bob")
    served = Cv3Service(service.model, speakers=speakers.get)
    got = np.concatenate([r["waveform"][0] for r in served.responses({"text": _b(TEXT), "speaker_id": _b("alice")})])
    want = np.concatenate(list(service.model.tts_stream("zero_shot", TEXT, speaker=speakers.get("alice"),
                                                        stream=True, seed=0)))
    np.testing.assert_array_equal(got, want)
    by_audio = np.concatenate([r["waveform"][0] for r in service.responses(_tts(speech,
                                                                                prompt_text=_b(PROMPT_TEXT)))])
    assert by_audio.size == got.size
    np.testing.assert_allclose(got, by_audio, atol=1e-3)  # only the embedding's rounding differs
    cross = np.concatenate([r["waveform"][0] for r in served.responses({"text": _b(TEXT), "speaker_id": _b("bob")})])
    want = np.concatenate(list(service.model.tts_stream("cross_lingual", with_system_prompt(
        "cross_lingual", TEXT, None, None)[0], speaker=speakers.get("bob"), stream=True, seed=0)))
    np.testing.assert_array_equal(cross, want)


def test_a_given_speaker_stands_alone_and_is_cosyvoice3s(service, speakers, speech):
    import dataclasses

    p, psr, _, _ = speech
    _register(speakers, speech, "alice", PROMPT_TEXT)
    alice = speakers.get("alice")
    with pytest.raises(CosyVoiceError, match="stands alone"):
        service.model.segments("zero_shot", TEXT, speaker=alice, prompt_wav=p, prompt_sr=psr)
    with pytest.raises(CosyVoiceError, match="registered with a cosyvoice2 model"):
        service.model.segments("zero_shot", TEXT, speaker=dataclasses.replace(alice, family="cosyvoice2"))


@pytest.mark.parametrize("extra, match", [
    ({"prompt_text": _b(PROMPT_TEXT)}, "prompt_text belongs to prompt audio"),
    ({"speaker_id": _b("nobody")}, "nobody"),
    ({"speaker_id": _b("../x")}, "speaker"),
])
def test_bad_speaker_requests_name_what_is_wrong(service, speakers, speech, extra, match):
    _register(speakers, speech, "alice", PROMPT_TEXT)
    served = Cv3Service(service.model, speakers=speakers.get)
    with pytest.raises(CosyVoiceError, match=match):
        list(served.responses({"text": _b(TEXT), "speaker_id": _b("alice"), **extra}))


def test_an_lm_stream_left_early_frees_its_row(service):
    """:meth:`LMEngine.stream` on CosyVoice3's LM: a stream closed after 3 tokens cancels its job (at least 1180
    tokens to go), and the one row goes to the next request, which decodes to its end."""
    import time

    from cosyvoice_triton.models.llm import LMRequest
    from cosyvoice_triton.serving.stages.lm_engine import LMEngine

    engine = LMEngine(service.model.llm, max_active=1, max_waiting=1, wait_timeout_s=60)
    eop = service.model.text.tokenizer.encode(ENDOFPROMPT)  # CosyVoice3's LM needs it in its input
    try:
        long = engine.stream(LMRequest(list(range(1, 59)), eop, draws=1, min_token_text_ratio=20))
        assert len([next(long) for _ in range(3)]) == 3
        long.close()
        short = engine.stream(LMRequest([5, 6, 7], eop, draws=2))
        assert len(list(short)) >= 6  # to its end (random weights: its max_len)
        deadline = time.monotonic() + 60
        while engine.snapshot()["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = engine.snapshot()
        assert snap["cancelled"] == 1 and snap["finished"] == 1 and snap["active"] == 0, snap
        assert snap["request_steps"] < 1180
    finally:
        engine.close()
