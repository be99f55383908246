"""A random-weight CosyVoice3 model folder in the official (Fun-CosyVoice3-0.5B) layout, for demos and tests.

:func:`write_demo_model3` writes ``cosyvoice3.yaml`` (:func:`~.config.write_cosyvoice3_yaml` at the chosen dims),
``llm.pt``, ``flow.pt`` and ``hift.pt`` (the official state_dicts' keys and shapes at those dims, loadable by
:func:`~.llm.load_llm3`, :func:`~.flow.load_flow3`, :func:`~.hift.load_hift3` with their strict checks),
stand-ins of ``campplus.onnx`` and ``speech_tokenizer_v3.onnx``, and ``CosyVoice-BlankEN/``: a Qwen2 ``config.json``
with Qwen2.5's 151,936 text rows at both sizes and a stand-in tokenizer padded so that CosyVoice3's special tokens
have their official ids (the official LM looks for ``<|endofprompt|>`` by its id, 151646).

Random weights produce noise, not speech. As for the CosyVoice2 demo (:mod:`..demo_weights`), constant tensors get
small perturbations, the F0 predictor is rescaled to a speaking range, and the LM is calibrated so that
its tokens vary and end-of-speech is reachable but not immediate. CosyVoice3's ``llm_decoder`` has no bias, so
one hidden dimension is made to carry a constant (:func:`_carry_bias`) and end-of-speech gets a constant logit
through it alone, among the ``top_k`` most likely ids on about ``_EOS_IN_NUCLEUS`` of the steps the LM takes when
it samples its own tokens; the other 199 stop rows are shrunk far below the speech tokens. Measured (seed 0): a
67-token text gives 60 to 306 tokens at tiny dims; a 13-token text 51 to 123 at the release dims.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...config import ModelConfig
from ..demo_weights import _DEMO_LOGIT_STD, SIZES, _calibrate_f0, _perturb
from ..standins import write_campplus_standin, write_speech_tokenizer_standin
from .config import YAML_NAME, CosyVoice3Config, write_cosyvoice3_yaml
from .flow import CausalMaskedDiffWithDiT
from .hift import CausalHiFTGenerator
from .llm import ENDOFPROMPT, CosyVoice3LM

log = logging.getLogger(__name__)

#: Qwen2.5's text rows, the LM's at both sizes (the official special ids need them).
QWEN_TEXT_ROWS = 151936
SPEECH_TOKENIZER = "speech_tokenizer_v3.onnx"

_README = """\
CosyVoice3 DEMO model folder written by cosyvoice_triton (size: {size}, seed: {seed}).

RANDOM WEIGHTS: everything this folder produces is noise, not speech. It exists so that every CosyVoice3 code path
of the project runs end to end without the real checkpoint. cosyvoice3.yaml has the structure of the official
Fun-CosyVoice3-0.5B file at these dims; llm.pt / flow.pt / hift.pt have exactly the keys and shapes of the
official files at these dims; speech_tokenizer_v3.onnx / campplus.onnx are small stand-ins with the official
input/output signatures; CosyVoice-BlankEN/ holds a Qwen2 config.json and a STAND-IN tokenizer (a small
byte-level BPE in the Qwen2 file format, padded so that CosyVoice3's special tokens have their official ids,
<|endofprompt|> = 151646; the text's ids are not Qwen2.5's). CosyVoice3 prompt texts start with
'You are a helpful assistant.<|endofprompt|>'. Point --model-dir at a real Fun-CosyVoice3-0.5B folder to get
speech.
"""


def write_demo_model3(out_dir: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Write a complete random-weight CosyVoice3 model folder in the official layout; returns its path."""
    from ...frontend.text.standin import write_tokenizer_standin
    from ..llm import QWEN_DIR, write_qwen_config  # transformers: lazy

    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    config = CosyVoice3Config.tiny() if size == "tiny" else CosyVoice3Config.full()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("building %s CosyVoice3 demo model (seed %d)", size, seed)
    write_cosyvoice3_yaml(config, out / YAML_NAME)
    flow, hift = build_demo_flow_hift3(config, seed=seed)
    qwen_path = write_qwen_config(out / QWEN_DIR, size, vocab_size=QWEN_TEXT_ROWS)
    write_tokenizer_standin(out / QWEN_DIR, QWEN_TEXT_ROWS, official_ids=True)
    lm = build_demo_llm3(config, qwen_path, seed=seed)
    for name, module in (("flow.pt", flow), ("hift.pt", hift), ("llm.pt", lm)):
        torch.save(module.state_dict(), out / name)
        log.info("wrote %s (%.1f MB)", out / name, (out / name).stat().st_size / 1e6)
    write_speech_tokenizer_standin(out / SPEECH_TOKENIZER, seed=seed, version="v3")
    write_campplus_standin(out / "campplus.onnx", seed=seed)
    (out / "README.txt").write_text(_README.format(size=size, seed=seed), encoding="utf-8")
    log.info("CosyVoice3 demo model folder ready: %s", out)
    return out


def build_demo_flow_hift3(config: CosyVoice3Config, *, seed: int = 0
                          ) -> tuple[CausalMaskedDiffWithDiT, CausalHiFTGenerator]:
    """The DiT flow and causal HiFT with deterministic random weights (same ``seed`` and dims: same tensors)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        flow = CausalMaskedDiffWithDiT(config.flow).eval()
        hift = CausalHiFTGenerator(config.hift, noise_seed=seed).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    _perturb(flow, generator)
    _perturb(hift, generator)
    _calibrate_f0(hift, ModelConfig(sample_rate=config.sample_rate, mel=config.mel))
    return flow, hift


def build_demo_llm3(config: CosyVoice3Config, qwen_config_path: str | Path, *, seed: int = 0) -> CosyVoice3LM:
    """A :class:`CosyVoice3LM` with deterministic random weights whose sampling behaves like a trained model's
    (see the module docstring)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = CosyVoice3LM.from_config(config.llm, qwen_config_path).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    _perturb(lm, generator)
    _calibrate_llm3(lm, generator)
    return lm


#: The share of a calibration sequence's steps with end-of-speech among the top_k (lower than CosyVoice2's demo:
#: nothing masks end-of-speech before min_len here, see :mod:`.llm`).
_EOS_IN_NUCLEUS = 0.1
_CALIBRATION_STEPS = 48
#: The carrier dimension's value in every input embedding, in units of the embeddings' norm (see _carry_bias).
_BIAS_FEATURE = 1.5


@torch.no_grad()
def _carry_bias(lm: CosyVoice3LM) -> None:
    """Make hidden dimension 0 a constant feature: that column of every input embedding row holds the same value
    and no layer reads or writes it (column 0 of the q / k / v / gate / up projections, row 0 of o_proj /
    down_proj set to zero). The last hidden state then holds it too, scaled by the final RMSNorm, and column 0 of
    ``llm_decoder`` acts as a bias."""
    embed = lm.qwen.embed_tokens.weight
    feature = _BIAS_FEATURE * float(embed[:, 1:].std()) * (embed.shape[1] - 1) ** 0.5
    for table in (embed, lm.speech_embedding.weight):
        table[:, 0] = feature
    for name, p in lm.qwen.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            p[:, 0] = 0.0
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p[0, :] = 0.0


@torch.no_grad()
def _own_steps(lm: CosyVoice3LM, prompt: torch.Tensor, steps: int, generator: torch.Generator) -> torch.Tensor:
    """The last hidden states ``[steps, D]`` of ``steps`` decoding steps after ``prompt`` ``[1, T, D]``, each step's
    token drawn uniformly from the ``top_k`` speech tokens (never a stop id)."""
    out = lm.qwen(inputs_embeds=prompt, use_cache=True)
    states = []
    for _ in range(steps):
        h = out.last_hidden_state[0, -1]
        states.append(h)
        top = (lm.llm_decoder.weight[: lm.speech_token_size] @ h).topk(lm.config.sampling.top_k).indices
        token = top[torch.randint(0, len(top), (1,), generator=generator)]
        out = lm.qwen(inputs_embeds=lm.speech_embedding(token)[None], past_key_values=out.past_key_values,
                      use_cache=True)
    return torch.stack(states)


@torch.no_grad()
def _calibrate_llm3(lm: CosyVoice3LM, generator: torch.Generator) -> None:
    n = lm.speech_token_size
    scale = float(lm.qwen.embed_tokens.weight.std())
    lm.speech_embedding.weight.mul_(scale / float(lm.speech_embedding.weight.std()))
    _carry_bias(lm)
    # A calibration sequence: a system prompt's <|endofprompt|>, a random text and prompt, then speech tokens.
    text = torch.cat([torch.randint(0, 1000, (12,), generator=generator), torch.tensor([ENDOFPROMPT]),
                      torch.randint(0, 1000, (12,), generator=generator)])
    speech = torch.randint(0, n, (96,), generator=generator)
    x = torch.cat([lm.lm_input(text, (), speech[:32]), lm.speech_embedding(speech[32:])[None]], dim=1)
    hidden = lm.qwen(inputs_embeds=x).last_hidden_state[0, -speech[32:].numel() - 1:]
    weight = lm.llm_decoder.weight
    weight[:, 0] = 0.0
    weight.mul_(_DEMO_LOGIT_STD / float((hidden @ weight[:n].T).std()))
    # End-of-speech: a constant logit, through the carried bias alone (a context-dependent part shifts with the
    # whole sequence), among the top_k on an _EOS_IN_NUCLEUS share of the steps the LM takes when it samples its
    # own tokens.
    hidden = _own_steps(lm, lm.lm_input(text, (), speech[:32]), _CALIBRATION_STEPS, generator)
    threshold = (hidden @ weight[:n].T).topk(lm.config.sampling.top_k, dim=1).values[:, -1]
    weight[lm.eos_token] = 0.0
    weight[lm.eos_token, 0] = float(torch.quantile(threshold, _EOS_IN_NUCLEUS)) / float(hidden[:, 0].mean())
    # The 199 other stop ids: near zero, far below the top-k speech tokens.
    others = [i for i in range(n, n + len(lm.stop_token_ids)) if i != lm.eos_token]
    weight[others] *= 0.05
