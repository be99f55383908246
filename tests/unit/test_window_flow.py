"""Live conversion's cached flow window (models/incremental.py ``window_chunk``): before it forgets anything it gives
the incremental stream's frames; it forgets what the next chunk will not see, so its state stays bounded over a long
stream; unaligned chunks stop it (the caller recomputes)."""

from __future__ import annotations

import numpy as np
import torch
from conftest import rel_err
from test_incremental import MEL_BAR, _inputs

from cosyvoice_triton.models.incremental import FlowStreamState, incremental_chunk, window_chunk

CHUNK = 25


def _window_mels(model, inputs, ends, context):
    """window_chunk over chunks ending at source tokens ``ends`` (each with its 3 look-ahead tokens)."""
    _, prompt_token, prompt_feat, embedding = model._tensors(inputs, inputs.source_tokens[:0])
    state, mels, sizes, done = FlowStreamState(), [], [], 0
    for end in ends:
        token = torch.as_tensor(inputs.source_tokens[done: end + 3], dtype=torch.int32)[None]
        with torch.inference_mode():
            mel = window_chunk(model.flow, state, token, prompt_token, prompt_feat, embedding, context_tokens=context)
        mels.append(mel)
        sizes.append(state.nbytes())
        done = end
    return state, mels, sizes


def test_before_forgetting_it_is_the_incremental_stream(oracle_model):
    inputs = _inputs(260, 40)
    first = CHUNK + (-40 % CHUNK)
    ends = [first + CHUNK * k for k in range(8)]  # every end on a 25-token chunk, as live conversion cuts
    _, got, _ = _window_mels(oracle_model, inputs, ends, context=1000)
    state, done = FlowStreamState(), 0
    for end, mel in zip(ends, got, strict=True):
        with torch.inference_mode():
            want = incremental_chunk(oracle_model.flow, state, *oracle_model._tensors(inputs,
                                                                                      inputs.source_tokens[: end + 3]))
        want = want[:, :, 2 * done:]
        assert mel.shape == want.shape
        assert rel_err(mel, want) <= MEL_BAR
        done = end


def test_it_forgets_what_the_next_chunk_does_not_see(oracle_model):
    inputs = _inputs(700, 40)  # 28 s of tokens
    first = CHUNK + (-40 % CHUNK)
    ends = [first + CHUNK * k for k in range(26)]
    state, mels, sizes = _window_mels(oracle_model, inputs, ends, context=50)
    assert all(m is not None and m.shape[-1] == 2 * CHUNK for m in mels[1:])
    assert mels[0].shape[-1] == 2 * first
    # the keys kept: the prompt's 2 chunks (50 tokens), the 50 before the last chunk's end, the last chunk
    low = state.encoder[0].positions
    assert low.numel() == 50 + 50 and int(low[:50].max()) < 50 and int(low[50:].min()) == 40 + ends[-1] - 50
    assert sizes[-1] == sizes[10] and max(sizes) == sizes[-1]  # bounded: the same bytes chunk after chunk
    assert all(torch.isfinite(m).all() for m in mels)
    # and forgetting changes the frames (the window is narrower than the stream)
    _, wide, _ = _window_mels(oracle_model, inputs, ends[:6], context=1000)
    assert rel_err(torch.cat(mels[:6], -1), torch.cat(wide, -1)) > 1e-3


def test_unaligned_chunks_stop_it(oracle_model):
    inputs = _inputs(200, 40)
    state, mels, _ = _window_mels(oracle_model, inputs, [CHUNK + 12, 2 * CHUNK + 12], context=50)  # off the grid
    assert mels == [None, None] and not state.active and state.nbytes() == 0
    np.testing.assert_array_equal(state.encoder[0].kv, [])
