"""Incremental streaming flow (models/incremental.py): each non-final chunk computes only its new frames, equal to
the recomputing path (official streaming) up to float rounding, at tiny and full dims; the cap falls back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import rel_err

from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.models.incremental import FlowStreamState, cache_bytes_per_frame, incremental_chunk
from cosyvoice_triton.pipeline import CosyVoice2, StageTimer, VCInputs
from cosyvoice_triton.streaming import stream_chunks

MEL_BAR = 1e-5  # new frames against the recomputing call (measured 2-4e-7 at tiny dims: matrix sizes differ)
# The waveform: HiFT's phase accumulation over 480 samples per frame turns float32 rounding of the mel into up to
# ~1e-3 of the waveform (tests/oracle/README.md); the mel HiFT gets is held to MEL_BAR.
WAVE_BAR = 1e-3


def _inputs(n_tokens: int, n_prompt: int, seed: int = 0) -> VCInputs:
    rng = np.random.default_rng(seed)
    return VCInputs(source_tokens=rng.integers(0, 6561, n_tokens).astype(np.int32),
                    prompt_tokens=rng.integers(0, 6561, n_prompt).astype(np.int32),
                    prompt_mel=rng.standard_normal((2 * n_prompt, 80)).astype(np.float32),
                    embedding=rng.standard_normal(192).astype(np.float32))


def _compare_chunks(model: CosyVoice2, inputs: VCInputs, ends=None) -> tuple[FlowStreamState, list[float]]:
    """Every non-final chunk of the official schedule (or of token ``ends``) through both paths."""
    ratio, lookahead = model.flow.token_mel_ratio, model.flow.pre_lookahead_len
    if ends is None:
        chunks = [(c.tokens, c.offset) for c in stream_chunks(inputs.source_tokens.tolist(),
                                                              len(inputs.prompt_tokens), lookahead=lookahead)
                  if not c.final]
    else:
        chunks = [(inputs.source_tokens[: e + lookahead], o) for o, e in zip([0, *ends[:-1]], ends, strict=True)]
    state, errors = FlowStreamState(), []
    for tokens, offset in chunks:
        with torch.inference_mode():
            ref = model._flow(inputs, tokens, streaming=True, finalize=False, timer=StageTimer())
            ref = ref[:, :, offset * ratio:]
            got = incremental_chunk(model.flow, state, *model._tensors(inputs, tokens))[:, :, offset * ratio:]
        assert got.shape == ref.shape
        errors.append(rel_err(got, ref))
    return state, errors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return CosyVoice2.from_pretrained(write_demo_model(tmp_path_factory.mktemp("inc") / "tiny", size="tiny"),
                                      tts=False)


@pytest.mark.parametrize("n_prompt", [50, 47])  # aligned prompt, and one whose first hop is padded to 28
def test_chunks_equal_recompute_tiny(tiny, n_prompt):
    state, errors = _compare_chunks(tiny, _inputs(300, n_prompt))
    assert len(errors) == 4  # hops 25(+pad), 50, 100, 100: the caches are extended three times
    assert max(errors) <= MEL_BAR, errors
    frames = 2 * state.tokens
    assert state.tokens == n_prompt + tiny.stream_chunk_ends(300, n_prompt)[-1]
    per_frame = cache_bytes_per_frame(tiny.config.flow)
    assert 0.9 * per_frame * frames <= state.nbytes() <= 1.1 * per_frame * frames + 1e6  # conv tails on top
    print(f"tiny: worst chunk rel err {max(errors):.2e}; cached state {state.nbytes() / frames / 1e3:.1f} KB per "
          f"mel frame ({state.nbytes() / 1e6:.1f} MB for {frames} frames)")


def test_misaligned_ends_recompute_from_the_start(tiny):
    """A previous end that is not on a chunk boundary leaves frames that later tokens change: such a state is
    dropped and the chunk recomputed from the first frame (still through the incremental code)."""
    state, errors = _compare_chunks(tiny, _inputs(140, 50), ends=[25, 55, 100])  # 50 + 55 tokens: off the grid
    assert max(errors) <= MEL_BAR, errors
    assert state.tokens == 150


def _hift_mels(model, monkeypatch) -> list[np.ndarray]:
    seen, original = [], model._hift

    def spy(mel, *args):
        seen.append(mel.detach().cpu().numpy().copy())
        return original(mel, *args)

    monkeypatch.setattr(model, "_hift", spy)
    return seen


def test_stream_equals_official_and_recompute(oracle_model, ref_npz, monkeypatch):
    z = ref_npz("e2e_vc_stream")
    inputs = VCInputs(source_tokens=z["source_speech_token"][0], prompt_tokens=z["flow_prompt_speech_token"][0],
                      prompt_mel=z["prompt_speech_feat"][0], embedding=z["flow_embedding"][0])
    mels = _hift_mels(oracle_model, monkeypatch)
    oracle_model.incremental_stream = False
    try:
        recompute = list(oracle_model.token2wav_stream(inputs, seed=int(z["seed"])))
    finally:
        oracle_model.incremental_stream = True
    recompute_mels = list(mels)
    mels.clear()
    chunks = list(oracle_model.token2wav_stream(inputs, seed=int(z["seed"])))
    assert [len(c) for c in chunks] == z["chunk_lens"].tolist()
    mel_errors = [rel_err(a, b) for a, b in zip(mels, recompute_mels, strict=True)]
    assert max(mel_errors) <= MEL_BAR, mel_errors
    assert mel_errors[-1] > 0  # the cached chunks really took the other path (their HiFT context reaches here)
    for i, mel in enumerate(mels):
        if f"hift{i}_mel" in z:  # the official mel of each HiFT call, where the oracle has it
            assert rel_err(mel, z[f"hift{i}_mel"]) <= MEL_BAR, f"HiFT call {i}"
    official = rel_err(np.concatenate(chunks), z["speech"][0])
    assert official <= WAVE_BAR
    errors = [rel_err(a, b) for a, b in zip(chunks, recompute, strict=True)]
    assert max(errors) <= WAVE_BAR, errors
    print(f"oracle stream: mel vs recompute {max(mel_errors):.2e}; waveform vs official {official:.2e}, "
          f"vs recompute per chunk {[f'{e:.1e}' for e in errors]}")


def test_cap_falls_back_to_recompute(tiny):
    inputs = _inputs(140, 50)
    tiny.incremental_stream = False
    try:
        recompute = list(tiny.token2wav_stream(inputs))
    finally:
        tiny.incremental_stream = True
    first = cache_bytes_per_frame(tiny.config.flow) * 2 * (50 + 25)
    for cap in (0, int(1.5 * first)):  # nothing fits; the first chunk fits, the second would not
        tiny.incremental_cache_bytes = cap
        try:
            capped = list(tiny.token2wav_stream(inputs))
        finally:
            tiny.incremental_cache_bytes = FlowStreamState().max_cache_bytes
        assert len(capped) == len(recompute) == 3
        if cap == 0:  # every chunk on the official computation: bit for bit
            np.testing.assert_array_equal(np.concatenate(capped), np.concatenate(recompute))
        errors = [rel_err(a, b) for a, b in zip(capped, recompute, strict=True)]
        assert max(errors) <= WAVE_BAR, errors
    state = FlowStreamState(max_cache_bytes=int(1.5 * first))
    with torch.inference_mode():
        assert incremental_chunk(tiny.flow, state, *tiny._tensors(inputs, inputs.source_tokens[:28])) is not None
        assert incremental_chunk(tiny.flow, state, *tiny._tensors(inputs, inputs.source_tokens[:78])) is None
    assert not state.active and state.nbytes() == 0


@pytest.mark.slow
def test_chunks_equal_recompute_full_dims(tmp_path_factory):
    model = CosyVoice2.from_pretrained(write_demo_model(tmp_path_factory.mktemp("inc") / "full", size="full"),
                                       tts=False)
    state, errors = _compare_chunks(model, _inputs(130, 75))  # ends 25, 75: a 3 s prompt, a 5 s answer
    assert len(errors) == 2 and max(errors) <= MEL_BAR, errors
    per_frame = cache_bytes_per_frame(model.config.flow)
    print(f"full dims: worst chunk rel err {max(errors):.2e}; cached state {per_frame / 1e6:.2f} MB per mel frame "
          f"(measured {state.nbytes() / (2 * state.tokens) / 1e6:.2f}), {per_frame * 2 * (75 + 175) / 1e9:.2f} GB "
          f"for a 10 s answer after a 3 s prompt")


def test_the_bench_times_every_chunk_on_both_paths(serving_assets):
    from cosyvoice_triton.bench.incremental import run

    r = run(str(serving_assets["model_dir"]), tokens=120, prompt_tokens=30, rounds=1, threads=1, state_mb=64)
    assert r["family"] == "cosyvoice2" and len(r["chunk_ends"]) >= 2
    assert len(r["chunk_recompute_s"]) == len(r["chunk_incremental_s"]) == len(r["chunk_ends"]) + 1
    assert r["flow_recompute_s"] > 0 and r["flow_incremental_s"] > 0 and r["audio_rel_diff"] < 1e-3
