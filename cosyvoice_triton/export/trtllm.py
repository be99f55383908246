"""The CosyVoice2 LM for the TensorRT-LLM backend: ``llm.pt`` + ``CosyVoice-BlankEN/`` -> a Hugging Face Qwen2 folder
with one merged vocabulary, then TensorRT-LLM's checkpoint conversion and ``trtllm-build``.

TensorRT-LLM builds engines for stock architectures; the official ``Qwen2LM`` is a Qwen2 transformer with three
extra tables (``llm_embedding``: sos and task-id rows; ``speech_embedding``; ``llm_decoder``: hidden to speech
logits). The official Triton runtime (``runtime/triton_trtllm``) therefore serves it as a plain
``Qwen2ForCausalLM`` whose vocabulary is extended, and so does this converter. Merged ids (``T`` = the CosyVoice2
text tokenizer's size, 151663 with the release files; ``S`` = ``speech_token_size``, 6561):

=========================  =====================================  ==========================================
ids                        input embedding row                    ``lm_head`` row / embedding bias
=========================  =====================================  ==========================================
``[0, T)`` text            ``embed_tokens`` (unchanged)           zero / ``-inf`` (never sampled)
``T + [0, S)`` speech      ``speech_embedding[0:S]``              ``llm_decoder`` row / its bias
``T + S + {0,1,2}`` stops  ``speech_embedding[S:S+3]``            ``llm_decoder`` row / its bias
``T + S + 3`` ``<|sos|>``  ``llm_embedding[0]``                   zero / ``-inf``
``T + S + 4`` task id      ``llm_embedding[1]``                   zero / ``-inf``
up to a multiple of 128    zero (padding)                         zero / ``-inf``
=========================  =====================================  ==========================================

The prompt the official ``Qwen2LM.inference`` embeds, ``[sos, embed(prompt_text + text), task_id,
speech_embedding(prompt_speech)]``, is then the id sequence ``[T+S+3, *prompt_text, *text, T+S+4, T + prompt_speech]``
(:meth:`MergedVocab.input_ids`); each sampled id ``T + k`` feeds back as ``speech_embedding[k]``, as in the official
decode loop, and ``T + S`` (``<|eos1|>``) is the engine's ``end_id``.

The ``llm_decoder`` bias: neither transformers' ``Qwen2ForCausalLM`` nor TensorRT-LLM's ``QWenForCausalLM`` has an
``lm_head`` bias (the TensorRT-LLM model builds its ``lm_head`` with ``bias=False``), so a bias written into the
checkpoint is dropped silently and text rows would get logit 0. The bias over the whole merged vocabulary (the
decoder's bias on the speech rows, ``-inf`` elsewhere) is written beside the weights
(:data:`BIAS_FILE`) and is sent with each request as the TensorRT-LLM backend's ``embedding_bias`` input, which
the backend adds to the logits before sampling: logits + bias are then exactly the official speech logits, text
ids included as impossible. (The official runtime's merged folder carries the bias in ``lm_head.bias``, which
TensorRT-LLM does not read.)

Files written into the output folder: ``config.json`` (the ``CosyVoice-BlankEN`` Qwen2 config with
``vocab_size`` = the merged size, untied embeddings), ``model.safetensors``, ``generation_config.json`` (end ids,
the yaml's top-k / top-p), the tokenizer (``CosyVoice-BlankEN`` + CosyVoice2's added tokens + ``<|s_0|>`` ...
``<|s_6560|>``, ``<|eos1|>`` ... ``<|eos3|>``, ``<|sos|>``, ``<|task_id|>``: the names the official runtime's
tokenizer uses), :data:`BIAS_FILE` and :data:`VOCAB_FILE` (the table above as numbers). The official files are
only read.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError, LLMError

log = logging.getLogger(__name__)

VOCAB_FILE = "cosyvoice_vocab.json"  # the merged vocabulary's layout (MergedVocab) and where it came from
BIAS_FILE = "embedding_bias.safetensors"  # tensor "embedding_bias", float32 [vocab_size]
BIAS_TENSOR = "embedding_bias"
PAD_MULTIPLE = 128
SOS_TOKEN, TASK_TOKEN = "<|sos|>", "<|task_id|>"
STOP_TOKENS = ("<|eos1|>", "<|eos2|>", "<|eos3|>")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Files of the converted folder that serving needs beside the engine (copied into the engine folder).
SERVING_FILES = (VOCAB_FILE, BIAS_FILE, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json")
_FORMAT = 1


def speech_token_name(k: int) -> str:
    return f"<|s_{k}|>"


@dataclass(frozen=True)
class MergedVocab:
    """The merged vocabulary's layout (see the module docstring)."""

    text_vocab_size: int  # the CosyVoice2 text tokenizer's size = the first speech id
    speech_token_size: int  # speech tokens proper (6561); three stop ids follow them
    vocab_size: int  # rows of the embedding / lm_head: text + speech + 3 stops + sos + task, padded

    @classmethod
    def for_sizes(cls, text_vocab_size: int, speech_token_size: int, multiple: int = PAD_MULTIPLE) -> MergedVocab:
        used = text_vocab_size + speech_token_size + 5
        return cls(text_vocab_size, speech_token_size, -(-used // multiple) * multiple)

    def __post_init__(self):
        if min(self.text_vocab_size, self.speech_token_size) < 1 or self.vocab_size < self.used:
            raise ConfigError(f"inconsistent merged vocabulary {self}")

    @property
    def speech_offset(self) -> int:
        return self.text_vocab_size

    @property
    def end_id(self) -> int:
        """``<|eos1|>``: the official end of speech (``speech_token_size``), the engine's ``end_id``."""
        return self.speech_offset + self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, int, int]:
        """The three ids the official decoder stops on (``end_id`` and two more, which TensorRT-LLM only stops on
        when they are sent as ``stop_words_list``)."""
        return self.end_id, self.end_id + 1, self.end_id + 2

    @property
    def sos_id(self) -> int:
        return self.end_id + 3

    @property
    def task_id(self) -> int:
        return self.end_id + 4

    @property
    def used(self) -> int:
        """Ids with a token (the rest up to ``vocab_size`` is padding)."""
        return self.task_id + 1

    def input_ids(self, text_tokens: Any, prompt_text_tokens: Any = (), prompt_speech_tokens: Any = ()) -> np.ndarray:
        """The engine's ``input_ids`` (int32) for the official LM prompt of these token sequences."""
        text = _ids(text_tokens, "text_tokens", self.text_vocab_size)
        prompt_text = _ids(prompt_text_tokens, "prompt_text_tokens", self.text_vocab_size)
        speech = _ids(prompt_speech_tokens, "prompt_speech_tokens", self.speech_token_size)
        if text.size == 0:
            raise LLMError("text_tokens: empty (nothing to synthesise)")
        return np.concatenate([[self.sos_id], prompt_text, text, [self.task_id], speech + self.speech_offset]
                              ).astype(np.int32)

    def speech_tokens(self, output_ids: Any) -> list[int]:
        """Merged ids sampled by the engine -> speech tokens, up to the first stop id (not included)."""
        out = []
        for i in np.asarray(output_ids, dtype=np.int64).reshape(-1):
            k = int(i) - self.speech_offset
            if int(i) in self.stop_ids:
                break
            if not 0 <= k < self.speech_token_size:
                raise LLMError(f"output id {int(i)} is not a speech token (ids {self.speech_offset}.."
                               f"{self.end_id - 1}): is embedding_bias sent with the request?")
            out.append(k)
        return out

    def stop_words_list(self) -> np.ndarray:
        """The TensorRT-LLM ``stop_words_list`` ([2, n] int32: ids, then cumulative offsets) of the two stop ids
        besides ``end_id``."""
        return np.array([[self.stop_ids[1], self.stop_ids[2]], [1, 2]], dtype=np.int32)

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "speech_offset": self.speech_offset, "end_id": self.end_id,
                "stop_ids": list(self.stop_ids), "sos_id": self.sos_id, "task_id": self.task_id, "used": self.used}


def _ids(tokens: Any, name: str, limit: int) -> np.ndarray:
    a = np.asarray(tokens.detach().cpu() if isinstance(tokens, torch.Tensor) else tokens)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise LLMError(f"{name}: token ids must be integers, got {a.dtype}")
    a = a.reshape(-1).astype(np.int64)
    if a.min() < 0 or a.max() >= limit:
        raise LLMError(f"{name}: token id {int(a.min() if a.min() < 0 else a.max())} is outside [0, {limit})")
    return a


# ------------------------------------------------------------------------------------------ conversion


@dataclass
class Conversion:
    """What :func:`convert_llm` wrote."""

    out_dir: Path
    vocab: MergedVocab
    dtype: str
    hidden_size: int
    tensors: int
    seconds: float
    files: list[str] = field(default_factory=list)

    def describe(self) -> str:
        v = self.vocab
        return (f"{self.out_dir}: Qwen2ForCausalLM, hidden {self.hidden_size}, {self.tensors} tensors in "
                f"{self.dtype}; vocabulary {v.vocab_size} = text {v.text_vocab_size} + speech "
                f"{v.speech_token_size} + 3 stops + sos + task id ({v.vocab_size - v.used} padding); speech ids "
                f"from {v.speech_offset}, end_id {v.end_id}, sos {v.sos_id}, task id {v.task_id} "
                f"({self.seconds:.1f} s)")


def read_vocab(folder: str | Path) -> MergedVocab:
    """The :class:`MergedVocab` of a converted folder (or an engine folder :func:`stage_serving_files` filled)."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (write it with export/convert_llm.py)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        vocab = MergedVocab(int(doc["text_vocab_size"]), int(doc["speech_token_size"]), int(doc["vocab_size"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a merged-vocabulary file ({exc})") from exc
    if doc.get("format") != _FORMAT:
        raise CheckpointError(f"{path}: format {doc.get('format')!r}, expected {_FORMAT}: convert again")
    return vocab


def read_bias(folder: str | Path) -> torch.Tensor:
    """The float32 ``embedding_bias`` [vocab_size] of a converted folder."""
    from safetensors.torch import load_file

    path = Path(folder) / BIAS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (write it with export/convert_llm.py)")
    return load_file(str(path))[BIAS_TENSOR]


def check_model_dir(model_dir: str | Path) -> Path:
    """The files the conversion reads, each present, or a :class:`CheckpointError` naming what is missing."""
    from ..frontend.text.tokenizer import TOKENIZER_FILES
    from ..models.llm import QWEN_DIR

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a folder (expected a CosyVoice2-0.5B model folder)")
    qwen = model_dir / QWEN_DIR
    needed = ["cosyvoice2.yaml", "llm.pt", f"{QWEN_DIR}/config.json"]
    if not (qwen / "tokenizer.json").is_file():
        needed += [f"{QWEN_DIR}/{name}" for name in TOKENIZER_FILES]
    missing = [name for name in needed if not (model_dir / name).is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: missing {', '.join(missing)} (the LM conversion reads cosyvoice2.yaml, "
                              f"llm.pt and {QWEN_DIR}/ with its config.json and tokenizer files)")
    return model_dir


def convert_llm(model_dir: str | Path, out_dir: str | Path, *, dtype: str = "auto", overwrite: bool = False,
                progress: Callable[[str], None] = log.info) -> Conversion:
    """Write the merged Hugging Face Qwen2 folder of ``model_dir``'s ``llm.pt`` + ``CosyVoice-BlankEN/`` into
    ``out_dir`` (see the module docstring).

    ``dtype``: ``auto`` (the dtype of ``llm.pt``'s floating tensors), ``float32``, ``float16`` or ``bfloat16``.
    ``out_dir`` must not exist, be empty, or (``overwrite``) be a folder this function wrote; the folder appears
    complete or not at all (written beside it, then renamed). Every step is reported through ``progress``.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from ..config import ModelConfig
    from ..frontend.text.tokenizer import QwenTextTokenizer
    from ..models.checkpoint import load_into, read_state_dict
    from ..models.llm import QWEN_DIR, Qwen2LM

    start = time.perf_counter()
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    model_dir = check_model_dir(model_dir)
    out = Path(out_dir)
    _check_out_dir(out, overwrite)

    config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    if config.llm is None:
        raise ConfigError(f"{model_dir}/cosyvoice2.yaml has no llm section (is this a CosyVoice2 folder?)")
    progress(f"[1/5] reading {model_dir / 'llm.pt'} ({(model_dir / 'llm.pt').stat().st_size / 1e6:.1f} MB)")
    state = read_state_dict(model_dir / "llm.pt")
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    if dtype == "auto":
        if len(floats) != 1 or next(iter(floats)) not in DTYPES.values():
            raise ConfigError(f"llm.pt holds tensors of {sorted(map(str, floats))}: choose --dtype")
        dtype = next(k for k, v in DTYPES.items() if v in floats)
    lm = Qwen2LM.from_config(config.llm, model_dir / QWEN_DIR / "config.json", init=False)
    load_into(lm, state, model_dir / "llm.pt")  # strict: missing / unexpected keys and shapes are named
    del state
    lm.eval()
    qwen_cfg = lm.llm.model.config
    embed = lm.qwen.embed_tokens.weight.detach()
    hidden = embed.shape[1]
    progress(f"      Qwen2 hidden {hidden}, {qwen_cfg.num_hidden_layers} layers, embed_tokens {tuple(embed.shape)}, "
             f"speech_embedding {tuple(lm.speech_embedding.weight.shape)}, llm_decoder "
             f"{tuple(lm.llm_decoder.weight.shape)}, llm_embedding {tuple(lm.llm_embedding.weight.shape)}")

    progress(f"[2/5] text tokenizer of {model_dir / QWEN_DIR}")
    tokenizer = _hf_tokenizer(QwenTextTokenizer(model_dir / QWEN_DIR))
    text_vocab = len(tokenizer)
    if text_vocab > embed.shape[0]:
        raise CheckpointError(f"{model_dir / QWEN_DIR}: the tokenizer has {text_vocab} ids but embed_tokens only "
                              f"{embed.shape[0]} rows: tokenizer and config.json are not of the same model")
    vocab = MergedVocab.for_sizes(text_vocab, lm.speech_token_size)
    progress(f"      {text_vocab} text ids (with CosyVoice2's added tokens) -> merged vocabulary {vocab.vocab_size} "
             f"(speech ids from {vocab.speech_offset}, end_id {vocab.end_id}, sos {vocab.sos_id}, task id "
             f"{vocab.task_id}, {vocab.vocab_size - vocab.used} padding)")

    progress("[3/5] merging embed_tokens + speech_embedding + llm_embedding, lm_head = llm_decoder")
    dec = lm.llm_decoder
    n_speech = lm.speech_token_size + 3
    with torch.no_grad():
        new_embed = embed.new_zeros(vocab.vocab_size, hidden)
        new_embed[:text_vocab] = embed[:text_vocab]
        new_embed[vocab.speech_offset : vocab.speech_offset + n_speech] = lm.speech_embedding.weight
        new_embed[vocab.sos_id] = lm.llm_embedding.weight[Qwen2LM.sos]
        new_embed[vocab.task_id] = lm.llm_embedding.weight[Qwen2LM.task_id]
        head = embed.new_zeros(vocab.vocab_size, hidden)
        head[vocab.speech_offset : vocab.speech_offset + n_speech] = dec.weight
        bias = torch.full((vocab.vocab_size,), float("-inf"))
        bias[vocab.speech_offset : vocab.speech_offset + n_speech] = dec.bias.float()
    weights = {k: v.detach() for k, v in lm.qwen.state_dict().items() if k != "embed_tokens.weight"}
    weights = {"model.embed_tokens.weight": new_embed, **{f"model.{k}": v for k, v in weights.items()},
               "lm_head.weight": head}
    weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in weights.items()}

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        progress(f"[4/5] writing {len(weights)} tensors ({sum(v.numel() for v in weights.values()) / 1e6:.1f} M "
                 f"parameters, {dtype}) to model.safetensors")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        save_file({BIAS_TENSOR: bias.contiguous()}, str(tmp / BIAS_FILE))
        cfg = json.loads((model_dir / QWEN_DIR / "config.json").read_text(encoding="utf-8"))  # as released
        cfg.update(architectures=["Qwen2ForCausalLM"], vocab_size=vocab.vocab_size, tie_word_embeddings=False,
                   torch_dtype=dtype, bos_token_id=vocab.sos_id, eos_token_id=vocab.end_id,
                   pad_token_id=vocab.end_id)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        sampling = config.llm.sampling
        GenerationConfig(bos_token_id=vocab.sos_id, eos_token_id=list(vocab.stop_ids), pad_token_id=vocab.end_id,
                         do_sample=True, top_k=sampling.top_k, top_p=sampling.top_p,
                         temperature=1.0).save_pretrained(str(tmp))

        progress(f"[5/5] tokenizer: + {n_speech + 2} tokens (speech, stops, {SOS_TOKEN}, {TASK_TOKEN})")
        _extend_tokenizer(tokenizer, vocab)
        tokenizer.save_pretrained(str(tmp))
        doc = {"format": _FORMAT, **vocab.to_json(), "dtype": dtype, "hidden_size": hidden,
               "source": {"model_dir": str(model_dir.resolve()), "llm_pt_bytes": (model_dir / "llm.pt").stat().st_size},
               "prompt": "[sos_id, *prompt_text_tokens, *text_tokens, task_id, *(prompt_speech_tokens + "
                         "speech_offset)]; sampled ids - speech_offset are speech tokens; send embedding_bias",
               "tokens": {"speech": "<|s_K|>", "stops": list(STOP_TOKENS), "sos": SOS_TOKEN, "task_id": TASK_TOKEN}}
        (tmp / VOCAB_FILE).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        files = sorted(p.name for p in tmp.iterdir())
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result = Conversion(out, vocab, dtype, hidden, len(weights), time.perf_counter() - start, files)
    progress(result.describe())
    return result


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / VOCAB_FILE).is_file():
            raise CheckpointError(f"{out}: not empty and not written by this converter ({VOCAB_FILE} missing): "
                                  "refusing to replace it")
        if not overwrite:
            raise CheckpointError(f"{out}: a converted folder is there already (--overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)


def _hf_tokenizer(text_tokenizer) -> Any:
    # The transformers tokenizer inside QwenTextTokenizer: CosyVoice-BlankEN + CosyVoice2's added tokens, the
    # ids the in-process text front end produces.
    return text_tokenizer._tok


def _extend_tokenizer(tokenizer, vocab: MergedVocab) -> None:
    from transformers import AddedToken

    names = [speech_token_name(k) for k in range(vocab.speech_token_size)] + list(STOP_TOKENS) + [SOS_TOKEN,
                                                                                                  TASK_TOKEN]
    tokenizer.add_tokens([AddedToken(n, special=True, normalized=False) for n in names], special_tokens=True)
    got = [tokenizer.convert_tokens_to_ids(n) for n in (speech_token_name(0), STOP_TOKENS[0], SOS_TOKEN, TASK_TOKEN)]
    want = [vocab.speech_offset, vocab.end_id, vocab.sos_id, vocab.task_id]
    if got != want or len(tokenizer) != vocab.used:
        raise CheckpointError(f"the extended tokenizer's ids {got} (size {len(tokenizer)}) are not the merged "
                              f"vocabulary's {want} (size {vocab.used}): a CosyVoice-BlankEN tokenizer that already "
                              "holds some of these token names?")


# ---------------------------------------------------------------------------------------- verification


def merged_logits(model, input_ids: Sequence[int], bias: torch.Tensor) -> torch.Tensor:
    """Logits + embedding bias [len(input_ids), vocab_size] of a transformers ``Qwen2ForCausalLM`` loaded from a
    converted folder: what the TensorRT-LLM engine samples from."""
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
    with torch.inference_mode():
        return model(input_ids=ids).logits[0].float() + bias


def verify_conversion(hf_dir: str | Path, lm, text_tokens: Any, prompt_text_tokens: Any = (),
                      prompt_speech_tokens: Any = (), *, steps: int = 20, min_len: int | None = None
                      ) -> dict[str, Any]:
    """Compare the converted folder (loaded by transformers) with the PyTorch ``Qwen2LM`` ``lm`` on one prompt:
    greedy decoding of up to ``steps`` tokens by each (the converted one over the merged vocabulary with its
    embedding bias; end of speech masked for the first ``min_len`` steps, default all, as the official
    ``ignore_eos`` and TensorRT-LLM's ``min_length`` do), and the speech log-probabilities along the PyTorch LM's
    sequence. Returns
    ``{"max_abs_logp_diff", "greedy_equal", "tokens", "converted_tokens", "text_mass"}`` (``text_mass``: the
    largest probability any non-speech id got)."""
    from transformers import Qwen2ForCausalLM

    vocab = read_vocab(hf_dir)
    bias = read_bias(hf_dir)
    model = Qwen2ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    min_len = steps if min_len is None else min_len
    prompt = vocab.input_ids(text_tokens, prompt_text_tokens, prompt_speech_tokens).tolist()
    n_speech = vocab.speech_token_size + 3
    ours: list[int] = []
    ref_logp = []
    with torch.inference_mode():
        x = lm.lm_input(text_tokens, prompt_text_tokens, prompt_speech_tokens)
        for _ in range(steps):
            h = lm.qwen(inputs_embeds=x).last_hidden_state[:, -1]
            logp = lm.llm_decoder(h).log_softmax(-1)[0].float()
            ref_logp.append(logp)
            k = int(logp.masked_fill(_eos_mask(logp, lm.eos_token, len(ours) < min_len), float("-inf")).argmax())
            if k in lm.stop_token_ids:
                break
            ours.append(k)
            x = torch.cat([x, lm.speech_embedding.weight[k][None, None]], dim=1)
    seq = prompt + [t + vocab.speech_offset for t in ours]
    full = merged_logits(model, seq, bias).log_softmax(-1)[len(prompt) - 1 :]
    speech = full[:, vocab.speech_offset : vocab.speech_offset + n_speech]
    diff = max(float((speech[i] - ref_logp[i]).abs().max()) for i in range(len(ref_logp)))
    others = torch.cat([full[:, : vocab.speech_offset], full[:, vocab.speech_offset + n_speech :]], dim=1)
    converted: list[int] = []
    ids = list(prompt)
    for _ in range(steps):
        logits = merged_logits(model, ids, bias)[-1]
        i = int(logits.masked_fill(_eos_mask(logits, vocab.end_id, len(converted) < min_len), float("-inf")).argmax())
        if i in vocab.stop_ids:
            break
        converted.append(i - vocab.speech_offset)
        ids.append(i)
    return {"max_abs_logp_diff": diff, "greedy_equal": converted == ours, "tokens": ours,
            "converted_tokens": converted, "text_mass": float(others.exp().max())}


def _eos_mask(logits: torch.Tensor, eos: int, masked: bool) -> torch.Tensor:
    mask = torch.zeros_like(logits, dtype=torch.bool)
    mask[eos] = masked
    return mask


# ------------------------------------------------------------------------------------------- engine build


@dataclass(frozen=True)
class EngineOptions:
    """``trtllm-build`` settings. ``max_batch_size`` must cover the served ``max_active_requests``; the lengths
    cover a prompt (sos, prompt text + text, task id, up to 30 s of prompt speech = 750 tokens) and up to 20
    speech tokens per text token."""

    dtype: str = "bfloat16"
    max_batch_size: int = 8
    max_input_len: int = 1536
    max_seq_len: int = 4096
    max_num_tokens: int = 16384

    def __post_init__(self):
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError(f"engine dtype must be float16, bfloat16 or float32, got {self.dtype!r}")
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len <= self.max_input_len:
            raise ConfigError(f"max_seq_len {self.max_seq_len} leaves no room after max_input_len "
                              f"{self.max_input_len}")


def trtllm_build_command(checkpoint_dir: str | Path, engine_dir: str | Path, options: EngineOptions,
                         exe: str = "trtllm-build") -> list[str]:
    """The ``trtllm-build`` command line: paged KV cache and packed inputs (what in-flight batching needs), fp32
    logits (the dtype of the ``embedding_bias`` the backend adds to them)."""
    return [exe, "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
            "--max_batch_size", str(options.max_batch_size), "--max_input_len", str(options.max_input_len),
            "--max_seq_len", str(options.max_seq_len), "--max_num_tokens", str(options.max_num_tokens),
            "--max_beam_width", "1", "--gemm_plugin", options.dtype, "--gpt_attention_plugin", options.dtype,
            "--kv_cache_type", "paged", "--remove_input_padding", "enable", "--logits_dtype", "float32"]


def checkpoint_command(hf_dir: str | Path, checkpoint_dir: str | Path, options: EngineOptions) -> list[str]:
    """TensorRT-LLM's checkpoint conversion of the merged folder (run by :func:`convert_trtllm_checkpoint`)."""
    return [sys.executable, "-m", "cosyvoice_triton.export.trtllm", "checkpoint", "--hf-dir", str(hf_dir),
            "--out", str(checkpoint_dir), "--dtype", options.dtype]


def toolchain_missing() -> str | None:
    """Why an engine cannot be built here (None: TensorRT-LLM, ``trtllm-build`` and a CUDA GPU are present)."""
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None:
        return ("the tensorrt_llm Python package is not installed (it comes with the NGC image "
                "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3; README, 'TensorRT-LLM engine')")
    if shutil.which("trtllm-build") is None:
        return "trtllm-build is not on PATH (it comes with the tensorrt_llm package of the NGC -trtllm- image)"
    if not torch.cuda.is_available():
        return "no CUDA GPU: TensorRT-LLM builds an engine for the GPU it runs on"
    return None


def convert_trtllm_checkpoint(hf_dir: str | Path, checkpoint_dir: str | Path, dtype: str = "bfloat16") -> None:
    """TensorRT-LLM's ``QWenForCausalLM.from_hugging_face`` on the merged folder, saved as a TensorRT-LLM
    checkpoint (one rank, no tensor / pipeline parallelism): what its ``convert_checkpoint.py`` does for Qwen."""
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import QWenForCausalLM

    read_vocab(hf_dir)  # a merged folder, not any Qwen2
    model = QWenForCausalLM.from_hugging_face(str(hf_dir), dtype=dtype,
                                              mapping=Mapping(world_size=1, rank=0, tp_size=1, pp_size=1))
    model.save_checkpoint(str(checkpoint_dir), save_config=True)


def stage_serving_files(hf_dir: str | Path, engine_dir: str | Path) -> list[Path]:
    """Copy what serving needs besides the engine (vocabulary layout, embedding bias, tokenizer) into the engine
    folder, so that ``<engine_dir>`` alone is the served LM."""
    hf_dir, engine_dir = Path(hf_dir), Path(engine_dir)
    read_vocab(hf_dir)
    engine_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in SERVING_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, engine_dir / name)
            copied.append(engine_dir / name)
    return copied


@dataclass
class EngineBuild:
    status: str  # built | skipped | dry-run
    reason: str = ""
    commands: list[list[str]] = field(default_factory=list)


def build_llm_engine(hf_dir: str | Path, checkpoint_dir: str | Path, engine_dir: str | Path,
                     options: EngineOptions, *, dry_run: bool = False,
                     progress: Callable[[str], None] = log.info) -> EngineBuild:
    """TensorRT-LLM checkpoint + ``trtllm-build`` of a converted folder into ``engine_dir``, then
    :func:`stage_serving_files`. Where the toolchain is missing (:func:`toolchain_missing`) nothing runs and the
    result says why (``status="skipped"``); ``dry_run`` only lists the commands."""
    commands = [checkpoint_command(hf_dir, checkpoint_dir, options),
                trtllm_build_command(checkpoint_dir, engine_dir, options)]
    if dry_run:
        return EngineBuild("dry-run", "", commands)
    reason = toolchain_missing()
    if reason:
        return EngineBuild("skipped", reason, commands)
    read_vocab(hf_dir)
    for i, cmd in enumerate(commands, 1):
        progress(f"[engine {i}/2] {shlex.join(cmd)}")
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        progress(f"[engine {i}/2] done in {time.perf_counter() - t0:.0f} s")
    staged = stage_serving_files(hf_dir, engine_dir)
    progress(f"[engine] {engine_dir}: engine + {', '.join(p.name for p in staged)}")
    return EngineBuild("built", "", commands)


def check_engine_folder(engine_dir: str | Path, max_batch_size: int) -> MergedVocab:
    """The vocabulary of a served LM folder, checked against the engine's own ``config.json`` (written by
    ``trtllm-build``) where there is one: same vocabulary size, a batch at least ``max_batch_size``."""
    engine_dir = Path(engine_dir)
    vocab = read_vocab(engine_dir)
    bias = read_bias(engine_dir)
    if tuple(bias.shape) != (vocab.vocab_size,):
        raise CheckpointError(f"{engine_dir / BIAS_FILE}: shape {tuple(bias.shape)}, expected ({vocab.vocab_size},)")
    engine_cfg = engine_dir / "config.json"
    if engine_cfg.is_file():
        try:
            doc = json.loads(engine_cfg.read_text(encoding="utf-8"))
            built_vocab = int(doc["pretrained_config"]["vocab_size"])
            built_batch = int(doc["build_config"]["max_batch_size"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{engine_cfg}: not a TensorRT-LLM engine config ({exc})") from exc
        if built_vocab != vocab.vocab_size:
            raise CheckpointError(f"{engine_cfg}: engine vocabulary {built_vocab}, but {VOCAB_FILE} says "
                                  f"{vocab.vocab_size}: the engine was built from another conversion")
        if built_batch < max_batch_size:
            raise CheckpointError(f"{engine_cfg}: engine max_batch_size {built_batch} < {max_batch_size} served "
                                  "rows (max_active_requests): rebuild with a larger --max-batch-size")
    return vocab


def served_vocabulary(llm_dir: str | Path, max_batch_size: int) -> tuple[int | None, str]:
    """For the rendered ``tensorrt_llm`` config: the merged vocabulary size of the LM folder ``llm_dir`` (checked
    with :func:`check_engine_folder`) and a comment line for the config; ``(None, note)`` before any conversion."""
    llm_dir = Path(llm_dir)
    if not (llm_dir / VOCAB_FILE).is_file():
        return None, (f"# {llm_dir}/{VOCAB_FILE} not found yet: make engines-llm (export/convert_llm.py "
                      "--build-engine) writes the engine and its vocabulary there")
    v = check_engine_folder(llm_dir, max_batch_size)
    built = "engine config checked" if (llm_dir / "config.json").is_file() else "no engine built yet"
    return v.vocab_size, (f"# vocabulary ({VOCAB_FILE}, {built}): {v.vocab_size} ids = text {v.text_vocab_size} + "
                          f"speech {v.speech_token_size} from id {v.speech_offset} + stops {list(v.stop_ids)} + sos "
                          f"{v.sos_id} + task id {v.task_id} (+ padding); end_id / pad_id {v.end_id}; send "
                          f"{BIAS_FILE} as embedding_bias and ids {list(v.stop_ids[1:])} as stop_words_list")


def main(argv: list[str] | None = None) -> int:
    """``checkpoint``: TensorRT-LLM's checkpoint of a merged folder (the first engine command). ``engine``: both
    engine commands and the serving files, for the stock NGC ``-trtllm-python-py3`` image, which has torch, numpy
    and TensorRT-LLM but not this package's other dependencies: ``PYTHONPATH=<this checkout> python3 -m
    cosyvoice_triton.export.trtllm engine --hf-dir build/llm_hf`` (the merged folder comes from
    export/convert_llm.py, run anywhere)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.export.trtllm", description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    ck = sub.add_parser("checkpoint", help="TensorRT-LLM checkpoint of a merged folder")
    ck.add_argument("--hf-dir", type=Path, required=True)
    ck.add_argument("--out", type=Path, required=True)
    ck.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="bfloat16")
    en = sub.add_parser("engine", help="checkpoint + trtllm-build + serving files")
    en.add_argument("--hf-dir", type=Path, required=True)
    en.add_argument("--checkpoint-dir", type=Path, default=Path("build/trtllm_checkpoint"))
    en.add_argument("--engine-dir", type=Path, default=Path("build/engines/llm"))
    defaults = EngineOptions()
    for name in ("dtype", "max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        value = getattr(defaults, name)
        en.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.command == "checkpoint":
        convert_trtllm_checkpoint(args.hf_dir, args.out, args.dtype)
        return 0
    try:
        options = EngineOptions(args.dtype, args.max_batch_size, args.max_input_len, args.max_seq_len,
                                args.max_num_tokens)
    except ConfigError as exc:
        p.error(str(exc))
    result = build_llm_engine(args.hf_dir, args.checkpoint_dir, args.engine_dir, options)
    if result.status == "skipped":
        print(f"error: engine not built: {result.reason}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
