"""The CosyVoice2 LM at tiny dims: checkpoint layout and loading, decoding rules, KV cache, batching."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cosyvoice_triton.config import LLMConfig, ModelConfig, write_yaml
from cosyvoice_triton.errors import CheckpointError, ConfigError, LLMError
from cosyvoice_triton.models.demo import build_demo_llm
from cosyvoice_triton.models.llm import (
    END,
    QWEN_DIR,
    TINY_TEXT_VOCAB,
    LMRequest,
    Qwen2LM,
    load_llm,
    read_qwen_config,
    write_qwen_config,
)

S = 6561  # speech_token_size of the release


def official_keys(num_layers: int) -> list[str]:
    """``state_dict()`` keys of the official ``Qwen2LM``, derived from its structure (cosyvoice/llm/llm.py).

    ``Qwen2LM.__init__`` registers, in this order: ``llm_embedding`` (Embedding(2, D)); ``llm``, a
    ``Qwen2Encoder`` whose ``model`` is a transformers ``Qwen2ForCausalLM`` (``model.embed_tokens``, per layer
    q/k/v projections with bias, o projection without, gate/up/down MLP, two RMSNorms, ``model.norm``, and
    ``lm_head``, listed even when tied to ``embed_tokens``); ``llm_decoder`` (Linear with bias);
    ``criterion_ce`` (no tensors); ``speech_embedding``. Rotary frequencies are non-persistent buffers.
    """
    layer = [f"self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")] + [
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight"]
    qwen = ["model.embed_tokens.weight"]
    qwen += [f"model.layers.{i}.{k}" for i in range(num_layers) for k in layer]
    qwen += ["model.norm.weight", "lm_head.weight"]
    return ["llm_embedding.weight", *(f"llm.model.{k}" for k in qwen), "llm_decoder.weight", "llm_decoder.bias",
            "speech_embedding.weight"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model folder: cosyvoice2.yaml with an llm section, CosyVoice-BlankEN/config.json, llm.pt."""
    root = tmp_path_factory.mktemp("llm")
    config = dataclasses.replace(ModelConfig.tiny(), llm=LLMConfig.tiny())
    write_yaml(config, root / "cosyvoice2.yaml")
    qwen = write_qwen_config(root / QWEN_DIR, "tiny")
    torch.save(build_demo_llm(config, qwen, seed=0).state_dict(), root / "llm.pt")
    return root


@pytest.fixture(scope="module")
def lm(model_dir) -> Qwen2LM:
    return load_llm(model_dir, ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml"))


def _requests(n: int, seed: int, vocab: int = TINY_TEXT_VOCAB) -> list[LMRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        text = torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        prompt_text = torch.randint(0, vocab, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g)
        prompt_speech = torch.randint(0, S, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g)
        out.append(LMRequest(text, prompt_text, prompt_speech, draws=1000 + i))
    return out


# ------------------------------------------------------------------------------------ layout, loading


def test_state_dict_keys_are_the_official_ones(lm, model_dir):
    assert list(lm.state_dict()) == official_keys(2)
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    assert list(state) == official_keys(2)
    assert torch.equal(state["llm.model.lm_head.weight"], state["llm.model.model.embed_tokens.weight"])  # tied
    assert state["llm_decoder.weight"].shape == (S + 3, 64) and state["speech_embedding.weight"].shape == (S + 3, 64)
    assert state["llm.model.model.embed_tokens.weight"].shape == (TINY_TEXT_VOCAB, 64)
    assert not lm.training


def test_full_dims_layout(tmp_path):
    qwen = write_qwen_config(tmp_path, "full")
    raw = json.loads(qwen.read_text())
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"],
            raw["intermediate_size"], raw["vocab_size"], raw["rope_theta"], raw["tie_word_embeddings"]) == (
        896, 24, 14, 2, 4864, 151936, 1e6, True)
    full = Qwen2LM.from_config(LLMConfig.full(), qwen, init=False)  # uninitialised: shapes only
    shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    assert list(shapes) == official_keys(24)
    assert shapes["llm.model.model.embed_tokens.weight"] == (151936, 896)
    assert shapes["llm.model.model.layers.0.self_attn.k_proj.weight"] == (128, 896)  # 2 kv heads of 64
    assert shapes["llm.model.model.layers.23.mlp.down_proj.weight"] == (896, 4864)
    assert shapes["llm_decoder.weight"] == (S + 3, 896)
    assert full.llm.model.lm_head.weight is full.qwen.embed_tokens.weight


def test_load_round_trip(lm, model_dir):
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    for key, value in lm.state_dict().items():
        assert torch.equal(value, state[key]), key


def _folder_with(tmp_path, model_dir, state=None, qwen_text=None, yaml_config=None):
    folder = tmp_path / "m"
    (folder / QWEN_DIR).mkdir(parents=True)
    config = yaml_config or ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    (folder / QWEN_DIR / "config.json").write_text(qwen_text or (model_dir / QWEN_DIR / "config.json").read_text())
    if state is not None:
        torch.save(state, folder / "llm.pt")
    return folder, config


def test_missing_files(tmp_path, model_dir):
    folder, config = _folder_with(tmp_path, model_dir)
    with pytest.raises(CheckpointError, match=r"m/llm.pt: file not found"):
        load_llm(folder, config)
    (folder / QWEN_DIR / "config.json").unlink()
    torch.save(torch.load(model_dir / "llm.pt", weights_only=True), folder / "llm.pt")
    with pytest.raises(CheckpointError, match=r"CosyVoice-BlankEN/config.json: file not found"):
        load_llm(folder, config)
    with pytest.raises(ConfigError, match="no llm section"):
        load_llm(model_dir, ModelConfig.tiny())


@pytest.mark.parametrize("change", ["missing", "extra", "shape"])
def test_strict_loading(tmp_path, model_dir, change):
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    if change == "missing":
        del state["llm.model.model.layers.1.mlp.up_proj.weight"]
        words = r"1 missing \(e.g. llm.model.model.layers.1.mlp.up_proj.weight\)"
    elif change == "extra":
        state["llm.text_encoder.weight"] = torch.zeros(2)
        words = r"1 unexpected \(e.g. llm.text_encoder.weight\)"
    else:
        state["speech_embedding.weight"] = torch.zeros(4096 + 3, 64)  # a yaml speech_token_size of 4096
        words = r"speech_embedding.weight: file \(4099, 64\) vs model \(6564, 64\)"
    folder, config = _folder_with(tmp_path, model_dir, state)
    with pytest.raises(CheckpointError, match=r"m/llm.pt: does not match .*" + words):
        load_llm(folder, config)


def test_pickled_code_is_refused(tmp_path, model_dir):
    folder, config = _folder_with(tmp_path, model_dir, {"llm": torch.nn.Linear(2, 2)})
    with pytest.raises(CheckpointError, match="llm.pt: holds pickled objects other than tensors"):
        load_llm(folder, config)


def test_dims_that_disagree_with_the_yaml(tmp_path, model_dir):
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    wide = dataclasses.replace(ModelConfig.tiny(), llm=LLMConfig(llm_input_size=128, llm_output_size=128))
    folder, config = _folder_with(tmp_path, model_dir, state, yaml_config=wide)
    with pytest.raises(ConfigError, match=r"\(128, 128\) in cosyvoice2.yaml disagree with the Qwen2 hidden_size 64"):
        load_llm(folder, config)


def test_bad_qwen_config(tmp_path, model_dir):
    folder, config = _folder_with(tmp_path, model_dir, qwen_text=json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="not a Qwen2 config"):
        load_llm(folder, config)
    (folder / QWEN_DIR / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a JSON file"):
        read_qwen_config(folder / QWEN_DIR)


# ------------------------------------------------------------------------------------------ decoding


def test_prompt_layout(lm):
    text, prompt_text, speech = [5, 6, 7], [1, 2], [10, 11, 12, 13]
    x = lm.lm_input(text, prompt_text, speech)[0]
    w = lm.qwen.embed_tokens.weight
    assert x.shape == (1 + 5 + 1 + 4, 64)
    assert torch.equal(x[0], lm.llm_embedding.weight[0])  # sos
    assert torch.equal(x[1:6], w[[1, 2, 5, 6, 7]])  # prompt text, then text
    assert torch.equal(x[6], lm.llm_embedding.weight[1])  # task id
    assert torch.equal(x[7:], lm.speech_embedding.weight[speech])


def test_length_bounds():
    assert Qwen2LM.length_bounds(10, 2, 20) == (20, 200)
    assert Qwen2LM.length_bounds(7, 2.5, 0.3) == (17, 2)
    assert Qwen2LM.length_bounds(3, 0, 0) == (0, 0)
    with pytest.raises(LLMError, match="max_token_text_ratio must be finite"):
        Qwen2LM.length_bounds(3, 2, float("nan"))
    with pytest.raises(LLMError, match="min_token_text_ratio"):
        Qwen2LM.length_bounds(3, -1, 20)


def test_generate_respects_min_and_max_len(lm):
    text, prompt_text = [3, 4, 5, 6], [7, 8, 9, 10, 11]  # bounds come from the 4 text tokens only
    lengths = []
    for seed in range(8):
        stream = lm.generate(text, prompt_text, [1, 2, 3], draws=seed)
        tokens = list(stream)
        assert (stream.min_len, stream.max_len) == (8, 80)
        assert 8 <= len(tokens) <= 80 and all(0 <= t < S for t in tokens)
        assert stream.tokens == tokens and stream.hit_max_len == (len(tokens) == 80)
        lengths.append(len(tokens))
        assert list(stream) == []  # exhausted
    assert len(set(lengths)) > 2  # end-of-speech comes at varied points
    assert sum(n == 80 for n in lengths) <= 2 and sum(n > 8 for n in lengths) >= 4  # mostly, not at once


def _biased(lm: Qwen2LM, bias: dict[int, float]) -> Qwen2LM:
    import copy

    other = copy.deepcopy(lm)
    with torch.no_grad():
        for token, value in bias.items():
            other.llm_decoder.bias[token] = value
            other.llm_decoder.weight[token] = 0
    return other


def test_end_of_speech_is_masked_below_min_len(lm):
    eager = _biased(lm, {S: 50.0})  # end-of-speech is ~certain at every step
    steps = []
    stream = eager.generate([1, 2, 3], draws=0, on_step=lambda i, logp: steps.append(i))
    tokens = list(stream)
    assert len(tokens) == 6 and not stream.hit_max_len  # exactly min_len = 2 * 3 tokens, then EOS
    assert steps == list(range(7))
    assert len(list(eager.generate([1, 2, 3], draws=0, min_token_text_ratio=0))) == 0


def test_other_stop_ids_end_even_below_min_len(lm):
    fill = _biased(lm, {S + 2: 50.0})  # the official code masks only speech_token_size
    stream = fill.generate([1, 2, 3], draws=0)
    assert list(stream) == [] and not stream.hit_max_len


def test_never_ending_lm_stops_at_max_len(lm):
    mute = _biased(lm, {S: -1e4, S + 1: -1e4, S + 2: -1e4})
    stream = mute.generate([1, 2], draws=0, max_token_text_ratio=7)
    tokens = list(stream)
    assert len(tokens) == 14 and stream.hit_max_len
    assert len(list(mute.generate([1], draws=0, max_token_text_ratio=0))) == 0


def test_kv_cache_steps_equal_a_full_recompute(lm):
    text, prompt_text, speech = [9, 8, 7, 6, 5], [4, 3], [100, 200, 300]
    logps = []
    tokens = list(lm.generate(text, prompt_text, speech, draws=3, on_step=lambda i, lp: logps.append(lp)))
    assert len(tokens) >= 10
    with torch.inference_mode():
        x = torch.cat([lm.lm_input(text, prompt_text, speech), lm.speech_embedding.weight[tokens][None]], dim=1)
        hidden = lm.qwen(inputs_embeds=x).last_hidden_state[0]
        full = lm.llm_decoder(hidden[-len(tokens) - 1 :]).log_softmax(-1)
    got = torch.stack(logps[: len(tokens) + 1])
    assert got.shape == full[: len(got)].shape
    torch.testing.assert_close(got, full[: len(got)], rtol=1e-5, atol=1e-5)


def test_seeded_draws_are_deterministic_and_replayable(lm):
    a = list(lm.generate([1, 2, 3, 4], draws=11))
    assert a == list(lm.generate([1, 2, 3, 4], draws=11))
    assert a != list(lm.generate([1, 2, 3, 4], draws=12))
    seen: list[float] = []
    g = torch.Generator().manual_seed(11)

    def recording() -> float:
        seen.append(float(torch.rand((), generator=g, dtype=torch.float64)))
        return seen[-1]

    assert list(lm.generate([1, 2, 3, 4], draws=recording)) == a
    assert list(lm.generate([1, 2, 3, 4], draws=list(seen))) == a  # the same draws as a list
    assert len(seen) >= len(a)  # one draw per token, two on a repetition re-draw


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (([],), "text_tokens: empty"),
        (([1, TINY_TEXT_VOCAB],), f"text_tokens: token id {TINY_TEXT_VOCAB} is outside"),
        (([1, -1],), "text_tokens: token id -1 is outside"),
        (([1], [TINY_TEXT_VOCAB + 5]), "prompt_text_tokens: token id"),
        (([1], [], [S]), f"prompt_speech_tokens: token id {S} is outside \\[0, {S}\\)"),
        (([1.0, 2.0],), "must be integers"),
        ((torch.zeros(2, 3, dtype=torch.long),), "expected a 1-D sequence"),
        ((["a"],), "must be integers|not a sequence"),
    ],
)
def test_bad_tokens(lm, args, words):
    with pytest.raises(LLMError, match=words):
        lm.generate(*args)


def test_too_long_for_the_positions(lm, monkeypatch):
    monkeypatch.setattr(lm.llm.model.config, "max_position_embeddings", 100)
    with pytest.raises(LLMError, match="exceeds the model's 100 positions"):
        lm.generate([1, 2, 3, 4, 5])  # 7 prompt positions + up to 100 tokens
    assert len(list(lm.generate([1, 2, 3], draws=0, max_token_text_ratio=5))) <= 15


# ------------------------------------------------------------------------------------------- batching


def _one_by_one(lm, requests):
    tokens, logps = [], []
    for r in requests:
        steps: list[torch.Tensor] = []
        tokens.append(list(lm.generate(r.text_tokens, r.prompt_text_tokens, r.prompt_speech_tokens, draws=r.draws,
                                       on_step=lambda i, lp, steps=steps: steps.append(lp))))
        logps.append(torch.stack(steps))
    return tokens, logps


def test_batch_equals_one_by_one(lm):
    requests = _requests(5, seed=0)
    assert len({len(r.prompt_speech_tokens) + len(r.text_tokens) for r in requests}) > 2  # different lengths
    single, single_logp = _one_by_one(lm, requests)
    batch_logp: list[list[torch.Tensor]] = [[] for _ in requests]
    for i, r in enumerate(requests):
        r.on_step = lambda step, lp, i=i: batch_logp[i].append(lp)
    assert lm.generate_batch(requests) == single
    for got, want in zip(batch_logp, single_logp, strict=True):
        torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)
    assert len({len(t) for t in single}) > 1  # they end at different steps


def test_in_flight_joining_and_leaving(lm):
    requests = _requests(6, seed=1)
    single, _ = _one_by_one(lm, requests)
    assert lm.generate_batch(requests, max_batch=2) == single  # each joins as another leaves

    decoder = lm.batch_decoder()
    got = {i: [] for i in range(4)}
    ids = [decoder.add(requests[i]) for i in range(3)]
    for _ in range(5):
        for i, token in decoder.step().items():
            got[i].append(token)
    decoder.remove(ids[1])  # cancelled mid-way
    decoder.add(requests[3], request_id=3)  # joins late
    ended = set()
    while len(decoder):
        for i, token in decoder.step().items():
            assert i not in ended
            if token == END:
                ended.add(i)
            else:
                got[i].append(token)
    assert ended == {0, 2, 3}
    assert got[0] == single[0] and got[2] == single[2] and got[3] == single[3]
    assert got[1] == single[1][:5]


def test_max_len_ends_on_the_next_step(lm):
    mute = _biased(lm, {S: -1e4, S + 1: -1e4, S + 2: -1e4})
    decoder = mute.batch_decoder()
    decoder.add(LMRequest([1, 2], draws=0, max_token_text_ratio=1), request_id="short")
    decoder.add(LMRequest([1, 2, 3], draws=1, max_token_text_ratio=2), request_id="long")
    short = decoder.row("short")
    seen = [decoder.step() for _ in range(3)]
    assert [set(s) for s in seen] == [{"short", "long"}, {"short", "long"}, {"short", "long"}]
    assert seen[2]["short"] == END and END not in (seen[0]["short"], seen[1]["short"])
    assert short.hit_max_len and len(short.tokens) == 2 and "short" not in decoder
    with pytest.raises(LLMError, match="no request 'short'"):
        decoder.row("short")
    while len(decoder):
        decoder.step()
    assert decoder.step() == {}
    decoder.add(LMRequest([1]), request_id=0)
    with pytest.raises(LLMError, match="already in this decoder"):
        decoder.add(LMRequest([1]), request_id=0)


def test_demo_weights_vary(lm):
    for key, value in lm.state_dict().items():
        flat = value.flatten()
        assert not torch.all(flat == flat[0]), f"{key} is constant"


def test_inference_modes(lm):
    from cosyvoice_triton.models.llm import mode_request

    text, prompt_text, speech, instruct = [5, 6, 7], [1, 2], [10, 11, 12], [30, 31, 32, 33]
    zero = mode_request("zero_shot", text, prompt_text_tokens=prompt_text, prompt_speech_tokens=speech, draws=4)
    assert (zero.prompt_text_tokens, zero.prompt_speech_tokens, zero.draws) == (prompt_text, speech, 4)
    cross = mode_request("cross_lingual", text, prompt_speech_tokens=speech)
    assert (cross.prompt_text_tokens, cross.prompt_speech_tokens) == ((), ())
    inst = mode_request("instruct", text, instruct_tokens=instruct, prompt_speech_tokens=speech)
    assert (inst.prompt_text_tokens, inst.prompt_speech_tokens) == (instruct, ())
    x = lm.lm_input(inst.text_tokens, inst.prompt_text_tokens, inst.prompt_speech_tokens)
    assert x.shape[1] == 1 + 4 + 3 + 1  # sos, instruction, text, task id; no speech prompt
    with pytest.raises(LLMError, match="prompt text without prompt audio"):
        mode_request("zero_shot", text, prompt_text_tokens=prompt_text)
    with pytest.raises(LLMError, match="cross_lingual takes no prompt text"):
        mode_request("cross_lingual", text, prompt_text_tokens=prompt_text, prompt_speech_tokens=speech)
    with pytest.raises(LLMError, match="instruction's tokens"):
        mode_request("instruct", text, prompt_speech_tokens=speech)
    with pytest.raises(LLMError, match="mode must be one of"):
        mode_request("sft", text)
