"""The CosyVoice3 flow's precision on the CPU: ``fp32`` (the checkpoint as is) or ``int8`` (the DiT's transformer
blocks on dynamic INT8 Linear layers).

``int8`` replaces the ``nn.Linear`` layers of the DiT estimator's attention (q/k/v/out) and feed-forward in every
transformer block (the layers that run on every frame: 99.8 % of the estimator's Linear multiply-adds per frame at
Fun-CosyVoice3-0.5B dims) by PyTorch's
dynamically quantised Linear (``torch.ao.quantization.quantize_dynamic``: int8 weights per output channel, int8
activations per tensor quantised at each call, int32 accumulation through fbgemm / oneDNN), as the LM's ``int8``
(:mod:`cosyvoice_triton.models.lm_quant`). The input embedding, the time embedding, the adaptive norms'
modulation (one row per item and step), the output projection, attention's products, the pre-lookahead layer and
the vocoder stay fp32: the small layers that condition every block carry most of the error for little of the time
(quantising every Linear of the estimator measured 2.3e-2 mel rel RMS at full dims, the blocks alone 1.0e-3).

The bar is the quality report's for a flow stage (:data:`cosyvoice_triton.export.quality.BAR`: mel rel RMS <= 0.05
and mean |log-mel error| <= 0.5 dB against fp32, only the flow swapped), measured on a conversion by
tests/unit/test_cv3_dit_quant.py (tiny dims; full dims marked slow) and by ``make bench-cv3`` for the speed.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ...errors import ConfigError
from .flow import CausalMaskedDiffWithDiT

__all__ = ["FLOW_PRECISIONS", "quantize_flow3"]

#: The CosyVoice3 flow's precisions (``flow_precision``).
FLOW_PRECISIONS = ("fp32", "int8")


def quantize_flow3(flow: CausalMaskedDiffWithDiT, precision: str = "fp32") -> CausalMaskedDiffWithDiT:
    """``flow`` (on the CPU) with its DiT blocks at ``precision`` (module docstring), changed in place; the
    precision is kept as ``flow.flow_precision``."""
    if precision not in FLOW_PRECISIONS:
        raise ConfigError(f"flow_precision must be one of {', '.join(FLOW_PRECISIONS)}, got {precision!r}")
    if precision == "int8":
        if any(p.device.type != "cpu" for p in flow.parameters()):
            raise ConfigError("flow_precision int8 is PyTorch's CPU INT8 (dynamic quantised Linear); the flow is not "
                              "on the CPU")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices, once per layer
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            for block in flow.decoder.estimator.transformer_blocks:
                for part in (block.attn, block.ff):
                    quantize_dynamic(part, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8,
                                     inplace=True)
    flow.flow_precision = precision
    return flow
