"""Live voice conversion of CosyVoice3 in process (``serving.stages.cosyvoice3_live_vc``) on the CosyVoice3 demo
folder: the piece sizes do not change the output; with the whole utterance's tokens and a flow window covering
everything, 25-token chunks give the official stream's audio (and 10-token chunks do not); the state stays bounded
over a long stream; the voice of a registered speaker is its prompt; bad sessions and pieces are refused naming what
is wrong, and the session goes on after a bad piece."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
from cosyvoice_triton.serving.stages.cosyvoice3_live_vc import Cv3LiveVC
from cosyvoice_triton.serving.stages.live_vc import SAMPLES_PER_TOKEN, LiveSettings, convert_pieces
from cosyvoice_triton.speakers import SpeakerPrompt


@pytest.fixture(scope="module")
def service(cv3_demo_dir) -> Cv3Service:
    return Cv3Service.load(cv3_demo_dir, tts=False)


def _first(speech, **extra) -> dict:
    prm, psr, _, ssr = speech
    return {"source_sample_rate": np.array([[ssr]], np.int32), "prompt_audio": prm[None],
            "prompt_sample_rate": np.array([[psr]], np.int32), **extra}


def _pieces(y: np.ndarray, size: int) -> list[np.ndarray]:
    return [y[i: i + size] for i in range(0, len(y), size)]


def test_piece_sizes_do_not_change_the_output(service, en_speech):
    live = Cv3LiveVC(service)
    src, ssr = en_speech[2], en_speech[3]
    even = np.concatenate(convert_pieces(live, _first(en_speech), _pieces(src, ssr // 5)))
    ragged = np.concatenate(convert_pieces(live, _first(en_speech), _pieces(src, 1777)))
    assert even.shape == ragged.shape and len(even) >= 4 * service.sample_rate
    np.testing.assert_allclose(even, ragged, atol=1e-5)
    offline = service.model.vc(src, en_speech[0], source_sr=ssr, prompt_sr=en_speech[1])
    assert len(even) == len(offline)


@pytest.mark.parametrize("chunk_tokens", [25, 10])
def test_aligned_chunks_give_the_official_stream(service, en_speech, chunk_tokens):
    """The session's tokenizer replaced by the whole utterance's tokens, the flow window wider than the stream: the
    audio up to the official schedule's last chunk-causal frames (8 frames of vocoder look-ahead before it) equals
    ``token2wav_stream``'s to float rounding with 25-token chunks, not with 10."""
    model = service.model
    prm, psr, src, ssr = en_speech
    inputs = model.frontend_vc(src, prm, source_sr=ssr, prompt_sr=psr)
    whole = inputs.source_tokens
    prompt = (inputs.prompt_tokens, inputs.prompt_mel, inputs.embedding)
    official = np.concatenate(list(model.token2wav_model.token2wav_stream(whole.tolist(), *prompt)))

    live = Cv3LiveVC(service, LiveSettings(chunk_tokens=chunk_tokens, flow_context_tokens=400))
    session = live.open(_first(en_speech))

    def commit(self, upto):
        end = len(whole) if upto is None else upto
        self.tokens = np.concatenate([self.tokens, whole[self.committed: end]])

    session._commit = commit.__get__(session)
    got = []
    for p in _pieces(src, ssr // 5):
        got.extend(session.feed(p))
    got.extend(session.finish())
    got = np.concatenate(got)
    assert session.chunks >= 5 and got.shape == official.shape
    end = model.token2wav_model.stream_chunk_ends(len(whole), len(prompt[0]))[-1]
    n = (2 * end - model.token2wav_model.hift.dims.held_frames) * model.token2wav_model.hift.upsample_factor
    assert n >= 2 * service.sample_rate
    err = float(np.abs(got[:n] - official[:n]).max())
    if chunk_tokens % 25 == 0:
        assert err <= 1e-5, err
    else:
        assert err > 1e-3, err


def test_state_stays_bounded_over_a_long_stream(service, en_speech):
    src, ssr = en_speech[2], en_speech[3]
    long = np.concatenate([src] * 4)  # 20 s
    s = LiveSettings(chunk_tokens=25, tokenizer_context_tokens=50, tokenizer_lookahead_tokens=5, flow_context_tokens=50)
    session = Cv3LiveVC(service, s).open(_first(en_speech))
    piece = ssr // 4
    most_wave = (s.tokenizer_context_tokens + 2 * s.chunk_tokens + 25 + 3 + s.tokenizer_lookahead_tokens
                 + piece * 25 // ssr + 2) * SAMPLES_PER_TOKEN
    most_tokens = s.flow_context_tokens + 25 + 2 * s.chunk_tokens + 25 + 3
    vocoder = session.state.vocoder
    most_frames = 32 + 2 * (2 * s.chunk_tokens + 25) + 8
    out = []
    for i in range(0, len(long), piece):
        out.extend(session.feed(long[i: i + piece]))
        assert len(session.wave) <= most_wave and len(session.tokens) <= most_tokens
        assert vocoder.mel is None or vocoder.mel.shape[2] <= most_frames
    out.extend(session.finish())
    assert session.chunks >= 18
    assert sum(len(c) for c in out) == len(long) * service.sample_rate // ssr


def test_a_registered_speaker_is_its_prompt(service, en_speech, monkeypatch):
    """``speaker_id`` answers what the same prompt features given as a registered speaker's prompt give."""
    prm, psr, src, ssr = en_speech
    entry = service.model.prompt_features(prm, prompt_sr=psr)
    n = min(len(entry["prompt_tokens"]), len(entry["prompt_mel"]) // 2)
    speaker = SpeakerPrompt(prompt_tokens=np.array(entry["prompt_tokens"][:n]),
                            prompt_mel=np.array(entry["prompt_mel"][: 2 * n]),
                            embedding=np.array(entry["embedding"]), family="cosyvoice3")
    asked = []
    monkeypatch.setattr(service, "speakers", lambda sid: asked.append(sid) or speaker)
    live = Cv3LiveVC(service)
    first = {"source_sample_rate": np.array([[ssr]], np.int32), "speaker_id": np.array([[b"alice"]], object)}
    by_id = np.concatenate(convert_pieces(live, first, _pieces(src, ssr // 2)))
    assert asked == ["alice"]
    monkeypatch.setattr(service.model, "prompt_features", lambda *a, **k: {
        "prompt_tokens": speaker.prompt_tokens, "prompt_mel": speaker.prompt_mel, "embedding": speaker.embedding})
    by_audio = np.concatenate(convert_pieces(live, _first(en_speech), _pieces(src, ssr // 2)))
    np.testing.assert_allclose(by_id, by_audio, atol=1e-6)


@pytest.mark.parametrize("case", ["no_rate", "seed", "no_voice", "both_voices", "no_store"])
def test_bad_sessions_are_refused(service, en_speech, case, monkeypatch):
    first = _first(en_speech)
    if case == "no_rate":
        del first["source_sample_rate"]
    elif case == "seed":
        first["seed"] = np.array([[1]], np.int64)
    elif case == "no_voice":
        first = {"source_sample_rate": first["source_sample_rate"]}
    elif case == "both_voices":
        first["speaker_id"] = np.array([[b"alice"]], object)
    else:
        first = {"source_sample_rate": first["source_sample_rate"], "speaker_id": np.array([[b"alice"]], object)}
        monkeypatch.setattr(service, "speakers", None)
    want = {"no_rate": "source_sample_rate", "seed": "seed", "no_voice": "voice prompt",
            "both_voices": "not both", "no_store": "speakers model"}[case]
    with pytest.raises(CosyVoiceError, match=want):
        Cv3LiveVC(service).open(first)


def test_a_bad_piece_is_refused_and_the_session_goes_on(service, en_speech):
    src, ssr = en_speech[2], en_speech[3]
    live = Cv3LiveVC(service)
    good = np.concatenate(convert_pieces(live, _first(en_speech), _pieces(src, ssr // 2)))
    session = live.open(_first(en_speech))
    out = []
    for i, p in enumerate(_pieces(src, ssr // 2)):
        if i == 2:
            for bad, want in ((np.full(100, np.nan, np.float32), "NaN"), (np.zeros(0, np.float32), "empty"),
                              (np.zeros(ssr * 6, np.float32), "longer than")):
                with pytest.raises(CosyVoiceError, match=want):
                    list(live.piece(session, {"source_audio": bad[None]}, first=False, last=False))
            with pytest.raises(CosyVoiceError, match="only the first piece"):
                list(live.piece(session, {"source_audio": p[None], "speaker_id": np.array([[b"x"]], object)},
                                first=False, last=False))
        out.extend(live.piece(session, {"source_audio": p[None]}, first=i == 0, last=False))
    out.extend(live.piece(session, {}, first=False, last=True))
    np.testing.assert_allclose(np.concatenate(out), good, atol=1e-6)
