"""The LM in int8 (cosyvoice_triton.models.lm_quant): the quality bar on the LM oracle's cases, and int8 in the
batched decoder, the served LM engine and the in-process TTS service."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import shutil
import threading

import numpy as np
import pytest
import torch
from conftest import FIXTURES, PATIENCE_S, ROOT, rel_err

from cosyvoice_triton.config import LLMConfig, ModelConfig
from cosyvoice_triton.errors import ConfigError
from cosyvoice_triton.models import lm_quant
from cosyvoice_triton.models.llm import LMRequest, load_llm

ORACLE = FIXTURES / "llm_oracle"
ORACLE_FULL = ORACLE / "full"


def _config(folder) -> ModelConfig:
    hidden = json.loads((folder / "oracle_meta.json").read_text())["qwen_config"]["hidden_size"]
    return dataclasses.replace(ModelConfig.tiny(), llm=LLMConfig(llm_input_size=hidden, llm_output_size=hidden))


def _cases(folder) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for path in sorted(folder.glob("lm_*.npz")):
        with np.load(path) as z:
            out[path.stem.removeprefix("lm_")] = {k: z[k] for k in z.files}
    return out


def _report(ref, cand, cases) -> lm_quant.DistributionReport:
    return lm_quant.DistributionReport.merge(
        lm_quant.compare(ref, cand, z["text"], z["prompt_text"], z["prompt_speech_token"], z["tokens"].tolist(),
                         z["draws"].tolist(), min_len=int(z["min_len"])) for z in cases.values())


@pytest.fixture(scope="module")
def fp32():
    return load_llm(ORACLE, _config(ORACLE))


@pytest.fixture(scope="module")
def int8():
    return load_llm(ORACLE, _config(ORACLE), precision="int8")


def test_int8_quantizes_the_trunk_linears_only(int8):
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    layer = int8.qwen.layers[0]
    for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
        assert isinstance(m, DynamicLinear)
    assert type(int8.llm_decoder) is torch.nn.Linear and int8.llm_decoder.weight.dtype == torch.float32
    assert not any(type(m) is torch.nn.Linear for m in int8.qwen.modules())
    assert int8.lm_precision == "int8"


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="lm_precision must be one of fp32, int8"):
        load_llm(ORACLE, _config(ORACLE), precision="int4")


def test_teacher_forcing_reproduces_the_oracle_and_the_measure_is_zero_on_itself(fp32):
    cases = _cases(ORACLE)
    for name, z in cases.items():
        logp = lm_quant.teacher_forced_logp(fp32, z["text"], z["prompt_text"], z["prompt_speech_token"],
                                            z["tokens"].tolist())
        assert logp.shape[0] == len(z["tokens"]) + 1
        assert max(rel_err(g, r) for g, r in zip(logp, z["logp"], strict=False)) <= 1e-4, name
    same = _report(fp32, copy.deepcopy(fp32), cases)
    assert same.tv.max() <= 1e-5 and same.same_token.all() and same.meets()


def _check_claim(report: lm_quant.DistributionReport, where: str) -> None:
    s = report.summary()
    print(f"int8 vs fp32 ({where}): {s}")
    assert report.meets(lm_quant.SANITY), f"{where}: int8 is far from fp32: {s}"
    # the module's claim (and with it the default precision) must follow the measurement
    assert report.meets(lm_quant.BAR) == lm_quant.INT8_MEETS_BAR, f"{where}: {s} vs the bar {lm_quant.BAR}"


def test_int8_against_the_bar_tiny(fp32, int8):
    _check_claim(_report(fp32, int8, _cases(ORACLE)), "tiny dims")


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    """The full-size llm.pt, regenerated the oracle's seeded way (2 GB, as tests/unit/test_llm_parity.py does)."""
    if not (ORACLE_FULL / "oracle_meta.json").is_file():
        pytest.skip(f"full-size references {ORACLE_FULL} are absent")
    spec = importlib.util.spec_from_file_location("make_llm_oracle", ROOT / "tests" / "oracle" / "make_llm_oracle.py")
    oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle)
    meta = json.loads((ORACLE_FULL / "oracle_meta.json").read_text())
    state = oracle.random_llm_state_dict(meta["qwen_config"], seed=meta["seeds"]["weights"])
    d = tmp_path_factory.mktemp("llm_full_int8")
    torch.save(state, d / "llm.pt")
    del state
    shutil.copytree(ORACLE_FULL / "CosyVoice-BlankEN", d / "CosyVoice-BlankEN")
    return d


@pytest.mark.slow
def test_int8_against_the_bar_full_dims(full_dir):
    ref = load_llm(full_dir, _config(ORACLE_FULL))
    cand = lm_quant.quantize_lm(copy.deepcopy(ref), "int8")
    _check_claim(_report(ref, cand, _cases(ORACLE_FULL)), "full dims")


def _requests(cases, n):
    zs = list(cases.values())
    return [LMRequest(zs[i % len(zs)]["text"], zs[i % len(zs)]["prompt_text"], zs[i % len(zs)]["prompt_speech_token"],
                      draws=i) for i in range(n)]


def test_int8_decodes_a_batch_of_8(int8):
    requests = _requests(_cases(ORACLE), 8)
    out = int8.generate_batch(requests)
    assert len(out) == 8
    for request, tokens in zip(requests, out, strict=True):
        lo, hi = int8.length_bounds(len(request.text_tokens), 2, 20)
        assert lo <= len(tokens) <= hi and all(0 <= t < int8.speech_token_size for t in tokens)
    # a lone request decodes as in the batch when it has the batch to itself
    assert int8.generate_batch(requests[:1]) == [list(int8.generate(*_args(requests[0]), draws=0))]


def _args(r):
    return r.text_tokens, r.prompt_text_tokens, r.prompt_speech_tokens


def test_int8_in_the_served_lm_engine(int8):
    from cosyvoice_triton.serving.stages.lm_engine import LMEngine

    engine = LMEngine(int8, max_active=8, max_waiting=8, wait_timeout_s=PATIENCE_S)
    try:
        jobs = [engine.submit(r) for r in _requests(_cases(ORACLE), 8)]
        out: list = [None] * 8

        def run(i):
            out[i] = list(jobs[i].tokens())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE_S)
        assert all(o for o in out)
        snap = engine.snapshot()
        assert snap["finished"] == 8 and snap["active"] == 0
    finally:
        engine.close()


def test_tts_service_and_pipeline_with_int8(serving_assets):
    from cosyvoice_triton.pipeline import CosyVoice2
    from cosyvoice_triton.serving.stages.graphs import GraphRunner
    from cosyvoice_triton.serving.stages.tts import TTSService
    from cosyvoice_triton.shapes import GRAPHS

    md = serving_assets["model_dir"]
    onnx = serving_assets["onnx_dir"] / "fp32"
    graphs = {g: GraphRunner(g, onnx_path=onnx / f"{g}.onnx").run for g in GRAPHS}
    g = np.random.default_rng(0)
    wave = (0.1 * g.standard_normal(24000)).astype(np.float32)
    t = {"text": np.array([[b"Hello there, this is a test."]], object), "prompt_audio": wave[None],
         "prompt_sample_rate": np.array([[24000]], np.int32), "prompt_text": np.array([[b"the prompt"]], object),
         "seed": np.array([[3]], np.int64)}
    svc = TTSService(md, graphs, lm_precision="int8")
    try:
        assert svc.lm.lm_precision == "int8"
        chunks = list(svc.responses(t))
        audio = np.concatenate([c["waveform"][0] for c in chunks])
        assert audio.size and np.isfinite(audio).all()
    finally:
        svc.close()
    model = CosyVoice2.from_pretrained(md, lm_precision="int8", tts=True)
    assert model.llm.lm_precision == "int8"
    speech = model.tts("Hello there, this is a test.", prompt_audio=wave, prompt_sr=24000, prompt_text="the prompt",
                       seed=3, stream=True)
    assert speech.size and np.isfinite(speech).all()
    with pytest.raises(ConfigError, match="lm_precision"):
        CosyVoice2.from_pretrained(md, lm_precision="fp8")
