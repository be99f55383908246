"""In-process VC: the official token-to-wav path (oracle), the demo folder end to end, loading errors, CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import FEAT_BAR, FIXTURES, ROOT, flow_oracle_script, rel_err, waveform_bar

from cosyvoice_triton.bench.vc import run_core_bench
from cosyvoice_triton.config import ModelConfig, write_yaml
from cosyvoice_triton.errors import AudioError, CheckpointError
from cosyvoice_triton.models.checkpoint import CAUSAL_FLOW_KEY, LEGACY_FLOW_KEY
from cosyvoice_triton.models.demo import build_demo_models, write_demo_model
from cosyvoice_triton.models.demo_weights import _calibration_mel
from cosyvoice_triton.pipeline import CosyVoice2, StageTimer, VCInputs

SOURCE = FIXTURES / "source_en_5s.wav"
PROMPT = FIXTURES / "prompt_en_3s.wav"
# Whole token-to-wav path. The mel HiFT gets (flow output, with the streaming cache frames) must equal the official
# one within FEAT_BAR. The waveform goes through HiFT's phase accumulation over 480 T samples, which turns float32
# rounding of that mel into ~1e-3 of the waveform (the oracle measured it: waveform_spread in its meta), so the
# waveform bar is conftest.waveform_bar of that measured spread; the streaming case uses the non-streaming
# case's spread (same tokens; each of its HiFT calls is shorter, so it accumulates less).


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def demo(demo_dir):
    return CosyVoice2.from_pretrained(demo_dir)


def _oracle_inputs(z) -> VCInputs:
    return VCInputs(source_tokens=z["source_speech_token"][0], prompt_tokens=z["flow_prompt_speech_token"][0],
                    prompt_mel=z["prompt_speech_feat"][0], embedding=z["flow_embedding"][0])


def _official_noises(model, z) -> list[np.ndarray]:
    """The official NSF noise of each HiFT call: one seeded generator drawn call after call, as torch's global RNG
    was after ``torch.manual_seed(seed)``; each checked against the oracle's digest."""
    g = torch.Generator().manual_seed(int(z["seed"]))
    out = []
    for i in range(int(z["n_hift_calls"])):
        noise = model.hift.draw_noise(1, int(z[f"hift{i}_noise_frames"]), generator=g)
        assert flow_oracle_script().sha256(noise) == str(z[f"hift{i}_noise_sine_sha256"]), f"HiFT call {i}"
        out.append(noise.numpy())
    return out


def _hift_inputs(model, monkeypatch, perturb: float = 0.0) -> list[np.ndarray]:
    """Record the mel of every HiFT call of ``model`` (optionally perturbed first: a deliberately wrong input)."""
    seen, original = [], model._hift

    def spy(mel, *args):
        if perturb:
            g = torch.Generator().manual_seed(len(seen))
            mel = mel + perturb * mel.abs().max() * torch.randn(mel.shape, generator=g)
        seen.append(mel.detach().cpu().numpy().copy())
        return original(mel, *args)

    monkeypatch.setattr(model, "_hift", spy)
    return seen


def _e2e_bar(meta) -> float:
    return waveform_bar(meta["e2e_cases"]["e2e_vc_nonstream"]["waveform_spread"])


def test_token2wav_matches_official(oracle_model, ref_npz, flow_oracle_meta, monkeypatch):
    z = ref_npz("e2e_vc_nonstream")
    assert int(z["n_hift_calls"]) == 1
    noise = _official_noises(oracle_model, z)[0]
    mels = _hift_inputs(oracle_model, monkeypatch)
    injected = oracle_model.token2wav(_oracle_inputs(z), hift_noise=noise)
    assert rel_err(mels[0], z["hift0_mel"]) <= FEAT_BAR  # measured 0 (bit-identical) on this CPU
    assert injected.shape == z["speech"][0].shape
    assert rel_err(injected, z["speech"][0]) <= _e2e_bar(flow_oracle_meta)  # measured ~1e-6 here
    # the seeded generator replays the official torch.manual_seed(seed) draws exactly
    seeded = oracle_model.token2wav(_oracle_inputs(z), seed=int(z["seed"]))
    np.testing.assert_array_equal(seeded, injected)


def test_token2wav_stream_matches_official(oracle_model, ref_npz, flow_oracle_meta, monkeypatch):
    z = ref_npz("e2e_vc_stream")
    noises = _official_noises(oracle_model, z)
    mels = _hift_inputs(oracle_model, monkeypatch)
    timer = StageTimer()
    chunks = list(oracle_model.token2wav_stream(_oracle_inputs(z), hift_noise=noises, timer=timer))
    assert [len(c) for c in chunks] == z["chunk_lens"].tolist()
    assert len(mels) == int(z["n_hift_calls"]) > 2
    for i, mel in enumerate(mels):  # each chunk's mel with the 8 cached frames in front
        assert rel_err(mel, z[f"hift{i}_mel"]) <= FEAT_BAR, f"HiFT call {i}"
    assert rel_err(np.concatenate(chunks), z["speech"][0]) <= _e2e_bar(flow_oracle_meta)
    assert set(timer.seconds) == {"flow.encoder", "flow.solver", "hift"}
    seeded = list(oracle_model.token2wav_stream(_oracle_inputs(z), seed=int(z["seed"])))
    np.testing.assert_array_equal(np.concatenate(seeded), np.concatenate(chunks))


@pytest.mark.parametrize("stream", [False, True])
def test_wrong_token2wav_fails_the_bars(oracle_model, ref_npz, flow_oracle_meta, monkeypatch, stream):
    """The bars tell a wrong implementation apart: HiFT's mel off by 1e-4 relative, or the noise of another seed."""
    z = ref_npz("e2e_vc_stream" if stream else "e2e_vc_nonstream")
    bar = _e2e_bar(flow_oracle_meta)
    assert bar < 0.05, "the measured spread is implausibly large"

    def run(**kw):
        if stream:
            return np.concatenate(list(oracle_model.token2wav_stream(_oracle_inputs(z), **kw)))
        return oracle_model.token2wav(_oracle_inputs(z), **kw)

    assert rel_err(run(seed=int(z["seed"]) + 1), z["speech"][0]) > bar
    mels = _hift_inputs(oracle_model, monkeypatch, perturb=1e-4)
    wrong = run(seed=int(z["seed"]))
    assert rel_err(mels[0], z["hift0_mel"]) > FEAT_BAR
    assert rel_err(wrong, z["speech"][0]) > bar


@pytest.mark.parametrize("case", ["e2e_vc_nonstream", "e2e_vc_stream"])
def test_token2wav_matches_external_reference(external_oracle_model, external_npz, flow_oracle_meta, case):
    """Cross-check on the external reference folder (official outputs made on another machine)."""
    z = external_npz(case)
    noises = [z[f"hift{i}_noise_sine"] for i in range(int(z["n_hift_calls"]))]
    if bool(z["stream"]):
        wave = np.concatenate(list(external_oracle_model.token2wav_stream(_oracle_inputs(z), hift_noise=noises)))
    else:
        wave = external_oracle_model.token2wav(_oracle_inputs(z), hift_noise=noises[0])
    assert rel_err(wave, z["speech"][0]) <= _e2e_bar(flow_oracle_meta)


def test_demo_convert_end_to_end(demo):
    timer = StageTimer()
    wave = demo.convert(str(SOURCE), PROMPT.read_bytes(), timer=timer)
    src, sr = sf.read(SOURCE)
    # 25 Hz tokens -> 2 mel frames each -> 480 samples per frame at 24 kHz: the source duration, to a token
    assert abs(len(wave) / 24000 - len(src) / sr) <= 0.04
    assert wave.dtype == np.float32 and np.isfinite(wave).all()
    assert np.sqrt(np.mean(wave**2)) > 1e-4 and np.abs(wave).max() <= 0.99
    assert set(timer.seconds) == {"frontend", "tokenizer", "speaker_embedding", "flow.encoder", "flow.solver",
                                  "hift"}
    again = demo.convert(SOURCE.read_bytes(), str(PROMPT))
    np.testing.assert_array_equal(wave, again)  # deterministic for a fixed seed
    assert not np.array_equal(wave, demo.convert(str(SOURCE), str(PROMPT), seed=1))


def test_demo_convert_arrays_and_streaming(demo):
    src, sr = sf.read(SOURCE, dtype="int16")
    prompt, prompt_sr = sf.read(PROMPT, dtype="float32")
    whole = demo.convert(src, prompt, source_sr=sr, prompt_sr=prompt_sr)
    streamed = demo.convert(src, prompt, source_sr=sr, prompt_sr=prompt_sr, stream=True)
    assert len(streamed) == len(whole)
    assert np.isfinite(streamed).all()


def _official_chunk_ends(n_tokens: int, n_prompt: int, la: int = 3) -> list[int]:
    """The official CosyVoice2Model.tts(stream=True) loop, transcribed: token offsets after each chunk."""
    hop, offset, ends = 25, 0, []
    pad = int(np.ceil(n_prompt / 25) * 25 - n_prompt)
    while True:
        this_hop = hop + pad if offset == 0 else hop
        if n_tokens - offset < this_hop + la:
            return ends
        offset += this_hop
        ends.append(offset)
        hop = min(100, hop * 2)


def test_stream_chunk_ends(demo):
    assert demo.flow.pre_lookahead_len == 3
    assert demo.stream_chunk_ends(27, 75) == []  # a chunk needs its 25 tokens and 3 of look-ahead
    assert demo.stream_chunk_ends(28, 75) == [25]
    assert demo.stream_chunk_ends(28, 74) == []  # prompt 74 + 1 = 75: the first hop is 26
    assert demo.stream_chunk_ends(29, 74) == [26]
    assert demo.stream_chunk_ends(278, 50) == [25, 75, 175, 275]
    for n_prompt in range(0, 80, 7):
        for n_tokens in range(0, 400, 3):
            assert demo.stream_chunk_ends(n_tokens, n_prompt) == _official_chunk_ends(n_tokens, n_prompt)


def test_stream_needs_one_hift_noise_per_chunk(demo):
    inputs = VCInputs(source_tokens=np.arange(130, dtype=np.int32), prompt_tokens=np.zeros(75, np.int32),
                      prompt_mel=np.zeros((150, 80), np.float32), embedding=np.ones(192, np.float32))
    calls = len(demo.stream_chunk_ends(130, 75)) + 1
    assert calls == 3
    with pytest.raises(ValueError, match=r"^hift_noise: 2 arrays for a stream of 3 HiFT calls; pass one per chunk"):
        next(demo.token2wav_stream(inputs, hift_noise=[np.zeros((1, 480, 9), np.float32)] * 2))


def test_bench_refuses_zero_repeats(tmp_path):
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        run_core_bench(tmp_path, repeats=0)


def test_convert_rejects_bad_audio(demo):
    with pytest.raises(AudioError, match="source"):
        demo.convert(np.zeros(0, np.float32), str(PROMPT), source_sr=16000)
    bad = np.ones(16000, np.float32)
    bad[100] = np.nan
    with pytest.raises(AudioError, match="prompt"):
        demo.convert(str(SOURCE), bad, prompt_sr=16000)
    with pytest.raises(AudioError):
        demo.convert(b"definitely not audio", str(PROMPT))


def test_from_pretrained_errors(demo_dir, tmp_path):
    with pytest.raises(CheckpointError, match="model folder not found"):
        CosyVoice2.from_pretrained(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(demo_dir, broken)
    (broken / "campplus.onnx").unlink()
    with pytest.raises(CheckpointError, match="missing campplus.onnx"):
        CosyVoice2.from_pretrained(broken)

    legacy = tmp_path / "legacy"
    shutil.copytree(demo_dir, legacy)
    state = torch.load(legacy / "flow.pt", weights_only=True)
    state[LEGACY_FLOW_KEY] = state.pop(CAUSAL_FLOW_KEY)
    torch.save(state, legacy / "flow.pt")
    with pytest.raises(CheckpointError, match="pre-2025"):
        CosyVoice2.from_pretrained(legacy)

    wrong_dims = tmp_path / "wrong_dims"
    shutil.copytree(demo_dir, wrong_dims)
    write_yaml(ModelConfig.full(), wrong_dims / "cosyvoice2.yaml")
    with pytest.raises(CheckpointError, match="does not match the model built from cosyvoice2.yaml"):
        CosyVoice2.from_pretrained(wrong_dims)


def test_legacy_weight_norm_and_generator_prefix_load(demo_dir, demo, tmp_path):
    """A hift.pt saved as generator.X.weight_g / weight_v loads to the same vocoder."""
    legacy = tmp_path / "legacy_hift"
    shutil.copytree(demo_dir, legacy)
    state = torch.load(legacy / "hift.pt", weights_only=True)
    renamed = {}
    for key, value in state.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        renamed["generator." + key] = value
    torch.save(renamed, legacy / "hift.pt")
    model = CosyVoice2.from_pretrained(legacy)
    mel = torch.randn(1, 80, 20)
    noise = torch.randn(1, 20 * 480, 9)
    a, _ = model.hift.inference(mel, noise_sine=noise)
    b, _ = demo.hift.inference(mel, noise_sine=noise)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_demo_weights_are_deterministic_and_voiced():
    cfg = ModelConfig.tiny()
    flow_a, hift_a = build_demo_models(cfg, seed=3)
    flow_b, hift_b = build_demo_models(cfg, seed=3)
    _, hift_c = build_demo_models(cfg, seed=4)
    for a, b in ((flow_a, flow_b), (hift_a, hift_b)):
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(hift_a.state_dict()["conv_pre.bias"], hift_c.state_dict()["conv_pre.bias"])
    assert not torch.all(flow_a.state_dict()["encoder.after_norm.bias"] == 0)  # perturbed, not the init
    with torch.inference_mode():
        f0 = hift_a.f0_predictor(_calibration_mel(cfg))
    voiced = float((f0 > cfg.hift.nsf_voiced_threshold).float().mean())
    assert voiced > 0.8 and 80 < float(f0.mean()) < 300


def _cli(*args, check=True):
    return subprocess.run([sys.executable, "-m", "cosyvoice_triton", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, check=check, timeout=300)


def test_cli_vc(demo_dir, tmp_path):
    out = tmp_path / "out.wav"
    run = _cli("vc", "--model-dir", demo_dir, "--source", SOURCE, "--prompt", PROMPT, "-o", out)
    assert "real-time factor" in run.stdout and "flow.solver" in run.stdout
    wave, sr = sf.read(out)
    assert sr == 24000 and len(wave) > 24000


def test_cli_errors_are_clear(tmp_path):
    run = _cli("vc", "--model-dir", tmp_path / "missing", "--source", SOURCE, "--prompt", PROMPT,
               "-o", tmp_path / "o.wav", check=False)
    assert run.returncode == 2
    assert "error:" in run.stderr and "model folder not found" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_timed_producer_stops_with_its_consumer():
    closed = []

    def produce():
        try:
            yield from range(10)
        finally:
            closed.append(True)

    timer = StageTimer()
    producer = produce()  # still referenced: only an explicit close stops it
    timed = timer.each(producer, "llm")
    assert next(timed) == 0 and next(timed) == 1
    timed.close()  # the consumer went away: the producer is closed now, not when it is collected
    assert closed == [True] and timer.seconds["llm"] > 0
    assert list(timer.each(iter([3, 4]), "llm")) == [3, 4]  # a plain iterator (no close) passes through
