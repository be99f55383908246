"""In-process text to speech (CosyVoice2.tts): modes, registered speakers, streaming, segments, errors, CLI."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import FIXTURES

from cosyvoice_triton.__main__ import main as cli
from cosyvoice_triton.errors import CheckpointError, SpeakerError, TextError
from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.pipeline import CosyVoice2, StageTimer

PROMPT = FIXTURES / "prompt_en_3s.wav"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."
TEXT = "Hello world, this is a short test."


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("tts") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def model(demo_dir, tmp_path_factory):
    return CosyVoice2.from_pretrained(demo_dir, speaker_dir=tmp_path_factory.mktemp("speakers"))


@pytest.fixture(scope="module")
def prompt(model):
    return model.prompt(str(PROMPT), prompt_text=PROMPT_TEXT)


def test_prompt_matches_the_official_frontend_alignment(model, prompt):
    assert prompt.prompt_mel.shape == (2 * len(prompt.prompt_tokens), 80)  # official: feat cut to 2 x tokens
    assert prompt.prompt_tokens.dtype == np.int32 and prompt.embedding.shape == (192,)
    assert len(prompt.prompt_text_tokens) > 0 and prompt.prompt_text == PROMPT_TEXT
    vc = model.frontend_vc(str(PROMPT), str(PROMPT))
    n = len(prompt.prompt_tokens)
    np.testing.assert_array_equal(prompt.prompt_tokens, vc.prompt_tokens[:n])
    np.testing.assert_array_equal(prompt.prompt_mel, vc.prompt_mel[: 2 * n])
    np.testing.assert_array_equal(prompt.embedding, vc.embedding)


def test_modes_build_the_official_lm_inputs(model, prompt):
    model.speakers.put("alice", prompt)
    zero = model.tts_requests(TEXT, speaker_id="alice")
    assert len(zero) == 1
    np.testing.assert_array_equal(zero[0].lm_prompt_text_tokens, prompt.prompt_text_tokens)
    np.testing.assert_array_equal(zero[0].lm_prompt_speech_tokens, prompt.prompt_tokens)
    np.testing.assert_array_equal(zero[0].text_tokens, model.text.tokenize(model.text.normalize(TEXT)[0]))
    cross = model.tts_requests(TEXT, speaker_id="alice", mode="cross_lingual")
    assert len(cross[0].lm_prompt_text_tokens) == 0 and len(cross[0].lm_prompt_speech_tokens) == 0
    instruct = model.tts_requests(TEXT, speaker_id="alice", instruct="Speak slowly.")
    assert len(instruct[0].lm_prompt_speech_tokens) == 0
    # tokenized as given, as the official frontend_instruct2 does (nothing appended)
    np.testing.assert_array_equal(instruct[0].lm_prompt_text_tokens, model.text.tokenize("Speak slowly."))
    for r in (zero[0], cross[0], instruct[0]):  # the flow always gets the prompt
        np.testing.assert_array_equal(r.flow_inputs().prompt_mel, prompt.prompt_mel)
    long = model.tts_requests(" ".join([TEXT] * 12), speaker_id="alice")
    assert len(long) > 1  # split into segments by token count, as the official front end


def test_zero_shot_tts_is_seeded_and_equals_the_registered_speaker(model, prompt):
    timer = StageTimer()
    a = model.tts(TEXT, prompt_audio=str(PROMPT), prompt_text=PROMPT_TEXT, seed=3, timer=timer)
    assert a.dtype == np.float32 and a.ndim == 1 and np.isfinite(a).all() and np.abs(a).max() > 0
    assert len(a) % (model.config.sample_rate // 25 // 2) == 0  # whole mel frames (480 samples)
    assert {"llm", "flow.encoder", "flow.solver", "hift"} <= set(timer.seconds)
    model.speakers.put("alice", prompt)
    b = model.tts(TEXT, speaker_id="alice", seed=3)
    np.testing.assert_array_equal(a, b)
    c = model.tts(TEXT, speaker_id="alice", seed=4)
    assert c.shape != a.shape or not np.array_equal(a, c)


def test_streaming_tts_chunks_equal_streaming_token2wav_of_the_same_tokens(model, prompt):
    model.speakers.put("alice", prompt)
    (request,) = model.tts_requests(TEXT, speaker_id="alice")
    tokens = list(model.speech_tokens(request, draws=torch.Generator().manual_seed(7)))
    assert len(tokens) >= 1 and max(tokens) < 6561
    chunks = list(model.tts_stream(TEXT, speaker_id="alice", stream=True, seed=7))
    inputs = request.flow_inputs(np.asarray(tokens, np.int32))
    # a registered speaker's stream starts from its settled prompt frames (speaker_state): bit for bit the
    # same as the token stream that does so, and within float rounding of the one that computes them
    ref = list(model.tokens2wav_stream(inputs, tokens, seed=7, speaker=request.prompt))
    assert [len(c) for c in chunks] == [len(c) for c in ref]
    for got, want in zip(chunks, ref, strict=True):
        np.testing.assert_array_equal(got, want)
    scratch = list(model.token2wav_stream(inputs, seed=7))
    assert [len(c) for c in scratch] == [len(c) for c in ref]
    assert max(float(np.abs(a - b).max()) for a, b in zip(chunks, scratch, strict=True)) <= 1e-3
    whole = model.tts(TEXT, speaker_id="alice", seed=7)  # non-streaming: the same tokens, one flow call
    np.testing.assert_array_equal(whole, model.token2wav(inputs, seed=7))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_text": PROMPT_TEXT}, "prompt text without prompt audio"),
    ({}, "a voice prompt is needed"),
    ({"prompt_audio": str(PROMPT), "speaker_id": "alice"}, "not both"),
    ({"speaker_id": "nobody"}, "nobody"),
    ({"speaker_id": "../etc"}, "speaker_id .* is invalid"),
    ({"prompt_audio": str(PROMPT), "mode": "zero_shot"}, "transcript"),
    ({"prompt_audio": str(PROMPT), "mode": "instruct"}, "instruction"),
    ({"prompt_audio": str(PROMPT), "mode": "sing"}, "mode must be"),
])
def test_bad_requests_are_clear_errors(model, prompt, kwargs, message):
    model.speakers.put("alice", prompt)
    with pytest.raises((TextError, SpeakerError), match=message):
        model.tts_requests(TEXT, **kwargs)


@pytest.mark.parametrize("text", ["", "   \n", "。，!?", "a" * 5000, b"\xff\xfe", "hello [unknown_tag] world"])
def test_bad_text_is_a_text_error(model, text):
    with pytest.raises(TextError):
        model.tts(text, prompt_audio=str(PROMPT))


def test_vc_only_folder_and_required_tts_files(demo_dir, tmp_path):
    vc_only = tmp_path / "vc"
    vc_only.mkdir()
    for name in ("cosyvoice2.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v2.onnx", "campplus.onnx"):
        (vc_only / name).symlink_to(demo_dir / name)
    m = CosyVoice2.from_pretrained(vc_only)
    assert m.llm is None and m.text is None
    with pytest.raises(CheckpointError, match="llm.pt"):
        m.tts(TEXT, prompt_audio=str(PROMPT))
    with pytest.raises(CheckpointError, match="llm.pt"):
        CosyVoice2.from_pretrained(vc_only, tts=True)


def test_cli_tts_stream_and_speakers(demo_dir, tmp_path, capsys):
    spk = tmp_path / "spk"
    assert cli(["speaker", "add", "bob", "--model-dir", str(demo_dir), "--prompt-audio", str(PROMPT),
                "--prompt-text", PROMPT_TEXT, "--speaker-dir", str(spk)]) == 0
    assert cli(["speaker", "list", "--speaker-dir", str(spk)]) == 0
    assert "bob" in capsys.readouterr().out.splitlines()
    out = tmp_path / "out.wav"
    assert cli(["tts", "--model-dir", str(demo_dir), "--text", TEXT, "--speaker", "bob", "--speaker-dir", str(spk),
                "--stream", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "first audio after" in printed
    wave, sr = sf.read(out)
    assert sr == 24000 and len(wave) > 0
    assert cli(["speaker", "delete", "bob", "--speaker-dir", str(spk)]) == 0
    assert cli(["tts", "--model-dir", str(demo_dir), "--text", TEXT, "--speaker", "bob", "--speaker-dir", str(spk),
                "-o", str(out)]) == 2
    assert "bob" in capsys.readouterr().err
