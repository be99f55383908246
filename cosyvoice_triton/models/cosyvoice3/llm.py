"""The CosyVoice3 speech-token LM (``CosyVoice3LM``): the CosyVoice2 LM's machinery with CosyVoice3's token layout.

CosyVoice3 keeps the CosyVoice2 structure (a transformers ``Qwen2ForCausalLM`` under ``llm.model``, built from
``CosyVoice-BlankEN/config.json``) and changes where the special tokens live. With ``S = speech_token_size``
(6561):

- there is no ``llm_embedding``: ``sos`` is row ``S``, ``task_id`` row ``S + 2`` of ``speech_embedding``;
- end-of-speech is ``S + 1``, the bistream fill token ``S + 3``;
- ``speech_embedding`` has ``S + 200`` rows and ``llm_decoder`` (hidden to ``S + 200`` logits) has no bias;
- every id from ``S`` to ``S + 199`` stops decoding (not yielded).

So ``llm.pt`` holds ``llm.model.*``, ``llm_decoder.weight`` and ``speech_embedding.weight``, the official
module's names and shapes.

Decoding is :class:`~cosyvoice_triton.models.llm.Qwen2LM`'s (``generate``, ``generate_batch``,
:class:`~cosyvoice_triton.models.llm.BatchDecoder`, ``mode_request``) on this layout, equal to the official
``inference``: input ``[sos, embed_tokens(prompt_text + text), task_id, speech_embedding(prompt_speech)]``,
``min_len`` / ``max_len`` from the text length without the prompt text, repetition-aware sampling. Two official
details carry over as they are:

- while fewer than ``min_len`` tokens are sampled the official ``sampling_ids`` masks id ``S``, which in
  CosyVoice3 is ``sos``, not end-of-speech (``S + 1``): end-of-speech, and any other stop id, may end a
  sequence before ``min_len``;
- the official ``inference`` asserts that ``<|endofprompt|>`` (text id 151646, hard-coded there) occurs in the
  prompt text or the text; here a request without it is refused with an :class:`~cosyvoice_triton.errors.LLMError`.
  The official examples put it after a system prompt: zero-shot prompt text
  ``"You are a helpful assistant.<|endofprompt|>" + transcript``; instruct2 (the instruction in place of the
  prompt text, no prompt speech tokens) ``"You are a helpful assistant. <instruction><|endofprompt|>"``;
  cross-lingual (neither prompt) the text itself starts with ``"You are a helpful assistant.<|endofprompt|>"``.

The official ``CosyVoice3Model.llm_job`` then drops "silent" speech tokens (FSQ silence and breath) past a run of
five before they reach the flow: :func:`drop_long_silences`. Voice conversion does not use the LM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from transformers import Qwen2Config

from ...config import LLMConfig, _llm_config_from_doc, load_hyperpyyaml
from ...errors import CheckpointError, ConfigError, LLMError
from ..checkpoint import read_state_dict
from ..llm import QWEN_DIR, Qwen2Encoder, Qwen2LM
from ..sampling import check_sampling

log = logging.getLogger(__name__)

YAML_NAME = "cosyvoice3.yaml"
LLM_CLASS = "cosyvoice.llm.llm.CosyVoice3LM"
#: ``<|endofprompt|>``: the text id the official CosyVoice3 LM requires in its input (hard-coded there).
ENDOFPROMPT = 151646
#: Rows after the speech tokens in ``speech_embedding`` and outputs after them in ``llm_decoder``.
SPECIAL_ROWS = 200
#: The speech tokens ``CosyVoice3Model`` treats as silence or breath, and the longest run of them it keeps.
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5


class CosyVoice3LM(Qwen2LM):
    """The CosyVoice3 LM. Build with :meth:`from_config` or :func:`load_llm3`; decode as a ``Qwen2LM``."""

    def __init__(self, llm_config: LLMConfig, qwen_config: Qwen2Config):
        nn.Module.__init__(self)
        hidden = qwen_config.hidden_size
        if (llm_config.llm_input_size, llm_config.llm_output_size) != (hidden, hidden):
            raise ConfigError(
                f"llm_input_size / llm_output_size ({llm_config.llm_input_size}, {llm_config.llm_output_size}) in "
                f"{YAML_NAME} disagree with the Qwen2 hidden_size {hidden} of {QWEN_DIR}/config.json"
            )
        if qwen_config.vocab_size <= ENDOFPROMPT:
            raise ConfigError(
                f"{QWEN_DIR}/config.json: vocab_size {qwen_config.vocab_size} has no row for <|endofprompt|> "
                f"({ENDOFPROMPT}), which every CosyVoice3 LM input holds"
            )
        check_sampling(llm_config.sampling)
        self.config = llm_config
        n = self.speech_token_size = llm_config.speech_token_size
        self.sos, self.eos_token, self.task_id, self.fill_token = n, n + 1, n + 2, n + 3
        self.stop_token_ids = tuple(range(n, n + SPECIAL_ROWS))
        self.llm = Qwen2Encoder(qwen_config)
        self.llm_decoder = nn.Linear(llm_config.llm_output_size, n + SPECIAL_ROWS, bias=False)
        self.speech_embedding = nn.Embedding(n + SPECIAL_ROWS, llm_config.llm_input_size)

    def special_embedding(self, token: int) -> torch.Tensor:
        """The input row ``[1, D]`` of ``sos`` / ``task_id``: a row of ``speech_embedding``."""
        return self.speech_embedding.weight[token : token + 1]

    def check_inputs(
        self, text_tokens: Any, prompt_text_tokens: Any = (), prompt_speech_tokens: Any = ()
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As :meth:`Qwen2LM.check_inputs`, and ``<|endofprompt|>`` must occur in the prompt text or the text."""
        text, prompt_text, speech = super().check_inputs(text_tokens, prompt_text_tokens, prompt_speech_tokens)
        if not (bool((text == ENDOFPROMPT).any()) or bool((prompt_text == ENDOFPROMPT).any())):
            raise LLMError(
                f"no <|endofprompt|> (text token {ENDOFPROMPT}) in the prompt text or the text: CosyVoice3 needs it "
                "after its system prompt (zero-shot: in the prompt text, 'You are a helpful assistant.<|endofprompt|>' "
                "before the transcript; instruct: at the end of the instruction; cross-lingual: at the start of the "
                "text)"
            )
        return text, prompt_text, speech

    def live_prompt(self, prompt_text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As the official ``inference_bistream`` for CosyVoice3: the prompt text up to and including its first
        ``<|endofprompt|>`` goes in right after sos, the rest starts the text cache. A prompt text without it is
        refused (the official code asserts)."""
        hits = (prompt_text == ENDOFPROMPT).nonzero()
        if not len(hits):
            raise LLMError(
                f"live decoding needs <|endofprompt|> (text token {ENDOFPROMPT}) in the prompt text: the system "
                "prompt (and a zero-shot transcript after it, or the instruction before it) comes first, the text "
                "then arrives piece by piece"
            )
        end = int(hits[0, 0]) + 1
        return prompt_text[:end], prompt_text[end:]


def drop_long_silences(tokens: Iterable[int], silent: frozenset[int] = SILENT_TOKENS,
                       max_run: int = MAX_SILENT_RUN) -> Iterator[int]:
    """The LM's speech tokens as ``CosyVoice3Model.llm_job`` passes them on: in a run of consecutive ``silent``
    tokens only the first ``max_run`` are kept (the LM itself still saw and conditioned on all of them)."""
    run = 0
    for token in tokens:
        if token in silent:
            run += 1
            if run > max_run:
                continue
        else:
            run = 0
        yield token


# ------------------------------------------------------------------------------------------- loading


def read_llm3_config(path: str | Path) -> LLMConfig:
    """The ``llm:`` section of a ``cosyvoice3.yaml`` (a file, or the model folder holding it), read without executing
    any of its tags; refuses a section whose class is not the official ``CosyVoice3LM``."""
    path = Path(path)
    if path.is_dir():
        path = path / YAML_NAME
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a CosyVoice3 model folder has {YAML_NAME})")
    try:
        doc = load_hyperpyyaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, ConfigError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    llm = doc.get("llm")
    if not isinstance(llm, dict):
        raise ConfigError(f"{path}: no llm section")
    if llm.get("__class__") != LLM_CLASS:
        raise ConfigError(f"{path}: llm is {llm.get('__class__')!r}, not {LLM_CLASS} (is this a CosyVoice3 folder?)")
    try:
        return _llm_config_from_doc(llm)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: unexpected llm section: {exc!r}") from exc


def check_llm3_state(model: CosyVoice3LM, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Refuse a state_dict that ``load_state_dict(strict=True)`` would refuse, naming the keys: missing,
    unexpected (a CosyVoice2 ``llm.pt`` is recognised by its ``llm_embedding``), or of another shape."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: file {tuple(state[k].shape)}, model {tuple(expected[k].shape)}"
             for k in expected if k in state and state[k].shape != expected[k].shape]
    if not (missing or unexpected or wrong):
        return
    if "llm_embedding.weight" in state or "llm_decoder.bias" in state:
        raise CheckpointError(f"{path}: a CosyVoice2 llm.pt (with llm_embedding / llm_decoder.bias), not CosyVoice3's")
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:3])}")
    if wrong:
        parts.append(f"{len(wrong)} of another shape: {'; '.join(wrong[:3])}")
    raise CheckpointError(f"{path}: does not match the CosyVoice3 LM built from {YAML_NAME} and {QWEN_DIR}/config.json"
                          f" ({'; '.join(parts)})")


def load_llm3(model_dir: str | Path, llm_config: LLMConfig | None = None, device: str | torch.device = "cpu", *,
              precision: str = "fp32", threads: int | None = None) -> CosyVoice3LM:
    """``llm.pt`` of a CosyVoice3 model folder, read with ``weights_only`` and loaded strictly, on ``device`` in eval
    mode. ``llm_config``: defaults to the folder's ``cosyvoice3.yaml``. ``precision`` / ``threads``: as for the
    CosyVoice2 LM (:func:`~cosyvoice_triton.models.lm_quant.quantize_lm`)."""
    from ..lm_quant import quantize_lm

    model_dir = Path(model_dir)
    if llm_config is None:
        llm_config = read_llm3_config(model_dir)
    llm_path = model_dir / "llm.pt"
    if not llm_path.is_file():
        raise CheckpointError(f"{llm_path}: file not found (a CosyVoice3 model folder has llm.pt)")
    qwen_path = model_dir / QWEN_DIR / "config.json"
    if not qwen_path.is_file():
        raise CheckpointError(f"{qwen_path}: file not found (a CosyVoice3 model folder has {QWEN_DIR}/config.json)")
    model = CosyVoice3LM.from_config(llm_config, qwen_path, init=False)
    state = read_state_dict(llm_path)
    check_llm3_state(model, state, llm_path)
    model.load_state_dict(state, strict=True)
    log.info("loaded %s (%d tensors)", llm_path, len(state))
    return quantize_lm(model.to(device).eval(), precision, threads=threads)
