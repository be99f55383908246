"""A random-weight CosyVoice2 model folder in the official layout, for demos and tests (CosyVoice3's:
:mod:`.cosyvoice3.demo`).

The real CosyVoice2-0.5B weights cannot be shipped or downloaded by this project. ``write_demo_model``
writes ``flow.pt``, ``hift.pt`` (state_dicts with exactly the official keys, shapes and weight-norm
spelling), ``cosyvoice2.yaml`` and stand-ins of ``speech_tokenizer_v2.onnx`` / ``campplus.onnx`` with the
official signatures, plus the text-to-speech half: ``llm.pt`` (the official ``Qwen2LM`` state_dict at these dims)
and ``CosyVoice-BlankEN/`` (a Qwen2 ``config.json`` and a small Qwen2-format stand-in tokenizer with CosyVoice2's
special tokens; its ids are not Qwen2.5's). Every loader and every command then runs unchanged on a real folder.

Random weights produce noise, not speech. Two touches keep the signal path exercised like a trained model:
biases and LayerNorm parameters get small perturbations (so no module sits at a trivial identity), and the
F0 predictor's classifier is rescaled so that the predicted pitch spans a speaking range (mostly voiced, as
in speech) instead of ~0 Hz, which would switch HiFT's harmonic source off.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from ..config import LLMConfig, ModelConfig, write_yaml
from ..errors import ConfigError
from .demo_weights import _DEMO_LOGIT_STD, SIZES, _calibrate_f0, _perturb
from .flow import CausalMaskedDiffWithXvec
from .hift import HiFTGenerator
from .standins import write_campplus_standin, write_speech_tokenizer_standin

log = logging.getLogger(__name__)


_README = """\
CosyVoice2 DEMO model folder written by cosyvoice_triton (size: {size}, seed: {seed}).

RANDOM WEIGHTS: everything this folder produces is noise, not speech. It exists so that every command of
the project runs end to end without the real checkpoint. flow.pt / hift.pt / llm.pt have exactly the keys
and shapes of the official files at these dims; speech_tokenizer_v2.onnx / campplus.onnx are small stand-ins
with the official input/output signatures; CosyVoice-BlankEN/ holds a Qwen2 config.json at these dims and a
STAND-IN tokenizer (a small byte-level BPE in the Qwen2 file format with CosyVoice2's special tokens, not the
Qwen2.5 vocabulary). Point --model-dir (or MODEL_DIR=) at a real CosyVoice2-0.5B folder to
get speech.
"""


def _perturb_weight_norm_gains(module: nn.Module, generator: torch.Generator) -> None:
    """Scale every weight-norm magnitude g by exp(0.1 N(0, 1)), so that it no longer equals the norm of v."""
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("parametrizations.weight.original0"):
                p.mul_(torch.exp(0.1 * torch.randn(p.shape, generator=generator)))


def build_demo_models(config: ModelConfig, *, seed: int = 0, perturb_gains: bool = False
                      ) -> tuple[CausalMaskedDiffWithXvec, HiFTGenerator]:
    """Flow and HiFT with deterministic random weights (same ``seed`` and dims: same tensors).
    ``perturb_gains`` also moves HiFT's weight-norm magnitudes off their initial value (the test oracle's weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        flow = CausalMaskedDiffWithXvec(config.flow).eval()
        hift = HiFTGenerator(config.hift).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    _perturb(flow, generator)
    _perturb(hift, generator)
    if perturb_gains:
        _perturb_weight_norm_gains(hift, generator)
    _calibrate_f0(hift, config)
    return flow, hift


def write_demo_model(out_dir: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Write a complete random-weight model folder in the official layout; returns its path."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    config = ModelConfig.tiny() if size == "tiny" else ModelConfig.full()
    config = dataclasses.replace(config, llm=LLMConfig.tiny() if size == "tiny" else LLMConfig.full())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("building %s demo model (seed %d)", size, seed)
    flow, hift = build_demo_models(config, seed=seed)
    write_yaml(config, out / "cosyvoice2.yaml")
    for name, module in (("flow.pt", flow), ("hift.pt", hift)):
        torch.save(module.state_dict(), out / name)
        log.info("wrote %s (%.1f MB)", out / name, (out / name).stat().st_size / 1e6)
    _write_demo_llm(out, config, size=size, seed=seed)
    write_speech_tokenizer_standin(out / "speech_tokenizer_v2.onnx", seed=seed)
    write_campplus_standin(out / "campplus.onnx", seed=seed)
    (out / "README.txt").write_text(_README.format(size=size, seed=seed), encoding="utf-8")
    log.info("demo model folder ready: %s", out)
    return out


def _write_demo_llm(out: Path, config: ModelConfig, *, size: str, seed: int) -> None:
    """``CosyVoice-BlankEN/`` (Qwen2 config + stand-in tokenizer) and ``llm.pt`` with random weights."""
    from ..frontend.text.standin import write_tokenizer_standin
    from .llm import QWEN_DIR, read_qwen_config, write_qwen_config  # transformers: lazy

    qwen_dir = out / QWEN_DIR
    config_path = write_qwen_config(qwen_dir, size=size)
    write_tokenizer_standin(qwen_dir, vocab_size=read_qwen_config(config_path).vocab_size)
    lm = build_demo_llm(config, config_path, seed=seed)
    torch.save(lm.state_dict(), out / "llm.pt")
    log.info("wrote %s (%.1f MB)", out / "llm.pt", (out / "llm.pt").stat().st_size / 1e6)


# ---------------------------------------------------------------------------------------- the demo LM


def build_demo_llm(config: LLMConfig | ModelConfig, qwen_config_path: str | Path, seed: int = 0):
    """A ``Qwen2LM`` with deterministic random weights whose sampling behaves like a trained model's: varied
    tokens, end-of-speech reachable but rarely at once (a few tens of tokens at tiny dims).

    After PyTorch's / transformers' initialisation: constant tensors (norms, biases) get small perturbations,
    the sos / task / speech embeddings are brought to the text embedding's scale (so the text steers the
    output), and ``llm_decoder`` is rescaled so the speech logits have a standard deviation of
    ``_DEMO_LOGIT_STD``, with the end-of-speech bias set so that this id is among the ``top_k`` most likely
    ones on about a ``_DEMO_EOS_IN_NUCLEUS`` share of steps of a calibration sequence.
    """
    llm_config = config.llm if isinstance(config, ModelConfig) else config
    if llm_config is None:
        raise ConfigError("the ModelConfig has no llm section")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        from .llm import Qwen2LM  # transformers: lazy

        lm = Qwen2LM.from_config(llm_config, qwen_config_path).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    _perturb(lm, generator)
    _calibrate_demo(lm, generator)
    return lm


_DEMO_EOS_IN_NUCLEUS = 0.4


@torch.no_grad()
def _calibrate_demo(lm, generator: torch.Generator) -> None:
    scale = float(lm.qwen.embed_tokens.weight.std())
    for emb in (lm.llm_embedding, lm.speech_embedding):
        emb.weight.mul_(scale / float(emb.weight.std()))
    # A calibration sequence: a random text and prompt, then random speech tokens.
    text = torch.randint(0, lm.text_vocab_size, (24,), generator=generator)
    speech = torch.randint(0, lm.speech_token_size, (96,), generator=generator)
    x = torch.cat([lm.lm_input(text, (), speech[:32]), lm.speech_embedding(speech[32:])[None]], dim=1)
    hidden = lm.qwen(inputs_embeds=x).last_hidden_state[0, -speech[32:].numel() - 1 :]
    dec = lm.llm_decoder
    logits = dec(hidden)[:, : lm.speech_token_size]
    dec.weight.mul_(_DEMO_LOGIT_STD / float(logits.std()))
    dec.bias.mul_(_DEMO_LOGIT_STD / float(logits.std()))
    logits = dec(hidden)
    k = lm.config.sampling.top_k
    threshold = logits[:, : lm.speech_token_size].topk(k, dim=1).values[:, -1]
    eos = logits[:, lm.eos_token]
    gap = torch.quantile(threshold - eos, _DEMO_EOS_IN_NUCLEUS)
    dec.bias[lm.eos_token] += gap
    # The two other stop ids: well below the speech tokens, as rare as in a trained model.
    dec.bias[lm.eos_token + 1 :] = float(logits.min()) - 2 * _DEMO_LOGIT_STD
