"""The LM against the official CosyVoice code: tests/fixtures/llm_oracle (made by tests/oracle/make_llm_oracle.py).

The oracle ran the official ``Qwen2LM.inference`` (transformers 4.51.3, its pinned version) with every
``multinomial`` replaced by the inverse-CDF ``pick`` on injected uniforms; here the project's LM gets the same
uniforms. Bars (tests/oracle/README.md): per-step log-probabilities 1e-4 relative, token sequences identical; text ->
waveform on the flow oracle's flow / HiFT with the same HiFT noise: HiFT's input mel within conftest.FEAT_BAR, the
waveform within conftest.waveform_bar of the spread the oracle measured (HiFT's phase accumulation turns float32
rounding of the mel into ~1e-3 of the waveform).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FEAT_BAR, rel_err, waveform_bar
from lm_oracle import (
    ORACLE,
    ORACLE_FULL,
    CountedDraws,
    full_llm_dir,
    oracle_cases,
    oracle_config,
    oracle_meta,
    oracle_script,
)

from cosyvoice_triton.models import sampling as project_sampling
from cosyvoice_triton.models.llm import LMRequest, load_llm

LOGP_BAR = 1e-4
oracle = oracle_script()


@pytest.fixture(scope="module")
def lm():
    return load_llm(ORACLE, oracle_config(ORACLE))


@pytest.fixture(scope="module")
def cases():
    return oracle_cases(ORACLE)


def _decode(lm, z: dict[str, np.ndarray], logp_steps: int):
    draw = CountedDraws(z["draws"])
    logps: list[torch.Tensor] = []

    def on_step(step: int, logp: torch.Tensor) -> None:
        if step < logp_steps:
            logps.append(logp)

    stream = lm.generate(z["text"], z["prompt_text"], z["prompt_speech_token"], draws=draw, on_step=on_step)
    tokens = list(stream)
    return tokens, stream, logps, draw


def _check_case(name, z, tokens, stream, logps, draw, logp_steps):
    assert (stream.min_len, stream.max_len) == (int(z["min_len"]), int(z["max_len"])), name
    n_ref = min(logp_steps, int(z["n_steps"]))
    assert len(logps) == n_ref == len(z["logp"]), name
    errors = [rel_err(got, ref) for got, ref in zip(logps, z["logp"], strict=True)]
    assert max(errors) <= LOGP_BAR, f"{name}: per-step log-prob rel err {max(errors):.2e} (steps {errors})"
    assert tokens == z["tokens"].tolist(), name
    assert stream.hit_max_len == (int(z["stop_token"]) < 0), name
    assert draw.used == int(z["draws_used"]), f"{name}: {draw.used} draws used, the official code {z['draws_used']}"
    return max(errors)


# ------------------------------------------------------------------------------------------------ tiny


def test_oracle_checkpoint_loads_exactly(lm):
    meta = oracle_meta(ORACLE)
    assert oracle.state_digest(lm.state_dict()) == meta["weights"]["state_sha256"]
    # the tied lm_head of the official file is the same tensor as the text embedding after loading
    assert lm.llm.model.lm_head.weight.data_ptr() == lm.qwen.embed_tokens.weight.data_ptr()


def test_pick_is_the_oracle_rule():
    g = np.random.default_rng(0)
    for n in (1, 2, 7, 25, 6564):
        probs = torch.from_numpy(g.random(n).astype(np.float32))
        probs[torch.from_numpy(g.random(n) < 0.3)] = 0.0
        if not bool((probs > 0).any()):
            probs[-1] = 0.5
        for u in [0.0, 0.5, 1 - 2**-53, *g.random(50).tolist()]:
            assert project_sampling.pick(probs, u) == oracle.pick(probs, u), (n, u)


def test_cases_cover_both_sampling_paths_and_both_endings(cases):
    assert {str(z["mode"]) for z in cases.values()} == {"zero_shot", "cross_lingual", "instruct"}
    assert any(int(z["stop_token"]) < 0 for z in cases.values())  # one case runs to max_len
    assert any(int(z["stop_token"]) >= 0 for z in cases.values())
    assert all((z["step_draws"] == 2).any() for z in cases.values())  # the repetition fallback in each case
    assert len({len(z["text"]) for z in cases.values()}) == len(cases)


@pytest.mark.parametrize("name", ["zero_shot_a", "zero_shot_b", "zero_shot_short", "cross_lingual", "instruct"])
def test_one_by_one_matches_official(lm, cases, name):
    z = cases[name]
    _check_case(name, z, *_decode(lm, z, len(z["logp"])), len(z["logp"]))


@pytest.mark.parametrize("max_batch", [None, 2])
def test_batch_matches_official(lm, cases, max_batch):
    names = sorted(cases)
    requests = [LMRequest(cases[n]["text"], cases[n]["prompt_text"], cases[n]["prompt_speech_token"],
                          draws=cases[n]["draws"].tolist()) for n in names]
    out = lm.generate_batch(requests, max_batch=max_batch)
    for name, tokens in zip(names, out, strict=True):
        assert tokens == cases[name]["tokens"].tolist(), name


def _tts_case(stream: bool) -> dict[str, np.ndarray]:
    with np.load(ORACLE / ("tts_zero_shot_stream.npz" if stream else "tts_zero_shot.npz")) as f:
        return {k: f[k] for k in f.files}


def _wave_bar() -> float:
    """The waveform bar of both text -> waveform cases: from the spread measured on the non-streaming case's HiFT
    input (the streaming case has the same tokens; each of its HiFT calls is shorter and accumulates less)."""
    return waveform_bar(oracle_meta(ORACLE)["tts_cases"]["tts_zero_shot"]["waveform_spread"])


def _token2wav(model, z, tokens, stream: bool, seed: int, monkeypatch, perturb: float = 0.0):
    """(waveform, the mel of every HiFT call) of the flow oracle's model on ``tokens``; ``perturb``: HiFT's mel is
    moved by that much (relative) first, a deliberately wrong input."""
    from cosyvoice_triton.pipeline import VCInputs

    mels, original = [], model._hift

    def spy(mel, *args):
        if perturb:
            mel = mel + perturb * mel.abs().max() * torch.randn(mel.shape, generator=torch.Generator().manual_seed(7))
        mels.append(mel.detach().cpu().numpy().copy())
        return original(mel, *args)

    monkeypatch.setattr(model, "_hift", spy)
    inputs = VCInputs(source_tokens=np.asarray(tokens, np.int32), prompt_tokens=z["prompt_speech_token"],
                      prompt_mel=z["prompt_speech_feat"][0], embedding=z["embedding"][0])
    if stream:
        chunks = list(model.token2wav_stream(inputs, seed=seed))
        assert [len(c) for c in chunks] == z["chunk_lens"].tolist()
        wave = np.concatenate(chunks)
    else:
        wave = model.token2wav(inputs, seed=seed)
    monkeypatch.undo()
    return wave, mels


def test_text_to_waveform_uses_the_flow_oracle_weights(flow_oracle_meta):
    assert oracle_meta(ORACLE)["flow_hift"]["state_sha256"] == flow_oracle_meta["weights"]["state_sha256"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_to_waveform_matches_official(lm, oracle_model, stream, monkeypatch):
    z = _tts_case(stream)
    tokens = list(lm.generate(z["text"], z["prompt_text"], z["prompt_speech_token"], draws=z["draws"].tolist()))
    assert tokens == z["tokens"].tolist()
    wave, mels = _token2wav(oracle_model, z, tokens, stream, int(z["seed"]), monkeypatch)
    assert len(mels) == int(z["n_hift_calls"])
    for i, mel in enumerate(mels):
        # measured 0 (bit-identical) non-streaming; 2.9e-7 (one ulp at a few elements) in both stream calls
        assert rel_err(mel, z[f"hift{i}_mel"]) <= FEAT_BAR, f"HiFT call {i}"
    # measured 1.2e-6 non-streaming; 6.1e-4 streaming: that one ulp of the mel, amplified by HiFT's phase
    assert rel_err(wave, z["speech"][0]) <= _wave_bar()


@pytest.mark.parametrize("stream", [False, True])
def test_wrong_text_to_waveform_fails_the_bars(oracle_model, stream, monkeypatch):
    """The bars tell a wrong implementation apart: HiFT's mel off by 1e-4 relative, or the noise of another seed."""
    z = _tts_case(stream)
    bar = _wave_bar()
    assert bar < 0.05, "the measured spread is implausibly large"
    wave, _ = _token2wav(oracle_model, z, z["tokens"], stream, int(z["seed"]) + 1, monkeypatch)
    assert rel_err(wave, z["speech"][0]) > bar
    wave, mels = _token2wav(oracle_model, z, z["tokens"], stream, int(z["seed"]), monkeypatch, perturb=1e-4)
    assert rel_err(mels[0], z["hift0_mel"]) > FEAT_BAR
    assert rel_err(wave, z["speech"][0]) > bar


# ------------------------------------------------------------------------------------------------ full


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    return full_llm_dir(tmp_path_factory, "llm_full")


@pytest.mark.slow
def test_full_dims_match_official(full_dir):
    lm = load_llm(full_dir, oracle_config(ORACLE_FULL))
    cases = oracle_cases(ORACLE_FULL)
    assert cases
    worst = {name: _check_case(name, z, *_decode(lm, z, len(z["logp"])), len(z["logp"]))
             for name, z in cases.items()}
    names = sorted(cases)
    requests = [LMRequest(cases[n]["text"], cases[n]["prompt_text"], cases[n]["prompt_speech_token"],
                          draws=cases[n]["draws"].tolist()) for n in names]
    assert lm.generate_batch(requests) == [cases[n]["tokens"].tolist() for n in names]
    print(f"full dims: worst per-step log-prob rel err {worst}")
