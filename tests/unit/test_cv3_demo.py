"""The CosyVoice3 demo model folder (``demo-model --family cosyvoice3``): the official layout, every file through the
strict loaders, the official special ids, ``cosyvoice3.yaml`` against the official file, and the v3 speech tokenizer
read as the official front end reads it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import FIXTURES, official_git

from cosyvoice_triton.__main__ import build_parser
from cosyvoice_triton.config import LLMConfig, load_hyperpyyaml
from cosyvoice_triton.errors import CheckpointError, ConfigError, LLMError
from cosyvoice_triton.family import COSYVOICE3_FILES, check_model_folder, model_family
from cosyvoice_triton.frontend.speech_models import SpeakerEncoder, SpeechTokenizer, speech_token_count
from cosyvoice_triton.frontend.text import TextFrontend
from cosyvoice_triton.frontend.text.cosyvoice3 import instruct_text, zero_shot_prompt_text
from cosyvoice_triton.frontend.text.tokenizer import COSYVOICE3_ADDED_SPECIAL_TOKENS, ENDOFPROMPT
from cosyvoice_triton.models.checkpoint import read_state_dict
from cosyvoice_triton.models.cosyvoice3.config import (
    CosyVoice3Config,
    read_cosyvoice3_yaml,
    write_cosyvoice3_yaml,
)
from cosyvoice_triton.models.cosyvoice3.demo import build_demo_flow_hift3
from cosyvoice_triton.models.cosyvoice3.flow import Flow3Dims, load_flow3
from cosyvoice_triton.models.cosyvoice3.hift import Hift3Dims, load_hift3
from cosyvoice_triton.models.cosyvoice3.llm import ENDOFPROMPT as LM_ENDOFPROMPT
from cosyvoice_triton.models.cosyvoice3.llm import CosyVoice3LM, load_llm3, read_llm3_config
from cosyvoice_triton.models.llm import read_qwen_config
from cosyvoice_triton.models.standins import speech_tokenizer_standin, write_speech_tokenizer_standin

TEXT_REF = json.loads((FIXTURES / "text_oracle" / "cosyvoice3.json").read_text())["official_ids_standin"]
OFFICIAL_YAML = "ace7c47:examples/libritts/cosyvoice3/conf/cosyvoice3.yaml"


@pytest.fixture(scope="module")
def demo(cv3_demo_dir) -> Path:
    return cv3_demo_dir


def test_cli_default_family_is_cosyvoice2():
    args = build_parser().parse_args(["demo-model", "--out", "x"])
    assert (args.family, args.size) == ("cosyvoice2", "tiny")


def test_folder_is_a_cosyvoice3_folder(demo):
    assert model_family(demo) == "cosyvoice3" == check_model_folder(demo, "cosyvoice3")
    assert not (demo / "cosyvoice2.yaml").exists() and not (demo / "speech_tokenizer_v2.onnx").exists()
    assert sorted(p.name for p in demo.iterdir()) == sorted([n.rstrip("/") for n in COSYVOICE3_FILES] + ["README.txt"])
    assert "RANDOM WEIGHTS" in (demo / "README.txt").read_text()


def test_yaml_reads_as_the_tiny_config(demo):
    config = read_cosyvoice3_yaml(demo)
    assert config == CosyVoice3Config.tiny()
    assert read_llm3_config(demo) == config.llm == LLMConfig.tiny()
    assert config.mel.fmax is None and config.chunk_size == 25


def test_every_checkpoint_loads_through_the_strict_loaders(demo):
    config = read_cosyvoice3_yaml(demo)
    lm = load_llm3(demo)
    flow = load_flow3(demo / "flow.pt", config.flow)
    hift = load_hift3(demo / "hift.pt", config.hift, noise_seed=3)
    for name, module in (("llm.pt", lm), ("flow.pt", flow), ("hift.pt", hift)):
        state = torch.load(demo / name, map_location="cpu", weights_only=True)
        assert set(state) == set(module.state_dict()), name
    # the tiny dims do not load as the release's
    with pytest.raises(CheckpointError, match="does not match"):
        load_flow3(demo / "flow.pt")
    assert lm.text_vocab_size == read_qwen_config(demo / "CosyVoice-BlankEN").vocab_size == 151936


def test_tokenizer_has_the_official_special_ids(demo):
    frontend = TextFrontend(demo / "CosyVoice-BlankEN", family="cosyvoice3")
    tok = frontend.tokenizer
    assert {t: tok.token_id(t) for t in COSYVOICE3_ADDED_SPECIAL_TOKENS} == TEXT_REF["special_ids"]
    assert tok.token_id(ENDOFPROMPT) == LM_ENDOFPROMPT
    assert len(tok) == TEXT_REF["tokenizer_len"] <= read_qwen_config(demo / "CosyVoice-BlankEN").vocab_size
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((demo / "CosyVoice-BlankEN").iterdir())
           if p.name != "config.json"}
    assert sha == TEXT_REF["sha256"]


def test_front_end_tokens_drive_the_lm(demo):
    frontend = TextFrontend(demo / "CosyVoice-BlankEN", family="cosyvoice3")
    lm = load_llm3(demo)
    (_, text), *_ = frontend.tts_segments("收到好友从远方寄来的生日礼物。")
    prompt = frontend.prompt_tokens(zero_shot_prompt_text("希望你以后能够做的比我还好呦。"))
    lengths = [len(list(lm.generate(text, prompt, np.arange(25), draws=torch.Generator().manual_seed(s))))
               for s in range(4)]
    assert all(0 < n <= 20 * len(text) for n in lengths) and len(set(lengths)) > 1, lengths
    instruct = frontend.instruct_tokens(instruct_text("请用广东话表达。"))
    assert len(list(lm.generate(text, instruct, draws=torch.Generator().manual_seed(0)))) > 0
    with pytest.raises(LLMError, match="no <\\|endofprompt\\|>"):
        list(lm.generate(text, frontend.prompt_tokens("希望你以后能够做的比我还好呦。")))


def test_speech_tokenizer_v3_and_campplus(demo):
    tokenizer = SpeechTokenizer(demo / "speech_tokenizer_v3.onnx", version="v3")
    assert tokenizer.standin
    feats = np.random.default_rng(0).normal(-0.5, 0.5, (2, 128, 203)).astype(np.float32)
    tokens = tokenizer.tokenize(feats, [203, 150])
    assert [len(t) for t in tokens] == [speech_token_count(203), speech_token_count(150)] == [51, 38]
    assert all(t.dtype == np.int32 and t.min() >= 0 and t.max() < 6561 for t in tokens)
    embedding = SpeakerEncoder(demo / "campplus.onnx").embed(np.zeros((1, 120, 80), np.float32))
    assert embedding.shape == (1, 192) and np.isfinite(embedding).all()


def test_v3_inputs_are_bound_by_position(tmp_path):
    # The official front end binds the tokenizer's inputs by position: a v3 graph with other names opens as v3
    # and gives the same tokens; v2's names, which are known, are still checked.
    model = speech_tokenizer_standin(version="v3")
    for value in model.graph.input:
        value.name = {"feats": "mel", "feats_length": "mel_len"}[value.name]
    for node in model.graph.node:
        node.input[:] = [{"feats": "mel", "feats_length": "mel_len"}.get(n, n) for n in node.input]
    onnx.save(model, str(tmp_path / "renamed.onnx"))
    feats = np.random.default_rng(1).normal(0.0, 0.5, (1, 128, 77)).astype(np.float32)
    original = write_speech_tokenizer_standin(tmp_path / "speech_tokenizer_v3.onnx", version="v3")
    want = SpeechTokenizer(original, version="v3").tokenize(feats)[0]
    np.testing.assert_array_equal(SpeechTokenizer(tmp_path / "renamed.onnx", version="v3").tokenize(feats)[0], want)
    with pytest.raises(CheckpointError, match="input #0 is 'mel'.*wrong name"):
        SpeechTokenizer(tmp_path / "renamed.onnx")
    v2 = write_speech_tokenizer_standin(tmp_path / "speech_tokenizer_v2.onnx")
    assert not np.array_equal(SpeechTokenizer(v2).tokenize(feats)[0], want)  # weights of its own
    with pytest.raises(ValueError, match="version must be one of v2, v3"):
        SpeechTokenizer(v2, version="v4")


def test_official_front_end_reads_v2_and_v3_alike():
    """The proof that one SpeechTokenizer reads both: the official code has one _extract_speech_token (Whisper
    log-mel, 128 bins, inputs by position, output 0 flattened) and CosyVoice3 hands it speech_tokenizer_v3.onnx."""
    git = official_git()
    show = lambda path: subprocess.run(["git", "--git-dir", str(git if (git / "HEAD").exists() else git / ".git"),
                                        "show", f"ace7c47:{path}"], capture_output=True, text=True, check=True).stdout
    frontend, cli = show("cosyvoice/cli/frontend.py"), show("cosyvoice/cli/cosyvoice.py")
    assert frontend.count("def _extract_speech_token(") == 1 and "n_mels=128" in frontend
    assert "get_inputs()[0].name" in frontend and "get_inputs()[1].name" in frontend and ")[0].flatten()" in frontend
    cv3 = cli[cli.index("class CosyVoice3("):]
    assert "speech_tokenizer_v3.onnx" in cv3 and "CosyVoiceFrontEnd(" in cv3 and "_extract_speech_token" not in cli


def test_full_config_is_the_official_yaml(tmp_path):
    git = official_git()
    official = subprocess.run(["git", "--git-dir", str(git if (git / "HEAD").exists() else git / ".git"), "show",
                               OFFICIAL_YAML], capture_output=True, text=True, check=True).stdout
    (tmp_path / "official").mkdir()
    (tmp_path / "official" / "cosyvoice3.yaml").write_text(official)
    assert read_cosyvoice3_yaml(tmp_path / "official") == CosyVoice3Config.full()
    written = load_hyperpyyaml(write_cosyvoice3_yaml(CosyVoice3Config.full(), tmp_path / "cosyvoice3.yaml").read_text())
    reference = load_hyperpyyaml(official)
    assert {k: reference[k] for k in written} == written  # every section written is the official one, value for value
    assert {"llm", "flow", "hift", "feat_extractor", "get_tokenizer"} <= set(written)


def test_full_size_is_the_release_layout():
    # Flow3Dims.full() / Hift3Dims.full() give the official full-size key lists (test_cv3_flow, test_cv3_hift)
    config = CosyVoice3Config.full()
    assert (config.flow, config.hift) == (Flow3Dims.full(), Hift3Dims.full())


def test_full_lm_layout(tmp_path):
    from cosyvoice_triton.models.llm import write_qwen_config

    qwen = write_qwen_config(tmp_path, "full")
    with torch.device("meta"):
        lm = CosyVoice3LM.from_config(CosyVoice3Config.full().llm, qwen, init=False)
    shapes = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    assert shapes["llm_decoder.weight"] == shapes["speech_embedding.weight"] == (6561 + 200, 896)
    assert shapes["llm.model.model.embed_tokens.weight"] == (151936, 896) and "llm_decoder.bias" not in shapes


def test_demo_weights_are_deterministic_and_refuse_inexpressible_dims():
    config = CosyVoice3Config.tiny()
    a, b = (build_demo_flow_hift3(config, seed=5)[1].state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = build_demo_flow_hift3(config, seed=6)[1].state_dict()
    key = "conv_pre.parametrizations.weight.original1"
    assert not torch.equal(a[key], other[key])
    bad = dataclasses.replace(config, flow=dataclasses.replace(config.flow, dit=dataclasses.replace(
        config.flow.dit, conv_pos_kernel=15)))
    with pytest.raises(ConfigError, match="dit.conv_pos_kernel 15"):
        write_cosyvoice3_yaml(bad, "/nonexistent/cosyvoice3.yaml")


def test_state_dict_reads_weights_only(demo):
    assert read_state_dict(demo / "hift.pt").keys() == torch.load(demo / "hift.pt", weights_only=True).keys()
