"""The CosyVoice3 LM against the official code: tests/fixtures/cv3_llm_oracle (tests/oracle/make_cv3_llm_oracle.py).

The oracle ran the official ``CosyVoice3LM.inference`` (through ``CosyVoice3Model.llm_job``; transformers 4.51.3)
with every ``multinomial`` replaced by the inverse-CDF ``pick`` on injected uniforms; here the project's LM gets the
same uniforms. ``llm.pt`` (tiny dims but Qwen2.5's 151936-id text vocabulary, ~20 MB) is not committed: it is
regenerated from the oracle's seeded draws and checked against the recorded digest. Bars as the CosyVoice2 LM's
(tests/oracle/cosyvoice3_llm.md): per-step log-probabilities 1e-4 relative, tokens and draws identical.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from conftest import FIXTURES, official_git, oracle_meta, oracle_script, rel_err
from lm_oracle import CountedDraws

from cosyvoice_triton.errors import CheckpointError, ConfigError, LLMError
from cosyvoice_triton.models.bistream import live_decode
from cosyvoice_triton.models.cosyvoice3.llm import (
    ENDOFPROMPT,
    SILENT_TOKENS,
    CosyVoice3LM,
    drop_long_silences,
    load_llm3,
    read_llm3_config,
)
from cosyvoice_triton.models.llm import LMRequest, mode_request

ORACLE = FIXTURES / "cv3_llm_oracle"
LOGP_BAR = 1e-4
CASES = ["zero_shot_a", "zero_shot_b", "zero_shot_one", "cross_lingual", "instruct", "zero_shot_other_stop",
         "zero_shot_early_eos"]


def _oracle_script():
    """tests/oracle/make_cv3_llm_oracle.py as a module (its seeded weights)."""
    return oracle_script("make_cv3_llm_oracle")


@functools.cache
def meta() -> dict:
    return oracle_meta(ORACLE)


def case(name: str) -> dict[str, np.ndarray]:
    with np.load(ORACLE / f"lm_{name}.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    """The oracle's llm.pt, regenerated from its seed and checked by digest."""
    oracle = _oracle_script()
    state = oracle.random_cv3_llm_state_dict(meta()["qwen_config"], seed=meta()["seeds"]["weights"])
    assert oracle.cv2_oracle.state_digest(state) == meta()["weights"]["state_sha256"], \
        "regenerated weights differ from the oracle's (another torch draws otherwise: regenerate the oracle)"
    return state


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, state):
    d = tmp_path_factory.mktemp("cv3_llm")
    torch.save(state, d / "llm.pt")
    shutil.copy(ORACLE / "cosyvoice3.yaml", d / "cosyvoice3.yaml")
    shutil.copytree(ORACLE / "CosyVoice-BlankEN", d / "CosyVoice-BlankEN")
    return d


@pytest.fixture(scope="module")
def lm(model_dir) -> CosyVoice3LM:
    return load_llm3(model_dir)


# ------------------------------------------------------------------------------------------- layout, loading


def test_checkpoint_has_the_official_names_and_loads_exactly(lm, state):
    hidden, n = meta()["qwen_config"]["hidden_size"], 6561 + 200
    assert "llm_embedding.weight" not in state and "llm_decoder.bias" not in state
    assert tuple(state["llm_decoder.weight"].shape) == (n, hidden)
    assert tuple(state["speech_embedding.weight"].shape) == (n, hidden)
    assert set(lm.state_dict()) == set(state)
    assert _oracle_script().cv2_oracle.state_digest(lm.state_dict()) == meta()["weights"]["state_sha256"]
    assert lm.llm.model.lm_head.weight.data_ptr() == lm.qwen.embed_tokens.weight.data_ptr()  # tied, as loaded


def test_special_tokens_live_in_the_speech_embedding(lm):
    s = lm.speech_token_size
    assert (lm.sos, lm.eos_token, lm.task_id, lm.fill_token) == (s, s + 1, s + 2, s + 3)
    assert lm.stop_token_ids == tuple(range(s, s + 200))
    assert lm.min_len_masked_token == s  # the official sampling_ids masks speech_token_size: sos here, not eos
    z = case("zero_shot_a")
    x = lm.lm_input(z["text"], z["prompt_text"], z["prompt_speech_token"])[0]
    n_text = len(z["prompt_text"]) + len(z["text"])
    assert torch.equal(x[0], lm.speech_embedding.weight[s])
    assert torch.equal(x[1 + n_text], lm.speech_embedding.weight[s + 2])
    assert torch.equal(x[2 + n_text:], lm.speech_embedding.weight[torch.as_tensor(z["prompt_speech_token"]).long()])
    assert x.shape[0] == 2 + n_text + len(z["prompt_speech_token"])


def test_yaml_llm_section(model_dir):
    config = read_llm3_config(model_dir)
    hidden = meta()["qwen_config"]["hidden_size"]
    assert (config.llm_input_size, config.llm_output_size, config.speech_token_size) == (hidden, hidden, 6561)
    assert tuple(config.mix_ratio) == (5, 15)
    assert (config.sampling.top_p, config.sampling.top_k, config.sampling.win_size, config.sampling.tau_r) == \
        (0.8, 25, 10, 0.1)


def test_official_yaml_llm_section(tmp_path):
    """The released example's yaml (from ``$COSYVOICE_OFFICIAL_GIT``) reads as the full-size CosyVoice3 LM."""
    git = official_git()
    text = subprocess.run(["git", "--git-dir", str(git if (git / "HEAD").exists() else git / ".git"), "show",
                           "ace7c47:examples/libritts/cosyvoice3/conf/cosyvoice3.yaml"],
                          capture_output=True, text=True, check=True).stdout
    path = tmp_path / "cosyvoice3.yaml"
    path.write_text(text)
    config = read_llm3_config(path)
    assert (config.llm_input_size, config.llm_output_size, config.speech_token_size) == (896, 896, 6561)


def _folder(tmp_path, model_dir, state=None, yaml_text=None, qwen=None):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    if state is not None:
        torch.save(state, d / "llm.pt")
    if yaml_text is not None:
        (d / "cosyvoice3.yaml").write_text(yaml_text)
    if qwen is not None:
        (d / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(qwen))
    return d


def test_missing_key_is_named(tmp_path, model_dir, state):
    broken = {k: v for k, v in state.items() if k != "speech_embedding.weight"}
    with pytest.raises(CheckpointError, match=r"1 missing: speech_embedding\.weight"):
        load_llm3(_folder(tmp_path, model_dir, state=broken))


def test_mis_shaped_key_is_named(tmp_path, model_dir, state):
    broken = dict(state, **{"llm_decoder.weight": state["llm_decoder.weight"][:6564]})  # CosyVoice2's S + 3 rows
    with pytest.raises(CheckpointError, match=r"llm_decoder\.weight: file \(6564, 32\), model \(6761, 32\)"):
        load_llm3(_folder(tmp_path, model_dir, state=broken))


def test_unexpected_key_is_named(tmp_path, model_dir, state):
    broken = dict(state, **{"llm_decoder.bias": torch.zeros(6761)})
    with pytest.raises(CheckpointError, match="CosyVoice2 llm.pt"):
        load_llm3(_folder(tmp_path / "a", model_dir, state=broken))
    broken = dict(state, extra=torch.zeros(1))
    with pytest.raises(CheckpointError, match="1 unexpected: extra"):
        load_llm3(_folder(tmp_path / "b", model_dir, state=broken))


def test_cosyvoice2_checkpoint_is_refused(tmp_path, model_dir):
    d = _folder(tmp_path, model_dir)
    shutil.copy(FIXTURES / "llm_oracle" / "llm.pt", d / "llm.pt")
    with pytest.raises(CheckpointError, match="a CosyVoice2 llm.pt"):
        load_llm3(d)


def test_pickled_code_is_refused(tmp_path, model_dir):
    d = _folder(tmp_path, model_dir)
    torch.save({"llm_decoder.weight": torch.zeros(2), "m": torch.nn.Linear(2, 2)}, d / "llm.pt")
    with pytest.raises(CheckpointError, match="llm.pt: holds pickled objects other than tensors"):
        load_llm3(d)


def test_bad_configs_are_refused(tmp_path, model_dir):
    yaml_text = (model_dir / "cosyvoice3.yaml").read_text()
    with pytest.raises(ConfigError, match="not cosyvoice.llm.llm.CosyVoice3LM"):
        load_llm3(_folder(tmp_path / "a", model_dir, yaml_text=yaml_text.replace("CosyVoice3LM", "Qwen2LM")))
    with pytest.raises(ConfigError, match="disagree with the Qwen2 hidden_size"):
        load_llm3(_folder(tmp_path / "b", model_dir, yaml_text=yaml_text.replace("llm_input_size: 32",
                                                                                   "llm_input_size: 64")))
    qwen = dict(meta()["qwen_config"], vocab_size=4096)
    with pytest.raises(ConfigError, match=re.escape("no row for <|endofprompt|> (151646)")):
        load_llm3(_folder(tmp_path / "c", model_dir, qwen=qwen))
    with pytest.raises(ConfigError, match="has cosyvoice3.yaml"):
        load_llm3(tmp_path)


def test_input_without_endofprompt_is_refused(lm):
    z = case("zero_shot_a")
    prompt = z["prompt_text"][z["prompt_text"] != ENDOFPROMPT]
    with pytest.raises(LLMError, match="endofprompt"):
        lm.generate(z["text"], prompt, z["prompt_speech_token"])
    with pytest.raises(LLMError, match="endofprompt"):
        lm.generate_batch([LMRequest(z["text"], prompt, z["prompt_speech_token"])])
    with pytest.raises(LLMError, match="outside"):
        lm.generate(z["text"], z["prompt_text"], [6561])  # sos is no prompt speech token


# ------------------------------------------------------------------------------------------------- decoding


def test_cases_cover_the_layouts_and_endings():
    cases = {n: case(n) for n in CASES}
    assert set(meta()["lm_cases"]) == set(CASES)
    assert {str(z["mode"]) for z in cases.values()} == {"zero_shot", "cross_lingual", "instruct"}
    stops = {int(z["stop_token"]) for z in cases.values()}
    assert -1 in stops  # one case runs to max_len
    assert 6562 in stops  # end-of-speech
    assert 6561 + 57 in stops  # another stop id
    assert any(int(z["stop_token"]) >= 0 and len(z["tokens"]) < int(z["min_len"]) for z in cases.values()), \
        "no case stops before min_len (the official mask is on sos, not on end-of-speech)"
    assert all((z["step_draws"] == 2).any() for z in cases.values())  # the repetition fallback in each case
    assert any(len(z["llm_job_tokens"]) < len(z["tokens"]) for z in cases.values()), "no silent run was cut"


@pytest.mark.parametrize("name", CASES)
def test_one_by_one_matches_official(lm, name):
    z = case(name)
    draw, logps = CountedDraws(z["draws"]), []
    stream = lm.generate(z["text"], z["prompt_text"], z["prompt_speech_token"], draws=draw,
                         on_step=lambda step, logp: logps.append(logp) if step < len(z["logp"]) else None)
    tokens = list(stream)
    assert (stream.min_len, stream.max_len) == (int(z["min_len"]), int(z["max_len"]))
    assert len(logps) == len(z["logp"]) == min(int(z["n_steps"]), meta()["logp_steps"])
    errors = [rel_err(got, ref) for got, ref in zip(logps, z["logp"], strict=True)]
    assert max(errors) <= LOGP_BAR, f"per-step log-prob rel err {max(errors):.2e}"
    assert tokens == z["tokens"].tolist()
    assert stream.hit_max_len == (int(z["stop_token"]) < 0)
    assert draw.used == int(z["draws_used"])
    assert list(drop_long_silences(tokens)) == z["llm_job_tokens"].tolist()


@pytest.mark.parametrize("max_batch", [None, 2])
def test_batch_matches_official(lm, max_batch):
    cases = [case(n) for n in CASES]
    requests = [LMRequest(z["text"], z["prompt_text"], z["prompt_speech_token"], draws=z["draws"].tolist())
                for z in cases]
    out = lm.generate_batch(requests, max_batch=max_batch)
    assert out == [z["tokens"].tolist() for z in cases]


def test_mode_requests_build_the_official_layouts(lm):
    """``mode_request`` puts each case's inputs where the official front end does (instruct2: the instruction in
    the prompt text's place, no prompt speech tokens; cross-lingual: neither prompt)."""
    for name in ("zero_shot_a", "cross_lingual", "instruct"):
        z = case(name)
        mode = str(z["mode"])
        if mode == "instruct":
            request = mode_request(mode, z["text"], instruct_tokens=z["prompt_text"], prompt_speech_tokens=[1, 2],
                                   draws=z["draws"].tolist())
        else:
            request = mode_request(mode, z["text"], prompt_text_tokens=z["prompt_text"],
                                   prompt_speech_tokens=z["prompt_speech_token"], draws=z["draws"].tolist())
        assert lm.generate_batch([request]) == [z["tokens"].tolist()], name


def test_drop_long_silences():
    s = sorted(SILENT_TOKENS)
    tokens = [7, *s[:7], 9, s[0], s[1], 10, *[s[2]] * 6]
    assert list(drop_long_silences(tokens)) == [7, *s[:5], 9, s[0], s[1], 10, *[s[2]] * 5]
    assert list(drop_long_silences([])) == []


# ------------------------------------------------------------------------------------------- live (bistream)

BISTREAM_CASES = ["bistream_runout", "bistream_left", "bistream_instruct", "bistream_chunks"]


def bistream_case(name: str) -> dict[str, np.ndarray]:
    with np.load(ORACLE / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def _live(lm, z, **options):
    bounds = np.cumsum([0, *z["chunk_sizes"]])
    chunks = [z["text"][a:b] for a, b in itertools.pairwise(bounds)]
    draw, logps = CountedDraws(z["draws"]), []
    decode = live_decode(lm, chunks, z["prompt_text"], z["prompt_speech_token"], draws=draw,
                         on_step=lambda step, logp: logps.append(logp), **options)
    return list(decode), decode, draw, logps


def test_bistream_cases_cover_the_layouts():
    cases = {n: bistream_case(n) for n in BISTREAM_CASES}
    assert set(meta()["bistream_cases"]) == set(BISTREAM_CASES)
    assert {str(z["mode"]) for z in cases.values()} == {"zero_shot", "instruct"}
    assert max(cases["bistream_chunks"]["chunk_sizes"]) > 1
    left = cases["bistream_left"]  # prompt speech left over when the text ends
    assert len(left["prompt_speech_token"]) > 15 * ((len(left["text"]) + len(left["prompt_text"])) // 5)
    errors = {str(z["error"]) for z in cases.values()}  # the official code raises at each end (see its page)
    assert {e.rsplit(" ", 1)[-1] for e in errors} >= {"6561", "6562", "6618"}


@pytest.mark.parametrize("name", BISTREAM_CASES)
def test_live_decoding_matches_official_bistream(lm, name):
    """Tokens, draws and per-step log-probs equal to the official ``inference_bistream`` on CosyVoice3's layout;
    where it raises ``should not get token N`` this stops with ``unexpected_token`` N."""
    z = bistream_case(name)
    tokens, decode, draw, logps = _live(lm, z)
    assert tokens == z["tokens"].tolist()
    assert draw.used == int(z["draws_used"])
    assert len(logps) == len(z["sampled"])
    for got, ref in zip(logps, z["logp"], strict=False):
        assert rel_err(got.numpy(), ref) <= LOGP_BAR
    assert decode.decoded[-1] == int(z["sampled"][-1])
    assert decode.fill_token == 6564  # CosyVoice3's fill: S + 3
    stop = int(str(z["error"]).rsplit(" ", 1)[-1])
    assert (decode.stop_reason, decode.stop_token) == ("unexpected_token", stop)


def test_live_decoding_feeds_the_system_prompt_first(lm):
    """Moving ``<|endofprompt|>`` changes what goes in after sos: the log-probs of the first step change (the
    CosyVoice2 layout, all of the prompt text in the text cache, is not CosyVoice3's)."""
    z = bistream_case("bistream_chunks")
    prompt = z["prompt_text"].tolist()
    at = prompt.index(ENDOFPROMPT)
    moved = dict(z, prompt_text=np.array([*prompt[:at], *prompt[at + 1:-1], ENDOFPROMPT, prompt[-1]], np.int32))
    _, _, _, logps = _live(lm, moved)
    assert rel_err(logps[0].numpy(), z["logp"][0]) > 1e-3


def test_live_decoding_needs_endofprompt_in_the_prompt_text(lm):
    z = bistream_case("bistream_runout")
    prompt = [t for t in z["prompt_text"].tolist() if t != ENDOFPROMPT]
    with pytest.raises(LLMError, match="endofprompt"):
        live_decode(lm, [z["text"]], prompt, z["prompt_speech_token"], draws=z["draws"].tolist())
