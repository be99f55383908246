"""CosyVoice3's flow at ``flow_precision`` int8 (models/cosyvoice3/dit_quant.py): the DiT blocks' attention and
feed-forward Linear layers become PyTorch's dynamic INT8 ones, nothing else changes, and a conversion's mel stays
within the quality report's bar for a flow stage against fp32 (tiny dims here; full dims: ``make bench-cv3
FLOW_PRECISION=int8``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from cosyvoice_triton.errors import ConfigError
from cosyvoice_triton.export.quality import BAR
from cosyvoice_triton.models.cosyvoice3.dit_quant import quantize_flow3
from cosyvoice_triton.models.cosyvoice3.pipeline import CosyVoice3


@pytest.fixture(scope="module")
def models(cv3_demo_dir):
    return (CosyVoice3.from_pretrained(cv3_demo_dir, tts=False),
            CosyVoice3.from_pretrained(cv3_demo_dir, tts=False, flow_precision="int8"))


def _mel(model, inputs):
    t2w = model.token2wav_model
    return t2w._mel(t2w._tokens(inputs.source_tokens), t2w._prompt(inputs.prompt_tokens, inputs.prompt_mel,
                                                                   inputs.embedding),
                    streaming=False, finalize=True)[0].numpy()


def test_only_the_blocks_attention_and_feed_forward_are_int8(models):
    fp32, int8 = (m.flow.decoder.estimator for m in models)
    quantized = {n for n, m in int8.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)}
    linear = {n for n, m in fp32.named_modules() if isinstance(m, nn.Linear)}
    want = {n for n in linear if n.startswith("transformer_blocks.") and (".attn." in n or ".ff." in n)}
    assert quantized == want and len(want) == 6 * len(fp32.transformer_blocks)
    assert all(isinstance(int8.get_submodule(n), nn.Linear) for n in linear - want)  # the rest stays fp32
    assert models[0].flow.flow_precision == "fp32" and models[1].flow.flow_precision == "int8"


def test_int8_conversion_is_within_the_quality_bar(models, en_speech):
    p, psr, s, ssr = en_speech
    fp32, int8 = models
    inputs = fp32.frontend_vc(s, p, source_sr=ssr, prompt_sr=psr)
    ref, got = _mel(fp32, inputs), _mel(int8, inputs)
    assert got.shape == ref.shape
    rel_rms = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    mel_db = float(np.abs(got - ref).mean()) * 20 / math.log(10)  # the mel is a natural log of magnitudes
    assert 0 < rel_rms <= BAR.mel_rel_rms and mel_db <= BAR.mel_db, (rel_rms, mel_db)
    wave = int8.vc(s, p, source_sr=ssr, prompt_sr=psr)
    assert wave.dtype == np.float32 and np.isfinite(wave).all()
    assert wave.size == fp32.vc(s, p, source_sr=ssr, prompt_sr=psr).size


def test_bad_precisions_are_refused(cv3_demo_dir, models):
    with pytest.raises(ConfigError, match="flow_precision must be one of fp32, int8"):
        CosyVoice3.from_pretrained(cv3_demo_dir, tts=False, flow_precision="int4")
    with pytest.raises(ConfigError, match="load on the CPU"):
        CosyVoice3.from_pretrained(cv3_demo_dir, tts=False, flow_precision="int8", device="meta")
    with pytest.raises(ConfigError, match="flow_precision must be one of"):
        quantize_flow3(models[0].flow, "fp16")
    from cosyvoice_triton.serving.repository.tunables import RenderError, Tunables

    with pytest.raises(RenderError, match="cosyvoice3_flow_precision must be fp32 or int8"):
        Tunables(cosyvoice3_flow_precision="int4")
    assert torch.get_default_dtype() == torch.float32
