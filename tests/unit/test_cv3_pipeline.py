"""The CosyVoice3 class (``models/cosyvoice3/pipeline.py``) against the official ``CosyVoice3`` class
(tests/fixtures/cv3_pipeline_oracle): zero-shot, cross-lingual, instruct2 and voice conversion, non-streaming and
streaming, and zero-shot with ``speed``.

The model folder is rebuilt from the cv3 oracles' seeded weights (digest-checked). The official front end's speech
side needs torchaudio (stubbed in the oracle), so the oracle fed it the project's front-end outputs, recorded in
``frontend.npz``; the parity tests give the project the same ones (through its prompt cache, and the source's tokens)
so that they do not depend on the ONNX stand-ins' float results; :func:`test_front_end_gives_the_recorded_features`
checks the project still computes them. The LM's draws are the oracle's injected uniforms. Segments (the text
split and each mode's ``model_input``), the LM's tokens and those passed to the flow, and chunk lengths must be
equal; the audio must be within the waveform bar derived from the spread the oracle measured
(``conftest.waveform_bar``). tests/oracle/cosyvoice3_pipeline.md has the figures.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES, oracle_fixtures, oracle_script, rel_err, waveform_bar

from cosyvoice_triton.errors import ConfigError, TextError
from cosyvoice_triton.frontend import audio
from cosyvoice_triton.models.cosyvoice3.pipeline import CosyVoice3
from cosyvoice_triton.prompt_cache import prompt_key

ORACLE = FIXTURES / "cv3_pipeline_oracle"
TTS_CASES = ["zero_shot", "zero_shot_stream", "zero_shot_speed", "cross_lingual", "cross_lingual_stream",
             "instruct2", "instruct2_stream"]
VC_CASES = ["vc", "vc_stream"]


@pytest.fixture(scope="module")
def script():
    return oracle_script("make_cv3_pipeline_oracle")


meta, ref = oracle_fixtures(ORACLE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, script, meta):
    folder = tmp_path_factory.mktemp("cv3_pipeline")
    assert script.write_folder(folder) == meta["weights"]["state_sha256"]
    return folder


@pytest.fixture(scope="module")
def model(folder, script, meta, ref) -> CosyVoice3:
    """The project's CosyVoice3 on the folder, its prompt cache holding the recorded features of the prompt."""
    m = CosyVoice3.from_pretrained(folder, hift_noise_seed=meta["seeds"]["hift_noise"], threads=1)
    front = ref("frontend")
    wave, sr = audio.decode_if_encoded(str(script.PROMPT_WAV), None, name="prompt")
    key = prompt_key(audio.validate_audio(wave, sample_rate=sr, name="prompt"), sr, kind="prompt_features",
                     options=m._prompt_options)
    m.prompt_cache.put(key, {k: front[k] for k in ("prompt_tokens", "prompt_mel", "embedding")})
    return m


def _keywords(meta: dict, mode: str) -> dict:
    return dict(meta["texts"][mode])


def test_folder_and_fixture_sizes(meta):
    assert sum(p.stat().st_size for p in ORACLE.iterdir()) < 1.5e6
    assert set(meta["cases"]) == set(TTS_CASES + VC_CASES)


def test_front_end_gives_the_recorded_features(folder, script, ref):
    fresh = CosyVoice3.from_pretrained(folder, tts=False, prompt_cache=False, threads=1)
    got = script.project_frontend(fresh)
    want = ref("frontend")
    np.testing.assert_array_equal(got["prompt_tokens"], want["prompt_tokens"])
    np.testing.assert_array_equal(got["source_tokens"], want["source_tokens"])
    assert rel_err(got["prompt_mel"], want["prompt_mel"]) < 1e-5
    assert rel_err(got["embedding"], want["embedding"]) < 1e-4


@pytest.mark.parametrize("name", TTS_CASES)
def test_segments_are_the_official_model_input(model, meta, ref, name):
    z, mode = ref(name), str(ref(name)["mode"])
    (seg,) = model.segments(mode, prompt_wav=str(FIXTURES / "prompt_en_3s.wav"), **_keywords(meta, mode))
    np.testing.assert_array_equal(seg.text_tokens, z["text"])
    np.testing.assert_array_equal(seg.lm_prompt_text_tokens, z.get("prompt_text", np.zeros(0, np.int32)))
    np.testing.assert_array_equal(seg.lm_prompt_speech_tokens, z.get("llm_prompt_speech_token", np.zeros(0, np.int32)))
    np.testing.assert_array_equal(seg.prompt.prompt_tokens, z["flow_prompt_speech_token"])
    assert len(seg.prompt.prompt_mel) == int(z["prompt_speech_feat_frames"])


@pytest.mark.parametrize("name", TTS_CASES)
def test_tts_equals_the_official_class(model, meta, ref, name):
    z, case = ref(name), meta["cases"][name]
    mode = case["mode"]
    kw = _keywords(meta, mode)
    prompt_wav = str(FIXTURES / "prompt_en_3s.wav")
    (seg,) = model.segments(mode, prompt_wav=prompt_wav, **kw)
    tokens = model.speech_tokens(seg, draws=iter(z["draws"].tolist()))
    kept = list(tokens)
    np.testing.assert_array_equal(tokens.lm.tokens, z["lm_tokens"])
    np.testing.assert_array_equal(kept, z["llm_job_tokens"])
    chunks = list(model.tts_stream(mode, prompt_wav=prompt_wav, stream=bool(z["stream"]), speed=float(z["speed"]),
                                   draws=iter(z["draws"].tolist()), **kw))
    assert [len(c) for c in chunks] == z["chunk_lens"].tolist()
    assert rel_err(np.concatenate(chunks), z["speech"]) < waveform_bar(case["waveform_spread"])


@pytest.mark.parametrize("name", VC_CASES)
def test_vc_equals_the_official_class(model, script, meta, ref, name, monkeypatch):
    z, case = ref(name), meta["cases"][name]
    source = ref("frontend")["source_tokens"]
    monkeypatch.setattr(model, "_tokenize", lambda waves, timer: [source])
    chunks = list(model.vc_stream(script.source_16k(), str(script.PROMPT_WAV), source_sr=audio.TOKENIZER_SR,
                                  stream=bool(z["stream"])))
    np.testing.assert_array_equal(z["source_speech_token"], source)
    assert [len(c) for c in chunks] == z["chunk_lens"].tolist()
    assert rel_err(np.concatenate(chunks), z["speech"]) < waveform_bar(case["waveform_spread"])


def test_wrong_answers_fail_the_bar(model, meta, ref):
    """Other draws, or a stream's tokens on the non-streaming path, are far outside the bar."""
    z, case = ref("zero_shot"), meta["cases"]["zero_shot"]
    bar = waveform_bar(case["waveform_spread"])
    kw = _keywords(meta, "zero_shot")
    prompt_wav = str(FIXTURES / "prompt_en_3s.wav")
    draws = np.random.default_rng(999).random(len(ref("zero_shot_stream")["draws"]) * 20)
    other = model.tts("zero_shot", prompt_wav=prompt_wav, draws=iter(draws.tolist()), **kw)
    assert other.shape != z["speech"].shape or rel_err(other, z["speech"]) > bar
    front, s = ref("frontend"), ref("zero_shot_stream")
    oneshot = model.token2wav_model.token2wav(s["llm_job_tokens"], front["prompt_tokens"], front["prompt_mel"],
                                              front["embedding"])
    assert oneshot.shape == s["speech"].shape
    assert rel_err(oneshot, s["speech"]) > waveform_bar(meta["cases"]["zero_shot_stream"]["waveform_spread"])


def test_sampling_is_reproducible_with_a_seed(model, meta):
    kw = _keywords(meta, "instruct2")
    prompt_wav = str(FIXTURES / "prompt_en_3s.wav")
    a = [model.tts("instruct2", prompt_wav=prompt_wav, seed=s, **kw) for s in (5, 5, 6)]
    np.testing.assert_array_equal(a[0], a[1])
    assert a[0].shape != a[2].shape or not np.array_equal(a[0], a[2])


def test_endofprompt_is_required_with_a_clear_error(model):
    prompt_wav = str(FIXTURES / "prompt_en_3s.wav")
    with pytest.raises(TextError, match=r"<\|endofprompt\|>.*zero_shot.*You are a helpful assistant"):
        model.tts_zero_shot("hello there.", "a transcript without the system prompt.", prompt_wav)
    with pytest.raises(TextError, match=r"<\|endofprompt\|>.*cross_lingual"):
        model.cross_lingual("hello there.", prompt_wav)
    with pytest.raises(TextError, match=r"<\|endofprompt\|>.*instruct2"):
        model.instruct2("hello there.", "You are a helpful assistant. Speak slowly.", prompt_wav)
    with pytest.raises(TextError, match="instruct_text"):
        model.tts("instruct2", "hello", prompt_wav=prompt_wav)
    with pytest.raises(TextError, match="prompt_text is only used by zero_shot"):
        model.tts("cross_lingual", "hello", prompt_wav=prompt_wav, prompt_text="x")
    with pytest.raises(ConfigError, match="speed"):
        list(model.vc_stream(prompt_wav, prompt_wav, speed=1.5))


def test_another_family_is_refused(tmp_path):
    (tmp_path / "cosyvoice2.yaml").write_text("sample_rate: 24000\n")
    with pytest.raises(ConfigError, match="cosyvoice2 folder.*not CosyVoice3.*CosyVoice2"):
        CosyVoice3.from_pretrained(tmp_path)
    missing = tmp_path / "cv3"
    missing.mkdir()
    (missing / "cosyvoice3.yaml").write_text("sample_rate: 24000\n")
    with pytest.raises(ConfigError, match="llm.pt"):
        CosyVoice3.from_pretrained(missing)


def test_cli_vc_and_tts_on_a_cosyvoice3_folder(folder, tmp_path, capsys):
    """``vc`` and ``tts`` take the family from the folder: a CosyVoice3 folder runs this class."""
    import soundfile as sf

    from cosyvoice_triton.__main__ import main

    prompt = str(FIXTURES / "prompt_en_3s.wav")
    out = tmp_path / "vc.wav"
    assert main(["vc", "--model-dir", str(folder), "--source", prompt, "--prompt", prompt, "-o", str(out)]) == 0
    wave, sr = sf.read(out)
    assert sr == 24000 and len(wave) == 24000 * 3
    for extra, name in ((["--prompt-text", "You are a helpful assistant.<|endofprompt|>a short prompt."], "zs"),
                        (["--instruct", "You are a helpful assistant. Speak slowly.<|endofprompt|>", "--stream"],
                         "instruct")):
        out = tmp_path / f"{name}.wav"
        assert main(["tts", "--model-dir", str(folder), "--text", "hello there, how are you.", "--prompt-audio",
                     prompt, "--seed", "3", "-o", str(out), *extra]) == 0
        assert len(sf.read(out)[0]) > 0
    assert "wrote" in capsys.readouterr().out
    assert main(["tts", "--model-dir", str(folder), "--text", "hello.", "--prompt-audio", prompt, "-o",
                 str(tmp_path / "x.wav")]) == 2
    assert "<|endofprompt|>" in capsys.readouterr().err


def test_a_registered_speaker_is_its_prompt(model, meta, ref):
    """``speaker_id`` in place of the prompt audio (and its transcript, in zero-shot) gives the same answer."""
    kw = _keywords(meta, "zero_shot")
    z = ref("zero_shot")
    prompt_wav = str(FIXTURES / "prompt_en_3s.wav")
    model.register_speaker("oracle-voice", prompt_wav, prompt_text=kw["prompt_text"])
    try:
        by_id = model.tts_zero_shot(kw["text"], None, speaker_id="oracle-voice", draws=iter(z["draws"].tolist()))
        by_audio = model.tts_zero_shot(kw["text"], kw["prompt_text"], prompt_wav, draws=iter(z["draws"].tolist()))
        np.testing.assert_array_equal(by_id, by_audio)
        with pytest.raises(TextError, match="prompt text belongs to prompt audio"):
            model.tts_zero_shot(kw["text"], kw["prompt_text"], speaker_id="oracle-voice")
    finally:
        model.speakers.delete("oracle-voice")
