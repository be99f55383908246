"""The CosyVoice2 speech-token LM (``Qwen2LM``): text tokens to speech tokens, checkpoint-compatible.

Module names equal the official ``cosyvoice.llm.llm.Qwen2LM`` so that ``state_dict()`` keys are those of
``llm.pt``: ``llm_embedding`` (sos and task-id rows), ``llm.model`` (a transformers ``Qwen2ForCausalLM`` built
from ``CosyVoice-BlankEN/config.json``), ``llm_decoder`` (hidden to ``speech_token_size + 3`` logits) and
``speech_embedding``. With tied word embeddings the file still holds ``llm.model.lm_head.weight`` (PyTorch's
``state_dict`` lists a shared parameter under each of its names).

Decoding follows the official ``Qwen2LM.inference``:

- input: ``[sos, embed_tokens(prompt_text + text), task_id, speech_embedding(prompt_speech)]``;
- ``min_len`` / ``max_len``: ``int(len(text) * ratio)`` (the prompt text does not count), computed in
  float32 as the official code does on its int32 length tensor;
- step ``i`` samples with the end-of-speech id masked while ``i < min_len``, then stops on any of the three
  stop ids ``speech_token_size + {0, 1, 2}`` (not yielded), or silently after ``max_len`` tokens
  (:attr:`LMStream.hit_max_len` tells which);
- the next input is the sampled token's ``speech_embedding`` row; a KV cache keeps the prompt.

Attention follows the official code as run under its pinned transformers (4.51): causal over the whole
cache. (The official ``forward_one_step`` passes a one-column attention mask on decode steps; transformers
>= 4.53 reads it as "attend to position 0 only", so the official code must not be run with a newer
transformers when it serves as a reference.)

Batched decoding (:class:`BatchDecoder`) keeps one KV cache whose rows are left-padded to a common length,
with a key mask and per-row position ids; requests join (prefilled one at a time) and leave between steps.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

try:
    from transformers.initialization import no_init_weights  # transformers >= 5
except ImportError:
    from transformers.modeling_utils import no_init_weights

from ..config import LLMConfig, ModelConfig, SamplingConfig
from ..errors import CheckpointError, ConfigError, LLMError
from .checkpoint import load_into, read_state_dict
from .sampling import DrawSource, check_sampling, make_draw, sample_token

log = logging.getLogger(__name__)

QWEN_DIR = "CosyVoice-BlankEN"
TINY_TEXT_VOCAB = 4096
END = -1  # BatchDecoder.step value of a request that has finished

# The Qwen2.5-0.5B config.json that CosyVoice2-0.5B ships in CosyVoice-BlankEN/ (its layout and values).
_QWEN_FULL: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_QWEN_TINY = {
    **_QWEN_FULL,
    "bos_token_id": None,
    "eos_token_id": None,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "torch_dtype": "float32",
    "vocab_size": TINY_TEXT_VOCAB,
}


def write_qwen_config(out_dir: str | Path, size: str = "tiny", *, vocab_size: int | None = None) -> Path:
    """Write ``config.json`` of a Qwen2 model in the official ``CosyVoice-BlankEN`` layout; returns its path.

    ``size="full"``: Qwen2.5-0.5B (hidden 896, 24 layers, vocabulary 151936). ``size="tiny"``: hidden 64,
    2 layers, 4 query / 2 key-value heads, FFN 128, vocabulary :data:`TINY_TEXT_VOCAB`. ``vocab_size``: another
    text vocabulary (e.g. Qwen2.5's 151936 at tiny dims, for an LM that needs the official special ids).
    """
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    config = _QWEN_FULL if size == "full" else _QWEN_TINY
    if vocab_size is not None:
        config = {**config, "vocab_size": int(vocab_size)}
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def read_qwen_config(path: str | Path) -> Qwen2Config:
    """The Qwen2 config of ``CosyVoice-BlankEN/config.json``, with errors that name the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (a CosyVoice2 model folder has {QWEN_DIR}/config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a JSON file ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("model_type") != "qwen2":
        kind = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(f"{path}: not a Qwen2 config (model_type {kind!r}, expected 'qwen2')")
    try:
        config = Qwen2Config.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: invalid Qwen2 config ({exc})") from exc
    config._attn_implementation = "sdpa"
    return config


class Qwen2Encoder(nn.Module):
    """The official wrapper's structure (``llm.model`` is the ``Qwen2ForCausalLM``)."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.model = Qwen2ForCausalLM(config)


#: The official LM's least and most speech tokens per text token (``min_token_text_ratio`` / ``max_...``).
MIN_TOKEN_TEXT_RATIO, MAX_TOKEN_TEXT_RATIO = 2.0, 20.0


@dataclass
class LMRequest:
    """One text to decode. Token sequences: lists, 1-D (or ``[1, N]``) integer tensors or arrays.

    ``draws``: the uniform draws of this request's sampling (see :func:`.sampling.make_draw`). Give each
    request its own source (a seed, a generator): with ``None`` requests share PyTorch's global generator, and
    their tokens then depend on what else is decoded.
    ``on_step(step, logp)``: called with each step's log-probabilities ``[speech_token_size + 3]`` (before
    masking), e.g. for parity checks.
    """

    text_tokens: Any
    prompt_text_tokens: Any = ()
    prompt_speech_tokens: Any = ()
    draws: DrawSource = None
    min_token_text_ratio: float = MIN_TOKEN_TEXT_RATIO
    max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO
    on_step: Callable[[int, torch.Tensor], None] | None = None
    prefix: LMPrefix | None = None


@dataclass(frozen=True)
class LMPrefix:
    """The KV cache of the first positions of an LM input that only the prompt decides: sos and the prompt
    text tokens (the text to speak follows them; the task id and the prompt speech tokens come after the
    text, so no later position can be shared). Made by :meth:`Qwen2LM.prefix`; a request whose
    ``prompt_text_tokens`` are these tokens (``LMRequest.prefix``) prefills only the positions after it.
    ``nbytes``: memory of the keys and values."""

    prompt_text_tokens: tuple[int, ...]
    cache: Any  # transformers DynamicCache [1, kv_heads, length, head_dim] per layer, never extended in place
    length: int
    nbytes: int

    def extendable(self) -> Any:
        """A cache to continue from: a copy of the layer list (the tensors are shared; transformers extends a
        layer by concatenation, which leaves these tensors as they are)."""
        cache = copy.copy(self.cache)
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        return cache


MODES = ("zero_shot", "cross_lingual", "instruct")


def mode_request(
    mode: str,
    text_tokens: Any,
    *,
    prompt_text_tokens: Any = (),
    prompt_speech_tokens: Any = (),
    instruct_tokens: Any = (),
    **options: Any,
) -> LMRequest:
    """The LM's part of an official CosyVoice2 inference mode (``options``: the other :class:`LMRequest` fields).

    - ``zero_shot`` (``inference_zero_shot``; also a registered speaker, whose stored prompt tokens are
      passed here): prompt text and prompt speech tokens both condition the LM. Prompt audio is required;
      the prompt text may be empty.
    - ``cross_lingual``: the LM gets neither prompt (the official front end deletes both; the prompt audio
      only conditions the flow), so ``prompt_text_tokens`` must be empty.
    - ``instruct`` (``inference_instruct2``): the instruction's tokens take the prompt text's place and the
      prompt speech tokens are left out of the LM input. The official front end adds nothing to the
      instruction; its examples end it with ``<|endofprompt|>``.
    """
    def present(tokens: Any) -> bool:
        return len(tokens) > 0 if not isinstance(tokens, torch.Tensor) else tokens.numel() > 0

    if mode == "zero_shot":
        if not present(prompt_speech_tokens):
            raise LLMError("zero_shot needs prompt speech tokens (prompt text without prompt audio)")
        return LMRequest(text_tokens, prompt_text_tokens, prompt_speech_tokens, **options)
    if mode == "cross_lingual":
        if present(prompt_text_tokens):
            raise LLMError("cross_lingual takes no prompt text (use zero_shot to condition on it)")
        return LMRequest(text_tokens, (), (), **options)
    if mode == "instruct":
        if not present(instruct_tokens):
            raise LLMError("instruct needs the instruction's tokens")
        if present(prompt_text_tokens):
            raise LLMError("instruct takes no prompt text: the instruction takes its place")
        return LMRequest(text_tokens, instruct_tokens, (), **options)
    raise LLMError(f"mode must be one of {MODES}, got {mode!r}")


@dataclass
class _Row:
    id: Hashable
    draw: Callable[[], float]
    min_len: int
    max_len: int
    on_step: Callable[[int, torch.Tensor], None] | None
    prompt: torch.Tensor | None  # [1, T, D] until prefilled
    prefix: LMPrefix | None = None
    length: int = 0  # positions held in the KV cache
    tokens: list[int] = field(default_factory=list)
    hit_max_len: bool = False
    done: bool = False


class Qwen2LM(nn.Module):
    """The CosyVoice2 LM. Build with :meth:`from_config` or :func:`load_llm`; decode with :meth:`generate`,
    :meth:`generate_batch` or a :class:`BatchDecoder`."""

    sos = 0
    task_id = 1

    def __init__(self, llm_config: LLMConfig, qwen_config: Qwen2Config):
        super().__init__()
        hidden = qwen_config.hidden_size
        if (llm_config.llm_input_size, llm_config.llm_output_size) != (hidden, hidden):
            raise ConfigError(
                f"llm_input_size / llm_output_size ({llm_config.llm_input_size}, {llm_config.llm_output_size}) in "
                f"cosyvoice2.yaml disagree with the Qwen2 hidden_size {hidden} of {QWEN_DIR}/config.json"
            )
        check_sampling(llm_config.sampling)
        self.config = llm_config
        self.speech_token_size = llm_config.speech_token_size
        self.eos_token = self.speech_token_size
        self.fill_token = self.speech_token_size + 2  # live (bistream) decoding: a group of speech tokens ends
        self.stop_token_ids = tuple(self.speech_token_size + i for i in range(3))
        self.llm_embedding = nn.Embedding(2, llm_config.llm_input_size)
        self.llm = Qwen2Encoder(qwen_config)
        self.llm_decoder = nn.Linear(llm_config.llm_output_size, self.speech_token_size + 3)
        self.speech_embedding = nn.Embedding(self.speech_token_size + 3, llm_config.llm_input_size)

    @classmethod
    def from_config(cls, llm_config: LLMConfig, qwen_config_path: str | Path, *, init: bool = True) -> Qwen2LM:
        """Build from the yaml's llm section and a Qwen2 ``config.json`` (``init=False``: leave the tensors
        uninitialised, for loading a checkpoint over them)."""
        qwen_config = read_qwen_config(qwen_config_path)
        if init:
            return cls(llm_config, qwen_config)
        with no_init_weights():
            lm = cls(llm_config, qwen_config)
        lm.llm.model.tie_weights()  # skipped with the initialisation; a tied lm_head shares embed_tokens
        return lm

    @property
    def qwen(self) -> nn.Module:
        """The bare ``Qwen2Model`` (the LM head is never needed: ``llm_decoder`` reads the hidden states)."""
        return self.llm.model.model

    @property
    def text_vocab_size(self) -> int:
        return self.qwen.embed_tokens.num_embeddings

    @property
    def max_positions(self) -> int:
        return int(self.llm.model.config.max_position_embeddings)

    # ------------------------------------------------------------------------------------------ inputs

    def _tokens(self, tokens: Any, name: str, limit: int, *, allow_empty: bool) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):
            t = tokens.detach().cpu()
        else:
            try:
                t = torch.as_tensor(np.array(tokens))  # a copy: read-only arrays (a registered speaker's) too
            except (TypeError, ValueError) as exc:
                raise LLMError(f"{name}: not a sequence of token ids ({exc})") from exc
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1:
            raise LLMError(f"{name}: expected a 1-D sequence of token ids, got shape {tuple(t.shape)}")
        if t.numel() == 0:
            if not allow_empty:
                raise LLMError(f"{name}: empty (nothing to synthesise)")
            return t.to(torch.long)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise LLMError(f"{name}: token ids must be integers, got {t.dtype}")
        t = t.to(torch.long)
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise LLMError(f"{name}: token id {bad} is outside [0, {limit})")
        return t

    def check_inputs(
        self, text_tokens: Any, prompt_text_tokens: Any = (), prompt_speech_tokens: Any = ()
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three token sequences as 1-D int64 CPU tensors, checked against the vocabularies."""
        return (
            self._tokens(text_tokens, "text_tokens", self.text_vocab_size, allow_empty=False),
            self._tokens(prompt_text_tokens, "prompt_text_tokens", self.text_vocab_size, allow_empty=True),
            self._tokens(prompt_speech_tokens, "prompt_speech_tokens", self.speech_token_size, allow_empty=True),
        )

    def special_embedding(self, token: int) -> torch.Tensor:
        """The input row ``[1, D]`` of a special token (``sos``, ``task_id``): a row of ``llm_embedding`` here
        (CosyVoice3's LM keeps them in ``speech_embedding``)."""
        return self.llm_embedding.weight[token : token + 1]

    @property
    def min_len_masked_token(self) -> int:
        """The id masked while fewer than ``min_len`` tokens are sampled: the official ``sampling_ids`` masks
        ``speech_token_size``, which is end-of-speech here."""
        return self.speech_token_size

    def live_prompt(self, prompt_text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Live (bistream) decoding's split of the prompt text tokens: (what goes in right after sos, what starts
        the text cache that is mixed with the prompt speech tokens). CosyVoice2: nothing, all of it."""
        return prompt_text[:0], prompt_text

    def lm_input(self, text_tokens: Any, prompt_text_tokens: Any = (), prompt_speech_tokens: Any = ()) -> torch.Tensor:
        """The prompt embedding ``[1, T, D]``: sos, text (prompt text first), task id, prompt speech."""
        text, prompt_text, speech = self.check_inputs(text_tokens, prompt_text_tokens, prompt_speech_tokens)
        device = self.llm_decoder.weight.device
        with torch.inference_mode():
            parts = [
                self.special_embedding(self.sos),
                self.qwen.embed_tokens(torch.cat([prompt_text, text]).to(device)),
                self.special_embedding(self.task_id),
                self.speech_embedding(speech.to(device)),
            ]
            return torch.cat(parts)[None]

    @torch.inference_mode()
    def prefix(self, prompt_text_tokens: Any = ()) -> LMPrefix:
        """The KV cache of sos and ``prompt_text_tokens`` (see :class:`LMPrefix`), to share between requests
        with this prompt text (a registered speaker's transcript, an instruction)."""
        prompt_text = self._tokens(prompt_text_tokens, "prompt_text_tokens", self.text_vocab_size, allow_empty=True)
        device = self.llm_decoder.weight.device
        embeds = torch.cat([self.special_embedding(self.sos),
                            self.qwen.embed_tokens(prompt_text.to(device))])[None]
        cache = self.qwen(inputs_embeds=embeds, use_cache=True).past_key_values
        nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return LMPrefix(tuple(int(t) for t in prompt_text), cache, embeds.shape[1], nbytes)

    @staticmethod
    def length_bounds(text_len: int, min_token_text_ratio: float, max_token_text_ratio: float) -> tuple[int, int]:
        """``(min_len, max_len)`` as the official code computes them (an int32 length times a float, in
        float32, truncated)."""
        for name, r in (("min_token_text_ratio", min_token_text_ratio), ("max_token_text_ratio", max_token_text_ratio)):
            if not (math.isfinite(r) and r >= 0):
                raise LLMError(f"{name} must be finite and >= 0, got {r}")
        n = torch.tensor([text_len], dtype=torch.int32)
        return int(n * min_token_text_ratio), int(n * max_token_text_ratio)

    # ----------------------------------------------------------------------------------------- decoding

    def batch_decoder(self, sampling: SamplingConfig | None = None) -> BatchDecoder:
        return BatchDecoder(self, sampling=sampling)

    def generate(
        self,
        text_tokens: Any,
        prompt_text_tokens: Any = (),
        prompt_speech_tokens: Any = (),
        *,
        sampling: SamplingConfig | None = None,
        draws: DrawSource = None,
        min_token_text_ratio: float = MIN_TOKEN_TEXT_RATIO,
        max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO,
        on_step: Callable[[int, torch.Tensor], None] | None = None,
        prefix: LMPrefix | None = None,
    ) -> LMStream:
        """Speech tokens of one text, yielded as they are sampled (an :class:`LMStream`).

        Inputs are checked before this returns (:class:`~cosyvoice_triton.errors.LLMError`); decoding runs as
        the stream is consumed. ``sampling``: defaults to the yaml's. ``draws``: see
        :func:`.sampling.make_draw` (``None``: PyTorch's global generator). ``prefix``: the shared KV cache of
        sos and ``prompt_text_tokens`` (:meth:`prefix`).
        """
        decoder = self.batch_decoder(sampling)
        request = LMRequest(text_tokens, prompt_text_tokens, prompt_speech_tokens, draws=draws, on_step=on_step,
                            min_token_text_ratio=min_token_text_ratio, max_token_text_ratio=max_token_text_ratio,
                            prefix=prefix)
        return LMStream(decoder, decoder.add(request))

    def generate_batch(self, requests: Sequence[LMRequest], *, sampling: SamplingConfig | None = None,
                       max_batch: int | None = None) -> list[list[int]]:
        """Decode several requests together (at most ``max_batch`` at a time; the next joins as one leaves);
        the tokens of each equal those of :meth:`generate` with the same draws."""
        decoder = self.batch_decoder(sampling)
        queue = list(enumerate(requests))
        queue.reverse()
        limit = max_batch or len(queue)
        out: list[list[int]] = [[] for _ in requests]
        while queue or len(decoder):
            while queue and len(decoder) < limit:
                i, request = queue.pop()
                decoder.add(request, request_id=i)
            for i, token in decoder.step().items():
                if token != END:
                    out[i].append(token)
        return out


class LMStream(Iterator[int]):
    """An iterator over one request's speech tokens; after it ends, :attr:`hit_max_len` says whether it stopped
    at ``max_len`` (no end-of-speech)."""

    def __init__(self, decoder: BatchDecoder, request_id: Hashable):
        self._decoder = decoder
        self._id = request_id
        self._row = decoder.row(request_id)

    def __next__(self) -> int:
        if self._row.done and self._id not in self._decoder:  # END already reported
            raise StopIteration
        token = self._decoder.step()[self._id]
        if token == END:
            raise StopIteration
        return token

    @property
    def tokens(self) -> list[int]:
        return self._row.tokens

    @property
    def hit_max_len(self) -> bool:
        return self._row.hit_max_len

    @property
    def min_len(self) -> int:
        return self._row.min_len

    @property
    def max_len(self) -> int:
        return self._row.max_len


class BatchDecoder:
    """In-flight batched decoding: :meth:`add` requests at any time, :meth:`step` them together, :meth:`remove`
    one to cancel it.

    Each :meth:`step` prefills the requests added since the last step (one at a time), runs one batched
    decode step for the others, and samples one token per request: it returns ``{id: token}``, with
    :data:`END` once for a request that has finished (after its last token; a request stopped by
    ``max_len`` reports END on the following step without computing), after which its id is free again.
    """

    def __init__(self, lm: Qwen2LM, *, sampling: SamplingConfig | None = None):
        self.lm = lm
        self.sampling = sampling or lm.config.sampling
        check_sampling(self.sampling)
        self._rows: dict[Hashable, _Row] = {}
        self._active: list[_Row] = []  # rows in the KV cache, in batch order
        self._new: list[_Row] = []  # added, not yet prefilled
        self._ending: list[_Row] = []  # reached max_len: END on the next step
        self._cache: Any = None  # transformers DynamicCache of the active rows
        self._valid: torch.Tensor | None = None  # [B, L] bool: which cache columns hold a row's positions
        self._next: torch.Tensor | None = None  # [B, 1, D] the active rows' next inputs
        self._counter = 0

    def __len__(self) -> int:
        """Requests that have not reported END yet."""
        return len(self._active) + len(self._new) + len(self._ending)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._rows

    def row(self, request_id: Hashable) -> _Row:
        """A request's state (``tokens``, ``hit_max_len``, ``min_len``, ``max_len``); forgotten here once it
        has reported END, so keep the object if it is needed after that."""
        try:
            return self._rows[request_id]
        except KeyError:
            raise LLMError(f"no request {request_id!r} in this decoder") from None

    def add(self, request: LMRequest, request_id: Hashable | None = None) -> Hashable:
        """Queue a request (checked now, prefilled on the next :meth:`step`); returns its id."""
        if request_id is None:
            while self._counter in self._rows:
                self._counter += 1
            request_id = self._counter
        if request_id in self._rows:
            raise LLMError(f"request id {request_id!r} is already in this decoder")
        tokens = self.lm.check_inputs(request.text_tokens, request.prompt_text_tokens, request.prompt_speech_tokens)
        min_len, max_len = Qwen2LM.length_bounds(len(tokens[0]), request.min_token_text_ratio,
                                                 request.max_token_text_ratio)
        prompt = self.lm.lm_input(*tokens)
        if prompt.shape[1] + max_len > self.lm.max_positions:
            raise LLMError(
                f"prompt of {prompt.shape[1]} positions plus up to {max_len} speech tokens exceeds the model's "
                f"{self.lm.max_positions} positions; split the text"
            )
        if request.prefix is not None and request.prefix.prompt_text_tokens != tuple(tokens[1].tolist()):
            raise LLMError("the request's LMPrefix was made for other prompt text tokens")
        row = _Row(request_id, make_draw(request.draws), min_len, max_len, request.on_step, prompt, request.prefix)
        self._rows[request_id] = row
        if max_len == 0:  # the official loop runs no step at all
            row.hit_max_len = row.done = True
            self._ending.append(row)
        else:
            self._new.append(row)
        return request_id

    def remove(self, request_id: Hashable) -> None:
        """Cancel a request that has not reported END; its cache rows are freed."""
        row = self._rows.pop(request_id, None)
        if row is None:
            raise LLMError(f"no request {request_id!r} in this decoder")
        row.done = True
        if row in self._new:
            self._new.remove(row)
        if row in self._ending:
            self._ending.remove(row)
        if row in self._active:
            self._drop([row])

    @torch.inference_mode()
    def step(self) -> dict[Hashable, int]:
        out: dict[Hashable, int] = {}
        for row in self._ending:
            out[row.id] = END
            del self._rows[row.id]
        self._ending = []
        if not self._active and not self._new:
            return out
        hidden = []
        if self._active:
            hidden.append(self._decode())
        for row in self._new:
            hidden.append(self._prefill(row))
        self._active.extend(self._new)
        self._new = []
        logp = self.lm.llm_decoder(torch.cat(hidden)).log_softmax(dim=-1).float().cpu()
        finished: list[Hashable] = []
        next_tokens: list[int] = []
        for i, row in enumerate(self._active):
            step = len(row.tokens)
            if row.on_step is not None:
                row.on_step(step, logp[i].clone())
            token = sample_token(logp[i], row.tokens, row.draw, self.sampling, eos_token=self.lm.min_len_masked_token,
                                 ignore_eos=step < row.min_len)
            if token in self.lm.stop_token_ids:
                out[row.id] = END
                row.done = True
                del self._rows[row.id]
                finished.append(row)
                continue
            row.tokens.append(token)
            out[row.id] = token
            if len(row.tokens) >= row.max_len:
                row.hit_max_len = row.done = True
                finished.append(row)
                self._ending.append(row)
            else:
                next_tokens.append(token)
        self._next = None
        if finished:
            self._drop(finished)
        if self._active:
            ids = torch.tensor(next_tokens, device=self.lm.speech_embedding.weight.device)
            self._next = self.lm.speech_embedding.weight[ids][:, None]
        return out

    # ----------------------------------------------------------------------------------- cache handling

    def _prefill(self, row: _Row) -> torch.Tensor:
        if row.prefix is None:
            out = self.lm.qwen(inputs_embeds=row.prompt, use_cache=True)
        else:  # the positions after the shared prefix, on a copy of its cache
            start = row.prefix.length
            positions = torch.arange(start, row.prompt.shape[1], device=self._device)[None]
            out = self.lm.qwen(inputs_embeds=row.prompt[:, start:], position_ids=positions,
                               past_key_values=row.prefix.extendable(), use_cache=True)
        row.length = row.prompt.shape[1]
        row.prompt = row.prefix = None
        cache = out.past_key_values
        valid = torch.ones(1, row.length, dtype=torch.bool, device=self._device)
        if self._cache is None:
            self._cache, self._valid = cache, valid
        else:
            width = max(self._valid.shape[1], row.length)
            for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
                mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
            self._valid = torch.cat([_left_pad(self._valid, width), _left_pad(valid, width)])
        return out.last_hidden_state[:, -1]

    def _decode(self) -> torch.Tensor:
        batch = len(self._active)
        positions = torch.tensor([[row.length] for row in self._active], device=self._device)
        self._valid = torch.cat([self._valid, torch.ones(batch, 1, dtype=torch.bool, device=self._device)], dim=1)
        mask = None if bool(self._valid.all()) else self._valid[:, None, None, :]
        out = self.lm.qwen(inputs_embeds=self._next, attention_mask=mask, position_ids=positions,
                           past_key_values=self._cache, use_cache=True)
        for row in self._active:
            row.length += 1
        return out.last_hidden_state[:, -1]

    def _drop(self, rows: list[_Row]) -> None:
        keep = [i for i, row in enumerate(self._active) if row not in rows]
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache = self._valid = self._next = None
            return
        index = torch.tensor(keep, device=self._device)
        valid = self._valid[index]
        start = int(valid.any(dim=0).to(torch.int8).argmax())  # leading columns that only pad
        self._valid = valid[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        if self._next is not None:
            self._next = self._next[index]

    @property
    def _device(self) -> torch.device:
        return self.lm.llm_decoder.weight.device


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad dim 1 (mask ``[B, L]``) or dim 2 (cache ``[B, H, L, d]``) on the left to ``width``."""
    dim = 1 if x.dim() == 2 else 2
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


# ------------------------------------------------------------------------------------------- loading


def load_llm(model_dir: str | Path, config: ModelConfig, device: str | torch.device = "cpu", *,
             precision: str = "fp32", threads: int | None = None) -> Qwen2LM:
    """``llm.pt`` of a CosyVoice2 model folder, read safely and strictly, on ``device`` in eval mode;
    ``precision``: ``fp32``, ``int8`` or ``fp32-ort`` (:func:`.lm_quant.quantize_lm`; ``threads``: fp32-ort's
    onnxruntime threads per layer, None: torch's)."""
    from .lm_quant import LM_PRECISIONS, quantize_lm

    if precision not in LM_PRECISIONS:
        raise ConfigError(f"lm_precision must be one of {', '.join(LM_PRECISIONS)}, got {precision!r}")
    model_dir = Path(model_dir)
    if config.llm is None:
        raise ConfigError(f"{model_dir}/cosyvoice2.yaml has no llm section (is this a CosyVoice2 folder?)")
    qwen_path = model_dir / QWEN_DIR / "config.json"
    llm_path = model_dir / "llm.pt"
    model = Qwen2LM.from_config(config.llm, qwen_path, init=False)
    if not llm_path.is_file():
        raise CheckpointError(f"{llm_path}: file not found (a CosyVoice2 model folder has llm.pt)")
    load_into(model, read_state_dict(llm_path), llm_path)
    return quantize_lm(model.to(device).eval(), precision, threads=threads)
