"""Live decoding of the CosyVoice2 and CosyVoice3 LMs: text tokens arrive while speech tokens are produced (official
``Qwen2LM.inference_bistream``, which serves both).

The text is an iterable of token chunks (one id, or several). Text and speech are interleaved by the yaml's
``mix_ratio`` ``(n_text, n_speech)`` = (5, 15):

- the input starts with ``sos``; CosyVoice3's prompt text up to and including ``<|endofprompt|>`` follows it at
  once (``live_prompt`` of the LM); the rest of the prompt text (all of it for CosyVoice2) starts the text cache;
- while prompt speech tokens remain, each block of 5 cached text tokens goes in followed by the next 15
  prompt speech tokens (the last block may hold fewer);
- once they are used up, 5 text tokens go in (only when nothing but ``sos`` is in yet) and speech tokens are
  sampled (the official ``ignore_eos`` mask on id ``speech_token_size``: end-of-speech in CosyVoice2, ``sos`` in
  CosyVoice3) until the *fill token* (``speech_token_size + 2``; CosyVoice3: ``+ 3``); it is forced when the
  count of decoded tokens (fill tokens included) reaches the next fill index, first ``(P // 15 + 1) * 15 - P``
  for ``P`` prompt speech tokens, then 16 after each fill, so that every group holds 15 speech tokens. After a
  fill, the next 5 text tokens replace the input (the fill itself is never fed);
- when the text ends, the rest of the text cache and ``task_id`` follow the last input, and tokens are sampled
  until end-of-speech.

Fill tokens are not yielded, but they stay in the decoded history that the repetition-aware sampling looks at,
as in the official code. Draws follow :mod:`.sampling` (a forced fill consumes none), so with the same injected
draws the tokens are those of the official code (tests/fixtures/llm_oracle and cv3_llm_oracle,
``bistream_*.npz``).

Where the official code returns normally this returns the same tokens, its quirks included: prompt speech
tokens still unused when the text ends are dropped; after a fill, the input that produced it (already in the KV
cache) is fed once more at the end of the text; the final phase samples with no length limit; with a prompt
(CosyVoice3's system prompt, or prompt speech tokens) the first tokens are sampled before any text of the stream
is in. Where it raises or could run without end, this stops instead, with :attr:`LiveDecode.stop_reason`:

- ``"eos"``: end-of-speech (the official normal end);
- ``"unexpected_token"``: a stop id other than the expected one was sampled (any stop id but the fill token
  while text is read, which the official code does not mask: ``speech_token_size + 1`` in CosyVoice2, end-of-speech
  and the 196 other stop ids in CosyVoice3; any but end-of-speech after the text): the official code raises
  ``ValueError``. The token is not yielded (:attr:`LiveDecode.stop_token` holds it);
- ``"max_len"``: the final phase has produced ``int(text_tokens * max_token_text_ratio)`` speech tokens in all
  (the official ``inference`` bound; ``inference_bistream`` has none), or any phase ``max_tokens`` (the room of
  what consumes them: the flow takes a bounded number with the prompt's);
- ``"max_positions"``: the next input would not fit in the model's positions;
- ``"cancelled"``: ``cancelled()`` turned true (checked before every model call).

An empty chunk runs the mixing step as in the official loop: after a fill token, a backlog of 5 cached text tokens
(left by a chunk of many tokens) is released and the next 15 speech tokens are decoded, so the same tokens come out
at the same pieces as in the official code. A text that ends without a single token raises
:class:`~..errors.LLMError`; so does a CosyVoice3 prompt text without ``<|endofprompt|>`` (the official code
asserts). Decoding runs on its own KV cache, one request at a time (not in :class:`.llm.BatchDecoder`'s batch).

Attention is causal over the whole cache, the semantics of the official code under its transformers 4.51.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..config import SamplingConfig
from ..errors import LLMError
from .sampling import DrawSource, check_sampling, make_draw, sample_token

log = logging.getLogger(__name__)

STOP_REASONS = ("eos", "unexpected_token", "max_len", "max_positions", "cancelled")


class LiveDecode(Iterator[int]):
    """Speech tokens of a live text, sampled as they are consumed. After the iteration ends:
    :attr:`stop_reason` (one of :data:`STOP_REASONS`), :attr:`stop_token` (the stop id sampled, or -1),
    :attr:`tokens` (the yielded speech tokens), :attr:`decoded` (with the fill tokens), :attr:`text_tokens`
    (how many text tokens were read, prompt text excluded)."""

    def __init__(self, lm, text_chunks: Iterable[Any], prompt_text_tokens: Any = (), prompt_speech_tokens: Any = (),
                 *, draws: DrawSource = None, sampling: SamplingConfig | None = None,
                 max_token_text_ratio: float = 20, max_tokens: int | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 on_step: Callable[[int, torch.Tensor], None] | None = None):
        self.lm = lm
        if max_tokens is not None and max_tokens < 1:
            raise LLMError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.sampling = sampling or lm.config.sampling
        check_sampling(self.sampling)
        n_text, n_speech = (int(x) for x in lm.config.mix_ratio)
        if n_text < 1 or n_speech < 1:
            raise LLMError(f"mix_ratio must be two positive counts, got {lm.config.mix_ratio}")
        self.mix = (n_text, n_speech)
        prompt_text = lm._tokens(prompt_text_tokens, "prompt_text_tokens", lm.text_vocab_size, allow_empty=True)
        head, prompt_text = lm.live_prompt(prompt_text)
        _, _, prompt_speech = lm.check_inputs((0,), torch.cat([head, prompt_text]), prompt_speech_tokens)
        lm.length_bounds(1, 0, max_token_text_ratio)  # checks the ratio
        self.max_token_text_ratio = max_token_text_ratio
        self.fill_token = int(lm.fill_token)
        self.draw = make_draw(draws)
        self.cancelled = cancelled or (lambda: False)
        self.on_step = on_step
        self.tokens: list[int] = []
        self.decoded: list[int] = []
        self.text_tokens = 0
        self.stop_reason: str | None = None
        self.stop_token = -1
        self._gen = self._run(iter(text_chunks), head, prompt_text, prompt_speech)

    def __next__(self) -> int:
        return next(self._gen)

    def close(self) -> None:
        """Stop early (the generator's KV cache is freed)."""
        self._gen.close()

    # ------------------------------------------------------------------------------------------------ inside

    def _chunk(self, chunk: Any) -> torch.Tensor:
        if isinstance(chunk, int) and not isinstance(chunk, bool):
            chunk = (chunk,)
        return self.lm._tokens(chunk, "text chunk", self.lm.text_vocab_size, allow_empty=True)

    @torch.inference_mode()
    def _run(self, chunks: Iterator[Any], head: torch.Tensor, prompt_text: torch.Tensor, prompt_speech: torch.Tensor
             ) -> Iterator[int]:
        lm, (n_text, n_speech) = self.lm, self.mix
        dev = lm.llm_decoder.weight.device
        embed_text = lm.qwen.embed_tokens
        task = lm.special_embedding(lm.task_id)[None]
        speech_left = lm.speech_embedding(prompt_speech.to(dev))[None]
        text_cache = embed_text(prompt_text.to(dev))[None]
        lm_input = torch.cat([lm.special_embedding(lm.sos)[None], embed_text(head.to(dev))[None]], dim=1)
        self._cache, self._length = None, 0
        n_prompt = prompt_speech.numel()
        next_fill = (int(n_prompt / n_speech) + 1) * n_speech - n_prompt
        for raw in chunks:
            chunk = self._chunk(raw)
            self.text_tokens += chunk.numel()
            text_cache = torch.cat([text_cache, embed_text(chunk.to(dev))[None]], dim=1)
            while speech_left.shape[1] and text_cache.shape[1] >= n_text:
                lm_input = torch.cat([lm_input, text_cache[:, :n_text], speech_left[:, :n_speech]], dim=1)
                text_cache, speech_left = text_cache[:, n_text:], speech_left[:, n_speech:]
            if speech_left.shape[1]:
                continue
            after_fill = bool(self.decoded) and self.decoded[-1] == self.fill_token
            if after_fill or (not self.decoded and lm_input.shape[1] == 1):
                if text_cache.shape[1] < n_text:
                    continue
                block = text_cache[:, :n_text]
                lm_input = block if after_fill else torch.cat([lm_input, block], dim=1)
                text_cache = text_cache[:, n_text:]
            while True:
                logp = self._forward(lm_input)
                if logp is None:
                    return
                if len(self.decoded) == next_fill:
                    token = self.fill_token
                    next_fill += n_speech + 1
                else:
                    token = self._sample(logp, ignore_eos=True)
                if token == self.fill_token:
                    next_fill = len(self.decoded) + n_speech + 1
                self.decoded.append(token)
                if token >= lm.speech_token_size:
                    if token == self.fill_token:
                        break
                    self._stop("unexpected_token", token)
                    return
                self.tokens.append(token)
                yield token
                if self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
                    self._stop("max_len")
                    return
                lm_input = lm.speech_embedding.weight[token].reshape(1, 1, -1)
        if not self.text_tokens:
            raise LLMError("the text ended without a single text token (nothing to synthesise)")
        max_len = lm.length_bounds(self.text_tokens, 0, self.max_token_text_ratio)[1]
        if self.max_tokens is not None:
            max_len = min(max_len, self.max_tokens)
        lm_input = torch.cat([lm_input, text_cache, task], dim=1)
        while True:
            if len(self.tokens) >= max_len:
                self._stop("max_len")
                return
            logp = self._forward(lm_input)
            if logp is None:
                return
            token = self._sample(logp, ignore_eos=False)
            self.decoded.append(token)
            if token >= lm.speech_token_size:
                self._stop("eos" if token == lm.eos_token else "unexpected_token", token)
                return
            self.tokens.append(token)
            yield token
            lm_input = lm.speech_embedding.weight[token].reshape(1, 1, -1)

    def _forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """One model call on the inputs ``x`` [1, T, D] after the cache: the last position's log-probabilities
        [the LM's outputs], or None after stopping (cancelled, out of positions)."""
        if self.cancelled():
            self._stop("cancelled")
            return None
        if self._length + x.shape[1] > self.lm.max_positions:
            self._stop("max_positions")
            return None
        out = self.lm.qwen(inputs_embeds=x, past_key_values=self._cache, use_cache=True)
        self._cache, self._length = out.past_key_values, self._length + x.shape[1]
        return self.lm.llm_decoder(out.last_hidden_state[0, -1]).log_softmax(dim=-1).float().cpu()

    def _sample(self, logp: torch.Tensor, *, ignore_eos: bool) -> int:
        if self.on_step is not None:
            self.on_step(len(self.decoded), logp.clone())
        return sample_token(logp, self.decoded, self.draw, self.sampling, eos_token=self.lm.min_len_masked_token,
                            ignore_eos=ignore_eos)

    def _stop(self, reason: str, token: int = -1) -> None:
        self.stop_reason, self.stop_token = reason, int(token)
        self._cache = None
        if reason != "eos":
            log.warning("live LM decode stopped: %s%s after %d speech tokens (%d text tokens)", reason,
                        f" (token {token})" if token >= 0 else "", len(self.tokens), self.text_tokens)


def live_decode(lm, text_chunks: Iterable[Any], prompt_text_tokens: Any = (), prompt_speech_tokens: Any = (),
                **options: Any) -> LiveDecode:
    """:class:`LiveDecode` of ``lm`` (a :class:`.llm.Qwen2LM`, or CosyVoice3's); inputs are checked now, decoding
    runs as the result is consumed. ``options``: ``draws``, ``sampling``, ``max_token_text_ratio``, ``max_tokens``,
    ``cancelled``, ``on_step``."""
    return LiveDecode(lm, text_chunks, prompt_text_tokens, prompt_speech_tokens, **options)
