"""The LM in int8 (cosyvoice_triton.models.lm_quant): the quality bar on the LM oracle's cases, and int8 in the
batched decoder, the served LM engine and the in-process TTS service."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from conftest import PATIENCE_S, rel_err
from lm_oracle import ORACLE, ORACLE_FULL, full_llm_dir, oracle_cases, oracle_config, tts_request

from cosyvoice_triton.errors import ConfigError
from cosyvoice_triton.models import lm_quant
from cosyvoice_triton.models.llm import LMRequest, load_llm


def _report(ref, cand, cases) -> lm_quant.DistributionReport:
    return lm_quant.DistributionReport.merge(
        lm_quant.compare(ref, cand, z["text"], z["prompt_text"], z["prompt_speech_token"], z["tokens"].tolist(),
                         z["draws"].tolist(), min_len=int(z["min_len"])) for z in cases.values())


@pytest.fixture(scope="module")
def fp32():
    return load_llm(ORACLE, oracle_config(ORACLE))


@pytest.fixture(scope="module")
def int8():
    return load_llm(ORACLE, oracle_config(ORACLE), precision="int8")


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
        load_llm(ORACLE, oracle_config(ORACLE), precision="int4")


def test_teacher_forcing_reproduces_the_oracle_and_the_measure_is_zero_on_itself(fp32):
    cases = oracle_cases(ORACLE)
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
    _check_claim(_report(fp32, int8, oracle_cases(ORACLE)), "tiny dims")


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    return full_llm_dir(tmp_path_factory, "llm_full_int8")


@pytest.mark.slow
def test_int8_against_the_bar_full_dims(full_dir):
    ref = load_llm(full_dir, oracle_config(ORACLE_FULL))
    cand = lm_quant.quantize_lm(copy.deepcopy(ref), "int8")
    _check_claim(_report(ref, cand, oracle_cases(ORACLE_FULL)), "full dims")


def _requests(cases, n):
    zs = list(cases.values())
    return [LMRequest(zs[i % len(zs)]["text"], zs[i % len(zs)]["prompt_text"], zs[i % len(zs)]["prompt_speech_token"],
                      draws=i) for i in range(n)]


def test_int8_decodes_a_batch_of_8(int8):
    requests = _requests(oracle_cases(ORACLE), 8)
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
        jobs = [engine.submit(r) for r in _requests(oracle_cases(ORACLE), 8)]
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
    from cosyvoice_triton.serving.stages.tts import TTSService

    md, graphs, wave, t = tts_request(serving_assets)
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
