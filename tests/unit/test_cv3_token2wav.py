"""CosyVoice3's token -> waveform path (``models/cosyvoice3/token2wav.py``) against the official ``CosyVoice3Model``
(tests/fixtures/cv3_token2wav_oracle): voice conversion's tokens, non-streaming, streaming and with ``speed``.

The official references come from ``tts(source_speech_token=...)`` on a fresh official instance per case, with the
seeded flow and vocoder weights of the cv3 flow and hift oracles (regenerated here, checked by digest). Chunk
lengths, and the flow and vocoder calls each chunk makes, must be the official ones exactly; the audio must be
within the waveform bar derived from the spread the oracle measured (conftest.waveform_bar). The streaming
schedule is checked against the official loop's calls for many prompt and source lengths.
tests/oracle/cosyvoice3_token2wav.md has the measured figures.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from conftest import FIXTURES, oracle_fixtures, oracle_meta, oracle_script, rel_err, waveform_bar

from cosyvoice_triton.errors import ConfigError, CosyVoiceError
from cosyvoice_triton.models.cosyvoice3 import token2wav as token2wav_module
from cosyvoice_triton.models.cosyvoice3.flow import Flow3Dims, load_flow3
from cosyvoice_triton.models.cosyvoice3.hift import CausalNsfNoise, Hift3Dims, load_hift3
from cosyvoice_triton.models.cosyvoice3.token2wav import Token2Wav3, stream_chunk_ends, stream_schedule
from cosyvoice_triton.streaming import StreamSchedule, stream_chunks

ORACLE = FIXTURES / "cv3_token2wav_oracle"
CASES = ["vc_nonstream", "vc_stream", "vc_speed"]


meta, ref = oracle_fixtures(ORACLE)


@pytest.fixture(scope="module")
def t2w(tmp_path_factory, meta) -> Token2Wav3:
    """The official model's flow and vocoder: the cv3 oracles' seeded weights, regenerated and digest-checked."""
    folder = tmp_path_factory.mktemp("cv3_token2wav")
    flow_meta = oracle_meta(FIXTURES / "cv3_flow_oracle")
    flow_digest = oracle_script("make_cv3_flow_oracle").write_weights(
        folder, meta["seeds"]["flow_weights"], flow_meta["weights"]["rotary_inv_freq_hex"])
    hift_digest = oracle_script("make_cv3_hift_oracle").write_weights(folder, seed=meta["seeds"]["hift_weights"])
    assert flow_digest == meta["weights"]["flow_state_sha256"] == flow_meta["weights"]["state_sha256"]
    assert hift_digest == meta["weights"]["hift_state_sha256"]
    flow = load_flow3(folder / "flow.pt", Flow3Dims.from_dict(meta["dims"]["flow"]))
    hift = load_hift3(folder / "hift.pt", Hift3Dims.tiny(), noise_seed=meta["seeds"]["hift_noise"])
    return Token2Wav3(flow, hift)


def _args(z) -> tuple:
    return (z["source_speech_token"][0], z["flow_prompt_speech_token"][0], z["prompt_speech_feat"][0],
            z["flow_embedding"][0])


class _Calls:
    """Records the flow and vocoder calls of a Token2Wav3 (wrapping its modules' ``inference``)."""

    def __init__(self, t2w: Token2Wav3, monkeypatch):
        self.flow, self.hift = [], []
        flow_inference, hift_inference = t2w.flow.inference, t2w.hift.inference

        def flow(token, *args, streaming=False, finalize=True, **kw):
            mel, lens = flow_inference(token, *args, streaming=streaming, finalize=finalize, **kw)
            self.flow.append((int(token.shape[1]), bool(streaming), bool(finalize), int(mel.shape[2])))
            return mel, lens

        def hift(mel, finalize=True, noise=None):
            speech, source = hift_inference(mel, finalize, noise)
            self.hift.append((int(mel.shape[2]), bool(finalize), int(speech.shape[1])))
            return speech, source

        monkeypatch.setattr(t2w.flow, "inference", flow)
        monkeypatch.setattr(t2w.hift, "inference", hift)


@pytest.fixture(scope="module")
def outputs(t2w, ref):
    """Each case's chunks and calls, computed once."""
    cache: dict = {}

    def run(name: str):
        if name not in cache:
            z = ref(name)
            with pytest.MonkeyPatch.context() as mp:
                calls = _Calls(t2w, mp)
                if z["stream"]:  # tokens arriving one by one
                    chunks = list(t2w.token2wav_stream(iter(z["source_speech_token"][0].tolist()), *_args(z)[1:]))
                else:
                    chunks = [t2w.token2wav(*_args(z), speed=float(z["speed"]))]
            cache[name] = chunks, calls
        return cache[name]

    return run


# ------------------------------------------------------------------------------------------------ the audio
@pytest.mark.parametrize("name", CASES)
def test_chunks_and_calls_are_the_official_ones(outputs, ref, name):
    z = ref(name)
    chunks, calls = outputs(name)
    assert [len(c) for c in chunks] == z["chunk_lens"].tolist()
    assert all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
    # the flow: tokens handed over (prompt excluded), attention mode, look-ahead, mel frames after the prompt
    assert [c[0] for c in calls.flow] == z["t2w_tokens"].tolist()
    assert [c[1] for c in calls.flow] == z["flow_streaming"].tolist()
    assert [c[2] for c in calls.flow] == z["t2w_finalize"].tolist()
    assert [c[3] for c in calls.flow] == z["flow_frames"].tolist()
    # the vocoder: the whole mel so far every time, finalize on the last call only
    assert [c[0] for c in calls.hift] == z["hift_frames"].tolist()
    assert [c[1] for c in calls.hift] == z["hift_finalize"].tolist()
    assert [c[2] for c in calls.hift] == z["hift_samples"].tolist()


@pytest.mark.parametrize("name", CASES)
def test_audio_within_the_bar(outputs, ref, meta, name):
    z = ref(name)
    chunks, _ = outputs(name)
    bar = waveform_bar(meta["cases"][name]["waveform_spread"])
    want = z["speech"][0]
    assert rel_err(np.concatenate(chunks), want) <= bar
    # each chunk, on the scale of the whole answer (the scale the spread was measured on)
    scale = float(np.abs(want).max())
    for got, ends in zip(chunks, np.split(want, np.cumsum(z["chunk_lens"])[:-1]), strict=True):
        assert float(np.abs(got - ends).max()) / scale <= bar


def test_vocoder_alone_from_the_official_mel(t2w, ref, meta):
    """The stream's last vocoder call on its official input (every chunk's mel) gives the whole stream: the audio
    is the causal vocoder's on the cached mel, whatever the chunking."""
    z = ref("vc_stream")
    speech, _ = t2w.hift.inference(torch.from_numpy(z["last_hift_mel"]), finalize=True)
    assert rel_err(speech[0], z["speech"][0]) <= waveform_bar(meta["cases"]["vc_stream"]["waveform_spread"])


def test_stream_differs_from_nonstream(outputs, meta):
    """Chunk-causal attention changes the mel: the official stream is not the non-streaming answer (0.53 there),
    and the project's stream is not either."""
    stream = np.concatenate(outputs("vc_stream")[0])
    nonstream = outputs("vc_nonstream")[0][0]
    bar = waveform_bar(meta["cases"]["vc_stream"]["waveform_spread"])
    assert meta["stream_vs_nonstream"] > 10 * bar
    assert rel_err(stream, nonstream) > 10 * bar


def test_wrong_input_fails_the_bar(t2w, ref, meta):
    """The derived bars still tell wrong answers apart: one source token changed, another noise seed, the last
    chunk with chunk-causal attention (what the official tts does not do)."""
    z = ref("vc_nonstream")
    bar = waveform_bar(meta["cases"]["vc_nonstream"]["waveform_spread"])
    assert bar < 0.05, "the measured spread is implausibly large"
    tokens = z["source_speech_token"][0].copy()
    tokens[45] = (tokens[45] + 1) % 6561
    assert rel_err(t2w.token2wav(tokens, *_args(z)[1:]), z["speech"][0]) > bar

    z = ref("vc_speed")
    bar = waveform_bar(meta["cases"]["vc_speed"]["waveform_spread"])
    hift = copy.deepcopy(t2w.hift)
    hift.noise = CausalNsfNoise(meta["seeds"]["hift_noise"] + 1)
    other = Token2Wav3(t2w.flow, hift)
    assert rel_err(other.token2wav(*_args(z), speed=float(z["speed"])), z["speech"][0]) > bar

    z = ref("vc_stream")
    bar = waveform_bar(meta["cases"]["vc_stream"]["waveform_spread"])
    mel = t2w._mel

    def chunked(tokens, prompt, *, streaming, finalize):
        return mel(tokens, prompt, streaming=True, finalize=finalize)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(t2w, "_mel", chunked)
        chunks = list(t2w.token2wav_stream(*_args(z)))
    assert [len(c) for c in chunks] == z["chunk_lens"].tolist()
    assert rel_err(np.concatenate(chunks), z["speech"][0]) > bar


def test_speed_is_the_official_stretch(outputs, ref):
    z = ref("vc_speed")
    _, calls = outputs("vc_speed")
    frames = int(z["flow_frames"][0])
    assert calls.hift[0][0] == int(frames / float(z["speed"])) != frames


# ------------------------------------------------------------------------------------------------ the schedule
def _official_runs():
    return json.loads((ORACLE / "schedule.json").read_text())


def test_schedule_is_the_official_one():
    """Every (prompt, source) length the oracle ran through the official tts loop: the chunk ends, the tokens each
    call gets, its stream / finalize flags."""
    scan = _official_runs()
    lookahead = scan["pre_lookahead_len"]
    assert len(scan["runs"]) >= 100
    for dims in (Flow3Dims.full(), Flow3Dims.tiny()):
        assert dims.pre_lookahead_len == lookahead
        for run in scan["runs"]:
            calls = run["calls"]
            ends = stream_chunk_ends(run["source"], run["prompt"], dims)
            assert ends == [c[1] for c in calls[1:]], run
            chunks = list(stream_chunks(range(run["source"]), run["prompt"], lookahead=lookahead,
                                        schedule=stream_schedule(dims)))
            assert [[len(c.tokens), c.offset, not c.final, c.final] for c in chunks] == calls, run
    # the scan covers padded and unpadded first hops, hops of 25 + pad, 50 and 100, and a single final call
    hops = {b[1] - a[1] for run in scan["runs"] for a, b in zip(run["calls"][:-1], run["calls"][1:], strict=True)
            if not b[3]}
    assert {50, 100} <= hops
    assert {run["calls"][1][1] for run in scan["runs"] if len(run["calls"]) > 1} >= {25, 30, 49, 26}
    assert any(len(run["calls"]) == 1 for run in scan["runs"])


def test_each_stream_starts_at_the_first_hop(t2w, monkeypatch):
    """The official instance keeps its grown hop: its second stream starts with 100 tokens (plus a pad to a
    multiple of 100). The project's hops restart for every stream, as on a fresh official instance."""
    quirk = _official_runs()["quirk"]
    assert quirk["second_stream"] != quirk["first_stream"] and quirk["token_hop_len_after"] == 100
    calls = []

    def mel(tokens, prompt, *, streaming, finalize):
        calls.append([int(tokens.shape[1]), bool(streaming), bool(finalize)])
        n = prompt[0].shape[1] + tokens.shape[1] - (0 if finalize else t2w.flow.pre_lookahead_len)
        return torch.zeros(1, 80, 2 * n - prompt[1].shape[1])

    monkeypatch.setattr(t2w, "_mel", mel)
    monkeypatch.setattr(token2wav_module, "_Vocoded", lambda hift: lambda mel, *, final: np.zeros(0, np.float32))
    prompt = (np.zeros(quirk["prompt"], np.int32), np.zeros((2 * quirk["prompt"], 80), np.float32),
              np.ones(192, np.float32))
    want = [[c[0], c[2], c[3]] for c in quirk["first_stream"]]
    for _ in range(2):
        calls.clear()
        list(t2w.token2wav_stream(range(quirk["source"]), *prompt))
        assert calls == want


def test_schedule_options():
    assert stream_schedule() == StreamSchedule()
    assert stream_schedule(first_hop=50).first_hop == 50
    with pytest.raises(ConfigError, match="static_chunk_size"):
        stream_schedule(Flow3Dims.from_dict({"dit": {"static_chunk_size": 51}}))


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input_is_refused(t2w, ref):
    z = ref("vc_speed")
    tokens, prompt = z["source_speech_token"][0], _args(z)[1:]
    with pytest.raises(CosyVoiceError, match="no speech tokens"):
        t2w.token2wav(tokens[:0], *prompt)
    with pytest.raises(CosyVoiceError, match="no speech tokens"):
        list(t2w.token2wav_stream(iter(()), *prompt))
    with pytest.raises(CosyVoiceError, match="out of range"):
        t2w.token2wav(np.array([1, 6561]), *prompt)
    with pytest.raises(CosyVoiceError, match="prompt_feat"):
        t2w.token2wav(tokens, prompt[0], prompt[1].T, prompt[2])
    with pytest.raises(CosyVoiceError, match="embedding"):
        t2w.token2wav(tokens, prompt[0], prompt[1], prompt[2][:80])
    with pytest.raises(CosyVoiceError, match="speed"):
        t2w.token2wav(tokens, *prompt, speed=0)
    with pytest.raises(ConfigError, match="chunk"):
        Token2Wav3(t2w.flow, t2w.hift, schedule=StreamSchedule(first_hop=10, growth=5, chunk=5))
