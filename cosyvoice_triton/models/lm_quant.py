"""The LM's precision on the CPU: ``fp32`` (the checkpoint as is), ``int8`` (dynamic INT8 Linear layers) or
``fp32-ort`` (the same fp32 Linear layers on onnxruntime's MatMul: :mod:`.lm_ort`).

``int8`` replaces every ``nn.Linear`` of the Qwen2 trunk (q/k/v/o projections, the MLP's gate/up/down) by
PyTorch's dynamically quantised Linear (``torch.ao.quantization.quantize_dynamic``: int8 weights per output
channel, int8 activations per tensor, quantised at each call; int32 accumulation on the CPU's VNNI units through
the ``x86`` engine, fbgemm / oneDNN). The embeddings, the norms, attention itself and the speech head
``llm_decoder`` stay fp32: the head is 1.6 % of the multiply-adds at CosyVoice2-0.5B dims and carries the
distribution that is sampled. Activations are quantised per tensor over the rows of a call, so the rows of one
batched decode step share a scale (a row's output depends slightly on its batch mates; fp32 does not).

The quality bar (:data:`BAR`, measured by tests/unit/test_lm_quant.py on the LM oracle's cases, tiny dims and,
marked slow, full dims): decoding teacher-forced on the fp32 tokens (:func:`compare`), the total variation
distance between the fp32 and the candidate's speech-token distributions (softmax of the log-probabilities) is at
most 0.05 at every step and 0.02 on average, and the same injected uniform draw picks the same token as fp32 on at
least 70 % of the steps (the official repetition-aware sampling, the same history). That is the LM in bf16
(autocast), the reduced precision CPU servers run such LMs in, measured the same way at full dims: max TV 0.025,
mean 0.012, same token 72 % (the official fp16 option: 0.003, 0.0015, 92 %). The inverse-CDF draw is sensitive:
a shift of the cumulative mass before the drawn token moves the pick, so the same-token share falls much faster
than the TV rises.

``int8`` misses the bar (:data:`INT8_MEETS_BAR`): at full dims (random weights in the official format) max TV
0.18, mean 0.077, same token 44 %; at tiny dims 0.051, 0.024, 66 %. fp32 therefore stays the default
(``lm_precision``); int8 is there for a deployment that accepts that drift for ~4x the decode rate on a VNNI CPU.

Runtimes, measured on the loaded 2-core development machine (AVX-512 VNNI, 2 threads, Qwen2-0.5B trunk + head,
decode steps after a 130-position prompt, best of 3 rounds; indicative only): fp32 10 tokens/s at batch 1, 40 at
batch 8; bf16 autocast 8.5 / 20; this module's int8 (``x86`` engine) 27 / 144; the ``fbgemm`` engine the same;
int8 with the head quantised too was slower (6 / 32; not investigated). Per-channel weights and 8-bit instead of
PyTorch's 7-bit (``reduce_range``) activations moved the distances only a little (mean TV 0.083 per tensor, 0.077
per channel, 0.070 per channel with full-range activations, at full dims). ``torch.ao.quantization`` is deprecated
in favour of torchao, whose CPU int8 path was not tried. onnxruntime (MatMulInteger; MatMulNBits with 8-bit
weights in blocks of 32) and OpenVINO (NNCF's INT8 weight compression) on the same layers: ``bench-lm-kernels``
(:mod:`cosyvoice_triton.bench.lm_kernels`). None of them meets the bar either, and none is faster than this
module's int8 at batch 8 (docs/benchmarks.md), so this module stays the LM's int8.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..config import SamplingConfig
from ..errors import ConfigError
from .sampling import make_draw, sample_token

__all__ = ["BAR", "INT8_MEETS_BAR", "LM_PRECISIONS", "SANITY", "DistributionReport", "QualityBar", "compare",
           "quantize_linears", "quantize_lm", "teacher_forced_logp"]

LM_PRECISIONS = ("fp32", "int8", "fp32-ort")


@dataclass(frozen=True)
class QualityBar:
    max_tv: float
    mean_tv: float
    min_same_token: float


#: What a reduced precision must keep of the fp32 LM to become the default (module docstring).
BAR = QualityBar(max_tv=0.05, mean_tv=0.02, min_same_token=0.7)
#: Whether ``int8`` meets :data:`BAR` on the oracle's cases (tests/unit/test_lm_quant.py checks this claim).
INT8_MEETS_BAR = False
#: ``int8`` must at least stay this close to fp32 (a broken quantisation is far beyond it).
SANITY = QualityBar(max_tv=0.35, mean_tv=0.15, min_same_token=0.25)


def quantize_lm(lm, precision: str = "int8", *, threads: int | None = None):
    """``lm`` (a :class:`~.llm.Qwen2LM` in eval mode) in ``precision``, in place: ``fp32`` leaves it as is,
    ``int8`` quantises the Linear layers of its Qwen2 trunk, ``fp32-ort`` runs them on onnxruntime
    (:func:`.lm_ort.ort_lm`, ``threads`` per layer; None: torch's). Both CPU only. Returns ``lm``."""
    if precision not in LM_PRECISIONS:
        raise ConfigError(f"lm_precision must be one of {', '.join(LM_PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return lm
    if precision == "fp32-ort":
        from .lm_ort import ort_lm

        return ort_lm(lm, threads=threads)
    device = lm.llm_decoder.weight.device
    if device.type != "cpu":
        raise ConfigError(f"lm_precision int8 is PyTorch's CPU INT8 (dynamic quantised Linear); the LM is on "
                          f"{device}: use fp32 there (on a GPU the LM is served by TensorRT-LLM)")
    quantize_linears(lm.qwen)
    lm.lm_precision = precision
    return lm


def quantize_linears(module: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` under ``module`` replaced, in place, by PyTorch's dynamic INT8 Linear (int8 weights per
    output channel; the ``x86`` engine where PyTorch has it). Returns ``module``."""
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # PyTorch >= 2.10 announces torch.ao.quantization's move to torchao
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        quantize_dynamic(module, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    return module


# ------------------------------------------------------------------------------------------ the quality bar


@torch.inference_mode()
def teacher_forced_logp(lm, text_tokens, prompt_text_tokens, prompt_speech_tokens,
                        tokens: Sequence[int]) -> torch.Tensor:
    """[len(tokens) + 1, V] float32 log-probabilities of each decode step when the LM is fed ``tokens`` (the
    prompt prefilled in one call, then one token per call with the KV cache, as :class:`~.llm.BatchDecoder`
    decodes at batch 1)."""
    x = lm.lm_input(*lm.check_inputs(text_tokens, prompt_text_tokens, prompt_speech_tokens))
    out = lm.qwen(inputs_embeds=x, use_cache=True)
    hidden, cache, pos = [out.last_hidden_state[:, -1]], out.past_key_values, x.shape[1]
    for token in tokens:
        emb = lm.speech_embedding.weight[int(token)][None, None]
        out = lm.qwen(inputs_embeds=emb, past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[pos]], device=emb.device))
        hidden.append(out.last_hidden_state[:, -1])
        cache, pos = out.past_key_values, pos + 1
    return lm.llm_decoder(torch.cat(hidden)).log_softmax(-1).float().cpu()


@dataclass(frozen=True)
class DistributionReport:
    """Per-step distances of a candidate LM's speech-token distributions from the reference's."""

    tv: np.ndarray  # [steps] total variation distance
    kl: np.ndarray  # [steps] KL(reference || candidate)
    same_token: np.ndarray  # [steps] bool: the same draw picked the same token

    @property
    def steps(self) -> int:
        return int(self.tv.size)

    def summary(self) -> dict[str, float]:
        return {"steps": self.steps, "max_tv": float(self.tv.max()), "mean_tv": float(self.tv.mean()),
                "max_kl": float(self.kl.max()), "mean_kl": float(self.kl.mean()),
                "same_token": float(self.same_token.mean())}

    def meets(self, bar: QualityBar = BAR) -> bool:
        s = self.summary()
        return s["max_tv"] <= bar.max_tv and s["mean_tv"] <= bar.mean_tv and s["same_token"] >= bar.min_same_token

    @staticmethod
    def merge(reports: Iterable[DistributionReport]) -> DistributionReport:
        reports = list(reports)
        return DistributionReport(*(np.concatenate([getattr(r, f) for r in reports])
                                    for f in ("tv", "kl", "same_token")))


def compare(reference, candidate, text_tokens, prompt_text_tokens, prompt_speech_tokens, tokens: Sequence[int],
            draws: Sequence[float], *, min_len: int = 0, sampling: SamplingConfig | None = None
            ) -> DistributionReport:
    """Teacher-forced on the reference's ``tokens``: per step, TV and KL between the two LMs' distributions and
    whether ``sample_token`` with the same uniform draws (``draws``: the reference's, in order; a step that
    needs two, the repetition fallback, takes the next one) and the same history picks the same token.
    ``min_len``: steps before it mask end-of-speech, as in decoding."""
    args = (text_tokens, prompt_text_tokens, prompt_speech_tokens, tokens)
    ref, got = teacher_forced_logp(reference, *args), teacher_forced_logp(candidate, *args)
    p, q = ref.exp(), got.exp()
    tv = 0.5 * (p - q).abs().sum(-1)
    kl = (p * (ref - got).clamp(min=-1e4)).where(p > 0, torch.zeros(())).sum(-1)
    sampling = sampling or reference.config.sampling
    values = [float(u) for u in draws]
    same, offset = [], 0
    for step in range(ref.shape[0]):
        picks = []
        for logp in (ref[step], got[step]):
            draw = _Draws(values, offset)
            picks.append(sample_token(logp, list(tokens[:step]), make_draw(draw), sampling,
                                      eos_token=reference.eos_token, ignore_eos=step < min_len))
            used = draw.used
            if len(picks) == 1:
                ref_used = used
        offset += ref_used
        same.append(picks[0] == picks[1])
    return DistributionReport(tv.numpy(), kl.numpy(), np.asarray(same))


class _Draws:
    def __init__(self, values: list[float], offset: int):
        self.values, self.offset, self.used = values, offset, 0

    def __call__(self) -> float:
        i = self.offset + self.used
        self.used += 1
        return self.values[i] if i < len(self.values) else 0.5
