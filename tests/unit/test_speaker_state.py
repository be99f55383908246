"""Per-speaker state (speaker_state.py): the LM prefix of a transcript and the flow's settled prompt frames are
computed once per registered speaker; a request that uses them equals one that does not (tokens identical, logits
and mel within float rounding), bounded in bytes and dropped with the speaker."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FIXTURES, rel_err
from test_incremental import _inputs

from cosyvoice_triton.errors import LLMError
from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.models.incremental import FlowStreamState, incremental_chunk, prompt_state
from cosyvoice_triton.models.llm import END, LMRequest
from cosyvoice_triton.pipeline import CosyVoice2, StageTimer, VCInputs
from cosyvoice_triton.speaker_state import SpeakerState
from cosyvoice_triton.streaming import stream_chunks

PROMPT = FIXTURES / "prompt_en_3s.wav"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."
TEXT = "Hello world, this is a short test."
LOGP_BAR = 1e-4  # log-probabilities, prefix + rest against one prefill (measured ~1e-6: other matrix sizes)
MEL_BAR = 1e-5  # as tests/unit/test_incremental.py
WAVE_BAR = 1e-3  # HiFT turns mel rounding into up to ~1e-3 of the waveform (tests/oracle/README.md)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = write_demo_model(tmp_path_factory.mktemp("spk_state") / "tiny", size="tiny", seed=0)
    return CosyVoice2.from_pretrained(d, tts=True)


@pytest.fixture(scope="module")
def prompt(model):
    return model.prompt(str(PROMPT), prompt_text=PROMPT_TEXT)


def _steps(lm, request: LMRequest, n_steps: int = 30) -> tuple[list[int], list[torch.Tensor]]:
    logps: list[torch.Tensor] = []
    request.on_step = lambda step, logp: logps.append(logp)
    decoder = lm.batch_decoder()
    rid = decoder.add(request)
    tokens = []
    for _ in range(n_steps):
        token = decoder.step()[rid]
        if token == END:
            break
        tokens.append(token)
    return tokens, logps


def test_lm_prefix_equals_one_prefill(model, prompt):
    lm = model.llm
    text = model.text.tokenize("Some words to say, and a few more of them.")
    prefix = lm.prefix(prompt.prompt_text_tokens)
    assert prefix.length == 1 + len(prompt.prompt_text_tokens) and prefix.nbytes > 0

    def request(prefix=None):
        return LMRequest(text, prompt.prompt_text_tokens, prompt.prompt_tokens, prefix=prefix,
                         draws=torch.Generator().manual_seed(5))

    want_tokens, want = _steps(lm, request())
    keys = [layer.keys.clone() for layer in prefix.cache.layers]
    for _ in range(2):  # the prefix is shared: using it leaves it as it was
        got_tokens, got = _steps(lm, request(prefix))
        assert got_tokens == want_tokens and len(got) == len(want) > 5
        assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) <= LOGP_BAR
    for layer, before in zip(prefix.cache.layers, keys, strict=True):
        assert torch.equal(layer.keys, before)


def test_lm_prefix_in_a_batch_and_refused_for_other_text(model, prompt):
    lm = model.llm
    text_a, text_b = model.text.tokenize("First request here."), model.text.tokenize("A second, longer one to say.")
    prefix = lm.prefix(prompt.prompt_text_tokens)
    reqs = [LMRequest(t, prompt.prompt_text_tokens, prompt.prompt_tokens, draws=torch.Generator().manual_seed(i))
            for i, t in enumerate((text_a, text_b))]
    want = lm.generate_batch(reqs)
    shared = [LMRequest(r.text_tokens, r.prompt_text_tokens, r.prompt_speech_tokens, prefix=prefix,
                        draws=torch.Generator().manual_seed(i)) for i, r in enumerate(reqs)]
    assert lm.generate_batch(shared) == want  # prefilled after the prefix, decoded together
    with pytest.raises(LLMError, match="other prompt text tokens"):
        lm.batch_decoder().add(LMRequest(text_a, prompt.prompt_text_tokens[:-1], prefix=prefix))


def _stream_mels(model: CosyVoice2, inputs: VCInputs, state: FlowStreamState) -> list[torch.Tensor]:
    out = []
    for chunk in stream_chunks(inputs.source_tokens.tolist(), len(inputs.prompt_tokens),
                               lookahead=model.flow.pre_lookahead_len):
        if chunk.final:
            break
        with torch.inference_mode():
            mel = incremental_chunk(model.flow, state, *model._tensors(inputs, chunk.tokens))
        out.append(mel[:, :, chunk.offset * model.flow.token_mel_ratio:])
    return out


@pytest.mark.parametrize(("n_prompt", "settled"), [(75, 50), (53, 50), (52, 25), (27, 0)])
def test_flow_prompt_state_equals_the_stream_from_scratch(model, n_prompt, settled):
    inputs = _inputs(260, n_prompt)
    with torch.inference_mode():
        _, *prompt_tensors = model._tensors(inputs, inputs.prompt_tokens[:0])
        cached = prompt_state(model.flow, *prompt_tensors)
    if settled == 0:  # shorter than one chunk + the look-ahead: nothing settles before the source
        assert cached is None
        return
    assert cached.tokens == settled and cached.mel.shape[-1] == 2 * settled
    want = _stream_mels(model, inputs, FlowStreamState())
    for _ in range(2):  # each stream continues from its own copy
        got = _stream_mels(model, inputs, cached.copy())
        assert [g.shape for g in got] == [w.shape for w in want]
        assert max(rel_err(g, w) for g, w in zip(got, want, strict=True)) <= MEL_BAR
    assert cached.tokens == settled  # the shared state did not move


def test_registered_speaker_reuses_its_state_and_equals_an_uncached_request(model, prompt, tmp_path):
    model.speakers.put("alice", prompt)
    state = model.speaker_state
    state.clear()
    timer = StageTimer()
    first = list(model.tts_stream(TEXT, speaker_id="alice", seed=7, timer=timer))
    assert "speaker_state" in timer.seconds
    after_first = state.stats()
    assert after_first["misses"] == 2 and after_first["entries"] == 2  # the LM prefix and the flow state
    again = list(model.tts_stream(TEXT, speaker_id="alice", seed=7))
    assert state.stats()["hits"] == after_first["hits"] + 2
    assert [len(c) for c in again] == [len(c) for c in first]
    for a, b in zip(again, first, strict=True):
        np.testing.assert_array_equal(a, b)

    model.speaker_state = None  # the same request without the state: every chunk within the waveform bar
    try:
        plain = list(model.tts_stream(TEXT, speaker_id="alice", seed=7))
    finally:
        model.speaker_state = state
    assert [len(c) for c in plain] == [len(c) for c in first]
    assert max(float(np.abs(a - b).max()) for a, b in zip(first, plain, strict=True)) <= WAVE_BAR

    model.speakers.delete("alice")  # the speaker's entries go with it
    assert state.stats()["entries"] == 0


def test_replacing_a_speaker_drops_its_state_and_the_bound_holds(model, prompt):
    model.speakers.put("bob", prompt)
    state = model.speaker_state
    state.clear()
    list(model.tts_stream(TEXT, speaker_id="bob", seed=1))
    assert state.stats()["entries"] == 2
    model.speakers.put("bob", prompt)  # replaced (the same content: still recomputed on the next request)
    assert state.stats()["entries"] == 0
    model.speakers.delete("bob")

    tiny = SpeakerState(max_bytes=1024)  # smaller than any flow state: computed, not kept
    with torch.inference_mode():
        _, *tensors = model._tensors(model.tts_requests(TEXT, speaker_id=None, prompt_audio=str(PROMPT),
                                                        prompt_text=PROMPT_TEXT)[0].flow_inputs(),
                                     np.zeros(0, np.int32))
    assert tiny.flow_state(model.flow, prompt, tensors, max_cache_bytes=1 << 30) is not None
    assert tiny.stats()["entries"] == 0 and tiny.stats()["bytes"] == 0
    with pytest.raises(ValueError, match="max_bytes"):
        SpeakerState(max_bytes=0)
