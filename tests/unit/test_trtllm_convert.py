"""The LM's conversion for the TensorRT-LLM backend (cosyvoice_triton.export.trtllm, export/convert_llm.py).

The converted folder is loaded by transformers' ``Qwen2ForCausalLM`` (what TensorRT-LLM's Qwen converter reads)
and compared with the project's PyTorch ``Qwen2LM`` on the tiny demo model: the prompt goes in as merged-vocabulary
ids (sos, text ids, task id, speech ids shifted past the text vocabulary: how the official TensorRT-LLM runtime
feeds the engine), logits + embedding bias over the whole merged vocabulary must give the official speech
log-probabilities, and greedy decoding must pick the same tokens. Nothing of TensorRT-LLM runs here (not
installed, no GPU): the engine step is shown to skip and say why.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from cosyvoice_triton.errors import CheckpointError, ConfigError, LLMError
from cosyvoice_triton.export.trtllm import (
    BIAS_FILE,
    SOS_TOKEN,
    STOP_TOKENS,
    TASK_TOKEN,
    VOCAB_FILE,
    EngineOptions,
    MergedVocab,
    build_llm_engine,
    convert_llm,
    read_bias,
    read_vocab,
    stage_serving_files,
    toolchain_missing,
    verify_conversion,
)

CLI = [sys.executable, str(ROOT / "export" / "convert_llm.py")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from cosyvoice_triton.models.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "cosyvoice2-demo-tiny", size="tiny")


@pytest.fixture(scope="module")
def lm(model_dir):
    from cosyvoice_triton.config import ModelConfig
    from cosyvoice_triton.models.llm import load_llm

    return load_llm(model_dir, ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml"))


@pytest.fixture(scope="module")
def converted(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "llm_hf"
    lines: list[str] = []
    result = convert_llm(model_dir, out, progress=lines.append)
    assert any("[5/5]" in line for line in lines) and result.out_dir == out
    return out


@pytest.fixture(scope="module")
def hf_model(converted):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def text_tokenizer(model_dir):
    from cosyvoice_triton.frontend.text.tokenizer import QwenTextTokenizer

    return QwenTextTokenizer(model_dir / "CosyVoice-BlankEN")


def test_sizes_agree_across_config_weights_bias_and_tokenizer(converted, hf_model, lm, text_tokenizer):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    vocab = read_vocab(converted)
    cfg = json.loads((converted / "config.json").read_text())
    assert vocab.text_vocab_size == len(text_tokenizer) and vocab.speech_token_size == lm.speech_token_size
    assert vocab.vocab_size % 128 == 0 and vocab.used <= vocab.vocab_size < vocab.used + 128
    assert cfg["vocab_size"] == vocab.vocab_size and cfg["tie_word_embeddings"] is False
    assert cfg["hidden_size"] == lm.llm.model.config.hidden_size and cfg["model_type"] == "qwen2"
    with safe_open(str(converted / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
    hidden = cfg["hidden_size"]
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (vocab.vocab_size, hidden)
    assert not any("bias" in k and "lm_head" in k for k in shapes)  # neither transformers nor TRT-LLM would read it
    assert tuple(read_bias(converted).shape) == (vocab.vocab_size,)
    assert hf_model.get_input_embeddings().num_embeddings == vocab.vocab_size
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(vocab.stop_ids) and gen["pad_token_id"] == vocab.end_id
    tok = AutoTokenizer.from_pretrained(str(converted))
    assert len(tok) == vocab.used
    assert [tok.convert_tokens_to_ids(t) for t in (*STOP_TOKENS, SOS_TOKEN, TASK_TOKEN)] == [
        *vocab.stop_ids, vocab.sos_id, vocab.task_id]
    assert tok.convert_tokens_to_ids("<|s_0|>") == vocab.speech_offset
    assert tok.convert_tokens_to_ids(f"<|s_{vocab.speech_token_size - 1}|>") == vocab.end_id - 1


def test_merged_tables_hold_the_official_rows(converted, lm):
    from safetensors.torch import load_file

    vocab = read_vocab(converted)
    w = load_file(str(converted / "model.safetensors"))
    emb, head, bias = w["model.embed_tokens.weight"], w["lm_head.weight"], read_bias(converted)
    n = vocab.speech_token_size + 3
    s = slice(vocab.speech_offset, vocab.speech_offset + n)
    assert torch.equal(emb[: vocab.text_vocab_size], lm.qwen.embed_tokens.weight[: vocab.text_vocab_size])
    assert torch.equal(emb[s], lm.speech_embedding.weight)
    assert torch.equal(emb[vocab.sos_id], lm.llm_embedding.weight[0])
    assert torch.equal(emb[vocab.task_id], lm.llm_embedding.weight[1])
    assert torch.equal(head[s], lm.llm_decoder.weight) and torch.equal(bias[s], lm.llm_decoder.bias)
    outside = torch.ones(vocab.vocab_size, dtype=torch.bool)
    outside[s] = False
    assert torch.isneginf(bias[outside]).all() and not head[outside].any()
    for name, t in lm.qwen.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(w[f"model.{name}"], t), name


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct"])
def test_logits_along_a_sampled_sequence_equal_the_pytorch_lm(mode, converted, hf_model, lm, text_tokenizer):
    """The official prompt of each mode as merged ids; the PyTorch LM samples (seeded), the converted model reads
    the whole sequence at once: log_softmax(logits + embedding_bias) over the merged vocabulary = the official
    speech log-probabilities at every step, non-speech ids at probability 0."""
    from cosyvoice_triton.models.llm import mode_request

    vocab = read_vocab(converted)
    bias = read_bias(converted)
    text = text_tokenizer.encode("Hello there, this is a converted language model.")
    prompt_text = text_tokenizer.encode("A prompt transcript.")
    instruct = text_tokenizer.encode("Speak slowly.<|endofprompt|>")
    speech = np.random.default_rng(3).integers(0, vocab.speech_token_size, 37)
    kw = {"zero_shot": dict(prompt_text_tokens=prompt_text, prompt_speech_tokens=speech),
          "cross_lingual": {}, "instruct": dict(instruct_tokens=instruct)}[mode]
    steps: list[torch.Tensor] = []
    request = mode_request(mode, text, draws=11, on_step=lambda i, logp: steps.append(logp), **kw)
    decoder = lm.batch_decoder()
    decoder.add(request, request_id="r")
    tokens: list[int] = []
    while "r" in decoder:
        tok = decoder.step().get("r")
        if tok is not None and tok >= 0:
            tokens.append(tok)
    assert len(tokens) >= 5 and len(steps) >= len(tokens)

    prompt = vocab.input_ids(request.text_tokens, request.prompt_text_tokens, request.prompt_speech_tokens)
    assert prompt[0] == vocab.sos_id and vocab.task_id in prompt
    ids = torch.as_tensor(np.concatenate([prompt, np.asarray(tokens) + vocab.speech_offset]), dtype=torch.long)
    with torch.inference_mode():
        logits = hf_model(input_ids=ids[None]).logits[0, len(prompt) - 1 :]
    logp = (logits + bias).log_softmax(-1)
    n = vocab.speech_token_size + 3
    speech_logp = logp[:, vocab.speech_offset : vocab.speech_offset + n]
    ref = torch.stack(steps)
    assert len(steps) in (len(tokens), len(tokens) + 1)  # + a last step that sampled a stop id (else max_len)
    speech_logp, logits = speech_logp[: len(steps)], logits[: len(steps)]
    assert float((speech_logp - ref).abs().max()) < 1e-4
    assert float(speech_logp.exp().sum(-1).sub(1).abs().max()) < 1e-5  # all the mass on the speech rows
    # Why the bias travels as embedding_bias: the engine's lm_head alone (no bias) gives other speech logits.
    plain = logits[:, vocab.speech_offset : vocab.speech_offset + n].log_softmax(-1)
    assert float((plain - ref).abs().max()) > 1e-2


def test_greedy_decoding_equals_the_pytorch_lm(converted, lm, text_tokenizer):
    vocab = read_vocab(converted)
    text = text_tokenizer.encode("Greedy decoding over the merged vocabulary.")
    speech = np.random.default_rng(5).integers(0, vocab.speech_token_size, 20)
    r = verify_conversion(converted, lm, text, text_tokenizer.encode("Prompt."), speech, steps=40)
    assert len(r["tokens"]) == 40 and r["greedy_equal"], (r["tokens"], r["converted_tokens"])
    assert len(set(r["tokens"])) > 5  # a sequence that says something about the comparison
    assert r["max_abs_logp_diff"] < 1e-4 and r["text_mass"] == 0.0
    # Unmasked end of speech: both stop at the same step.
    r = verify_conversion(converted, lm, text, (), (), steps=40, min_len=0)
    assert r["greedy_equal"] and r["tokens"] == r["converted_tokens"]


def test_prompt_ids_as_the_official_runtime_builds_them(converted, text_tokenizer):
    """The official runtime encodes "<|sos|>" + prompt text + text + "<|task_id|>" with the merged tokenizer and
    appends the prompt speech tokens + the text vocabulary size. (It encodes the two texts as one string; the
    PyTorch LM, like CosyVoice2's front end, encodes them apart: these texts tokenize the same either way.)"""
    from transformers import AutoTokenizer

    vocab = read_vocab(converted)
    tok = AutoTokenizer.from_pretrained(str(converted))
    prompt_text, text = "Prompt words. ", "Target words."
    speech = np.array([0, 17, vocab.speech_token_size - 1])
    official = tok.encode(f"{SOS_TOKEN}{prompt_text}{text}{TASK_TOKEN}") + [int(k) + vocab.speech_offset
                                                                            for k in speech]
    ours = vocab.input_ids(text_tokenizer.encode(text), text_tokenizer.encode(prompt_text), speech)
    assert list(ours) == official and ours.dtype == np.int32
    assert tok.decode([vocab.speech_offset + 17, vocab.end_id], skip_special_tokens=False) == "<|s_17|><|eos1|>"
    assert vocab.speech_tokens([vocab.speech_offset + 4, vocab.speech_offset, vocab.end_id, vocab.speech_offset]) \
        == [4, 0]
    with pytest.raises(LLMError, match="embedding_bias"):
        vocab.speech_tokens([5])  # a text id: the request was sent without the bias
    with pytest.raises(LLMError, match="outside"):
        vocab.input_ids([vocab.text_vocab_size])
    with pytest.raises(LLMError, match="empty"):
        vocab.input_ids([])
    assert vocab.stop_words_list().tolist() == [[vocab.end_id + 1, vocab.end_id + 2], [1, 2]]


# ---------------------------------------------------------------------------------------------- bad input


def _copy_model(model_dir: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("cosyvoice2.yaml", "llm.pt"):
        shutil.copy(model_dir / name, dst / name)
    shutil.copytree(model_dir / "CosyVoice-BlankEN", dst / "CosyVoice-BlankEN")
    return dst


def test_bad_model_folders_give_clear_errors(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="not a folder"):
        convert_llm(tmp_path / "nowhere", tmp_path / "o1")
    d = _copy_model(model_dir, tmp_path / "no_llm")
    (d / "llm.pt").unlink()
    with pytest.raises(CheckpointError, match="missing llm.pt"):
        convert_llm(d, tmp_path / "o2")
    d = _copy_model(model_dir, tmp_path / "no_tok")
    (d / "CosyVoice-BlankEN" / "vocab.json").unlink()
    with pytest.raises(CheckpointError, match="CosyVoice-BlankEN/vocab.json"):
        convert_llm(d, tmp_path / "o3")

    state = torch.load(model_dir / "llm.pt", weights_only=True)
    d = _copy_model(model_dir, tmp_path / "renamed")
    renamed = {k.replace("llm_decoder.", "decoder."): v for k, v in state.items()}
    torch.save(renamed, d / "llm.pt")
    with pytest.raises(CheckpointError, match=r"missing \(e\.g\. llm_decoder\.bias.*unexpected \(e\.g\. decoder\."):
        convert_llm(d, tmp_path / "o4")
    d = _copy_model(model_dir, tmp_path / "shape")
    torch.save({**state, "speech_embedding.weight": state["speech_embedding.weight"][:100]}, d / "llm.pt")
    with pytest.raises(CheckpointError, match="speech_embedding.weight: file \\(100, 64\\)"):
        convert_llm(d, tmp_path / "o5")
    d = _copy_model(model_dir, tmp_path / "flow_as_llm")
    shutil.copy(model_dir / "flow.pt", d / "llm.pt")
    with pytest.raises(CheckpointError, match="does not match the model"):
        convert_llm(d, tmp_path / "o6")
    d = _copy_model(model_dir, tmp_path / "garbage")
    (d / "llm.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="llm.pt"):
        convert_llm(d, tmp_path / "o7")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 8))  # nothing half-written

    with pytest.raises(ConfigError, match="dtype"):
        convert_llm(model_dir, tmp_path / "o8", dtype="int8")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("someone's file")
    with pytest.raises(CheckpointError, match="refusing"):
        convert_llm(model_dir, foreign)
    assert (foreign / "keep.txt").read_text() == "someone's file"


def _cli(argv: list[str], caplog, capsys) -> tuple[int, str, str]:
    """export/convert_llm.py's main() in this process (the subprocess start-up of torch is slow here)."""
    import importlib.util
    import logging

    spec = importlib.util.spec_from_file_location("convert_llm_cli", ROOT / "export" / "convert_llm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="convert_llm"):
        try:
            rc = module.main(argv)
        except SystemExit as exc:  # argparse errors
            rc = exc.code
    captured = capsys.readouterr()
    return rc, caplog.text + captured.out, captured.err


def test_cli_validates_and_reports(model_dir, converted, tmp_path, caplog, capsys):
    rc, _, err = _cli(["--model-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], caplog, capsys)
    assert rc == 2 and "not a folder" in err
    rc, _, err = _cli(["--model-dir", str(model_dir), "--max-batch-size", "0"], caplog, capsys)
    assert rc == 2 and "--max-batch-size" in err
    rc, _, err = _cli(["--model-dir", str(model_dir), "--max-input-len", "4096", "--max-seq-len", "4096"], caplog,
                      capsys)
    assert rc == 2 and "max_seq_len" in err
    rc, _, err = _cli(["--model-dir", str(model_dir), "--dry-run", "--build-engine"], caplog, capsys)
    assert rc == 2 and "exclude each other" in err
    # The real command line once, end to end.
    out = tmp_path / "cli_hf"
    r = subprocess.run([*CLI, "--model-dir", str(model_dir), "--out", str(out), "--dtype", "bfloat16", "--dry-run",
                        "--engine-dir", str(tmp_path / "engines" / "llm")],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for step in ("[1/5]", "[5/5]", "merged vocabulary", "would run: trtllm-build", "--logits_dtype float32"):
        assert step in r.stdout, step
    assert json.loads((out / VOCAB_FILE).read_text())["dtype"] == "bfloat16"
    assert not (tmp_path / "engines").exists()
    rc, text, _ = _cli(["--model-dir", str(model_dir), "--out", str(out)], caplog, capsys)
    assert rc == 0 and "converted from this llm.pt already" in text


@pytest.mark.skipif(toolchain_missing() is None, reason="TensorRT-LLM and a GPU are present: the build would run")
def test_engine_build_skips_here_and_says_why(model_dir, converted, tmp_path, caplog, capsys):
    options = EngineOptions(max_batch_size=12)
    result = build_llm_engine(converted, tmp_path / "ckpt", tmp_path / "engines" / "llm", options)
    assert result.status == "skipped" and result.reason == toolchain_missing()
    assert "tensorrt_llm" in result.reason or "GPU" in result.reason
    assert not (tmp_path / "engines").exists() and not (tmp_path / "ckpt").exists()
    build = result.commands[1]
    assert build[0] == "trtllm-build" and build[build.index("--max_batch_size") + 1] == "12"
    assert build[build.index("--checkpoint_dir") + 1] == str(tmp_path / "ckpt")
    assert "checkpoint" in result.commands[0] and str(converted) in result.commands[0]
    base = ["--model-dir", str(model_dir), "--out", str(converted), "--build-engine", "--checkpoint-dir",
            str(tmp_path / "ckpt"), "--engine-dir", str(tmp_path / "engines" / "llm")]
    rc, text, _ = _cli(base, caplog, capsys)
    assert rc == 0 and "engine build SKIPPED" in text and "Nothing was built" in text
    rc, text, _ = _cli([*base, "--require-engine"], caplog, capsys)
    assert rc == 3 and "SKIPPED" in text
    from cosyvoice_triton.export.trtllm import main as trtllm_main  # the stock -trtllm- image's entry point

    assert trtllm_main(["engine", "--hf-dir", str(converted), "--engine-dir", str(tmp_path / "engines" / "llm")]) == 3
    assert toolchain_missing() in capsys.readouterr().err
    assert not (tmp_path / "engines").exists()
    with pytest.raises(ConfigError):
        EngineOptions(dtype="int4")


# ------------------------------------------------------------------------------------ the rendered config


def test_rendered_config_points_at_the_engine_folder_with_the_converted_vocabulary(model_dir, converted, tmp_path):
    """The serving files go where the engine goes (<engine_dir>/llm, the config's gpt_model_path); the render
    fixes embedding_bias to the converted vocabulary and checks an engine's own config.json against it."""
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format

    from cosyvoice_triton.serving.repository import RenderError, render_repository

    engines = tmp_path / "engines"
    staged = stage_serving_files(converted, engines / "llm")
    assert {p.name for p in staged} >= {VOCAB_FILE, BIAS_FILE, "tokenizer_config.json"}
    vocab = read_vocab(engines / "llm")

    def render(name: str, **kw):
        out = tmp_path / name
        render_repository("trt", out, model_dir=model_dir, onnx_dir=tmp_path / "onnx", engine_dir=engines,
                          allow_missing=True, lm_backend="tensorrtllm", **kw)
        text = (out / "tensorrt_llm" / "config.pbtxt").read_text()
        return text, text_format.Parse(text, pb2.ModelConfig())

    text, cfg = render("r1", max_active_requests=8)
    inputs = {i.name: i for i in cfg.input}
    assert list(inputs["embedding_bias"].dims) == [vocab.vocab_size] and inputs["embedding_bias"].optional
    assert list(inputs["stop_words_list"].dims) == [2, -1]
    assert cfg.parameters["gpt_model_path"].string_value == str((engines / "llm").resolve())
    assert f"end_id / pad_id {vocab.end_id}" in text and "no engine built yet" in text
    assert vocab.vocab_size == json.loads((converted / "config.json").read_text())["vocab_size"]

    # An engine's config.json (trtllm-build's layout: pretrained_config, build_config) is checked against it.
    engine_cfg = engines / "llm" / "config.json"
    engine_cfg.write_text(json.dumps({"pretrained_config": {"vocab_size": vocab.vocab_size},
                                      "build_config": {"max_batch_size": 8}}))
    text, _ = render("r2", max_active_requests=8)
    assert "engine config checked" in text
    with pytest.raises(RenderError, match="max_batch_size 8 < 12"):
        render("r3", max_active_requests=12)
    engine_cfg.write_text(json.dumps({"pretrained_config": {"vocab_size": vocab.vocab_size + 128},
                                      "build_config": {"max_batch_size": 8}}))
    with pytest.raises(RenderError, match="another conversion"):
        render("r4", max_active_requests=8)
    engine_cfg.unlink()
    torch_bias = read_bias(engines / "llm")
    from safetensors.torch import save_file

    save_file({"embedding_bias": torch_bias[:-128].contiguous()}, str(engines / "llm" / BIAS_FILE))
    with pytest.raises(RenderError, match="shape"):
        render("r5")
    # Before any conversion: a dynamic length and a note that says what to run.
    shutil.rmtree(engines)
    text, cfg = render("r6")
    assert list({i.name: i for i in cfg.input}["embedding_bias"].dims) == [-1] and "make engines-llm" in text


def test_merged_vocab_layout_for_the_release_sizes():
    """With the release's tokenizer (151643 BPE + 3 Qwen2 + 17 CosyVoice2 tokens) the speech ids start at 151663,
    the id the official runtime's ORIGINAL_VOCAB_SIZE names."""
    v = MergedVocab.for_sizes(151663, 6561)
    assert (v.speech_offset, v.end_id, v.sos_id, v.task_id, v.used, v.vocab_size) == (
        151663, 158224, 158227, 158228, 158229, 158336)
    with pytest.raises(ConfigError):
        MergedVocab(100, 6561, 6000)
