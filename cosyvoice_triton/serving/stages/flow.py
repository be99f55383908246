"""``flow``: speech tokens to mel for a batch of utterances, with the encoder and estimator as callables.

:class:`FlowSolver` does what ``CosyVoice2.token2wav`` does before HiFT (non-streaming, ``finalize=True``) for
B utterances at once: ONE ``flow_encoder`` call on the padded batch (prompt tokens then source tokens per
item), the prompt-mel conditioning, then the Euler solver of :func:`~cosyvoice_triton.models.cfm.solve_euler`
with ONE ``flow_estimator`` call per step on 2B rows (``[cond_1..cond_B, uncond_1..uncond_B]``), and the crop
of each item's prompt frames. The noise is the official fixed buffer (``rand_noise[:, :, :T]``), so every item
gets exactly what it would get alone; nothing is random per request.

In Triton the two callables are BLS calls to the ``flow_encoder`` and ``flow_estimator`` models; in-process
they are :class:`~cosyvoice_triton.serving.stages.graphs.GraphRunner` calls. Both take and return numpy dicts named as
:data:`~cosyvoice_triton.shapes.GRAPHS`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...config import CFMConfig
from ...errors import CosyVoiceError
from ...models.cfm import cfm_noise, cosine_t_span, solve_euler
from ...shapes import GRAPHS, MAX_LOOKAHEAD
from .batching import ItemResult, RequestError, run_per_item

log = logging.getLogger(__name__)

__all__ = ["FlowItem", "FlowSolver", "GraphFn"]

#: ``fn(feeds) -> outputs``: one call of a graph (numpy, spec names); raises on failure.
GraphFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass
class FlowItem:
    """One utterance: source tokens [Ts] int32, prompt tokens [Tp] int32, prompt mel [Tf, 80], embedding [192]."""

    source_tokens: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    embedding: np.ndarray
    #: a streaming chunk (``condition(streaming=True, finalize=False)``): chunk-causal attention in the encoder
    #: and estimator, and the last ``lookahead`` source tokens only feed the encoder's look-ahead (0 or 3)
    streaming: bool = False
    lookahead: int = 0

    @classmethod
    def from_tensors(cls, t: Mapping[str, np.ndarray]) -> FlowItem:
        """From one request's ``flow`` inputs (batch 1)."""
        def one(name, ndim, dtype):
            if t.get(name) is None:
                raise RequestError(f"flow: missing input {name!r}")
            x = np.asarray(t[name])
            if x.ndim == ndim + 1 and x.shape[0] == 1:
                x = x[0]
            if x.ndim != ndim:
                raise RequestError(f"flow: {name} must be one utterance ([1, ...] of rank {ndim + 1}), got "
                                   f"shape {list(np.shape(t[name]))}")
            return np.ascontiguousarray(x, dtype=dtype)

        return cls(one("source_speech_tokens", 1, np.int32), one("prompt_speech_tokens", 1, np.int32),
                   one("prompt_mel", 2, np.float32), one("speaker_embedding", 1, np.float32))


class FlowSolver:
    """Tokens to mel for a batch, with the official CFM settings of ``config`` (``ModelConfig.flow.cfm``).

    ``max_batch``: utterances per encoder call / half the estimator rows (the graphs' maximum batches).
    """

    def __init__(self, cfm: CFMConfig, *, token_mel_ratio: int = 2, n_timesteps: int | None = None,
                 max_batch: int | None = None):
        self.cfm = cfm
        self.n_timesteps = int(n_timesteps or cfm.n_timesteps)
        if self.n_timesteps < 1:
            raise ValueError(f"n_timesteps must be >= 1, got {self.n_timesteps}")
        self.token_mel_ratio = token_mel_ratio
        self.noise = cfm_noise(cfm.noise_frames)  # [1, 80, frames], the official fixed buffer
        if cfm.t_scheduler == "cosine":
            self.t_span = cosine_t_span(self.n_timesteps)
        else:
            self.t_span = torch.linspace(0, 1, self.n_timesteps + 1)
        self.max_batch = int(max_batch or min(GRAPHS["flow_encoder"].max_batch_size,
                                              GRAPHS["flow_estimator"].max_batch_size // 2))

    def check(self, item: FlowItem) -> None:
        """Per-item checks that would otherwise fail a whole batch."""
        if item.source_tokens.size < 1 or item.prompt_tokens.size < 1:
            raise RequestError("flow: source and prompt need at least one speech token each")
        if item.prompt_mel.ndim != 2 or item.prompt_mel.shape[1] != 80 or item.prompt_mel.shape[0] < 1:
            raise RequestError(f"flow: prompt_mel must be [frames, 80], got {list(item.prompt_mel.shape)}")
        if item.lookahead not in (0, MAX_LOOKAHEAD) or item.lookahead >= item.source_tokens.size:
            raise RequestError(f"flow: lookahead must be 0 or {MAX_LOOKAHEAD} and leave a source token, got "
                               f"{item.lookahead} of {item.source_tokens.size}")
        if item.embedding.shape != (192,):
            raise RequestError(f"flow: speaker_embedding must have 192 values, got {list(item.embedding.shape)}")
        lo, hi = GRAPHS["flow_encoder"].tensor("speech_tokens").values
        for name, tokens in (("source_speech_tokens", item.source_tokens),
                             ("prompt_speech_tokens", item.prompt_tokens)):
            bad = (tokens < lo) | (tokens > hi)
            if bad.any():
                raise RequestError(f"flow: {name} has token id {int(tokens[bad][0])} outside {lo}..{hi}")
        for name, x in (("prompt_mel", item.prompt_mel), ("speaker_embedding", item.embedding)):
            if not np.isfinite(x).all():
                raise RequestError(f"flow: {name} has NaN/Inf values; inputs must be finite")
        total = item.source_tokens.size + item.prompt_tokens.size
        axis = GRAPHS["flow_encoder"].axes["tokens"]
        if total > axis.max:
            raise RequestError(f"flow: {total} speech tokens (prompt + source) exceed the maximum {axis.max}")
        if total < axis.min:
            raise RequestError(f"flow: {total} speech tokens (prompt + source) are below the minimum {axis.min}")
        frames = self.token_mel_ratio * total
        if frames > self.noise.shape[-1]:
            raise RequestError(f"flow: {frames} mel frames exceed the noise buffer ({self.noise.shape[-1]})")
        if item.prompt_mel.shape[0] > self.token_mel_ratio * item.prompt_tokens.size + self.token_mel_ratio * \
                item.source_tokens.size:
            raise RequestError("flow: prompt_mel is longer than the mel frames of prompt + source tokens")

    def run(self, items: Sequence[FlowItem], encoder: GraphFn, estimator: GraphFn) -> list[ItemResult[np.ndarray]]:
        """Mel ``[80, T_i]`` (prompt frames removed) per item; a bad item fails alone, a failed graph call
        fails the items of its chunk."""
        results: list[ItemResult[np.ndarray]] = [ItemResult() for _ in items]
        good = []
        for i, item in enumerate(items):
            try:
                self.check(item)
                good.append(i)
            except CosyVoiceError as exc:
                results[i] = ItemResult(error=exc)
        for start in range(0, len(good), self.max_batch):
            chunk = good[start:start + self.max_batch]
            for i, res in zip(chunk, self._run_isolated([items[i] for i in chunk], encoder, estimator),
                              strict=True):
                results[i] = res
        return results

    def _run_isolated(self, items: Sequence[FlowItem], encoder: GraphFn, estimator: GraphFn
                      ) -> list[ItemResult[np.ndarray]]:
        """One batch; if it raises, each item alone, so that one item's failure is its own."""
        try:
            return [ItemResult(mel) for mel in self._run_batch(items, encoder, estimator)]
        except Exception as exc:
            if len(items) == 1:
                return [ItemResult(error=exc)]
            log.warning("flow: batch of %d failed (%s: %s); running the items one by one", len(items),
                        type(exc).__name__, exc)
        return [r for it in items for r in self._run_isolated([it], encoder, estimator)]

    def run_tensors(self, requests: Sequence[Mapping[str, np.ndarray | None]], encoder: GraphFn,
                    estimator: GraphFn) -> list[ItemResult[np.ndarray]]:
        """:meth:`run` on the ``flow`` input tensors of each request (batch 1 each)."""
        parsed = run_per_item(requests, FlowItem.from_tensors)
        good = [i for i, r in enumerate(parsed) if r.ok]
        results: list[ItemResult[np.ndarray]] = list(parsed)
        for i, r in zip(good, self.run([parsed[i].value for i in good], encoder, estimator), strict=True):
            results[i] = r
        return results

    def _run_batch(self, items: Sequence[FlowItem], encoder: GraphFn, estimator: GraphFn) -> list[np.ndarray]:
        b = len(items)
        lens = np.array([it.prompt_tokens.size + it.source_tokens.size for it in items], np.int32)
        tokens = np.zeros((b, int(lens.max())), np.int32)
        for i, it in enumerate(items):
            tokens[i, : lens[i]] = np.concatenate([it.prompt_tokens, it.source_tokens])
        flags = np.array([it.streaming for it in items], bool)
        enc = encoder({
            "speech_tokens": tokens,
            "speech_token_len": lens,
            "lookahead_len": np.array([it.lookahead for it in items], np.int32),
            "speaker_embedding": np.stack([it.embedding for it in items]).astype(np.float32),
            "streaming": flags,
        })
        mu = torch.from_numpy(np.ascontiguousarray(enc["mu"], dtype=np.float32))  # [B, 80, T]
        mel_len = np.asarray(enc["mel_len"]).reshape(-1).astype(np.int64)
        spks = torch.from_numpy(np.ascontiguousarray(enc["spks"], dtype=np.float32)).reshape(b, -1)
        t = mu.shape[-1]
        mask = (torch.arange(t)[None, :] < torch.from_numpy(mel_len)[:, None]).to(torch.float32)[:, None, :]
        cond = torch.zeros_like(mu)
        prompt_len = [it.prompt_mel.shape[0] for it in items]
        for i, it in enumerate(items):
            cond[i, :, : prompt_len[i]] = torch.from_numpy(it.prompt_mel.T)
        mu = mu * mask
        z = self.noise[:, :, :t].expand(b, -1, -1).contiguous()

        def estimator_fn(x, m, mu_, t_, spks_, cond_, streaming):
            out = estimator({"x": x.numpy(), "mask": m.numpy(), "mu": mu_.numpy(),
                             "t": t_.contiguous().numpy(), "spks": spks_.numpy(), "cond": cond_.numpy(),
                             "streaming": np.concatenate([flags, flags])})  # CFG rows: cond, uncond
            return torch.from_numpy(np.ascontiguousarray(out["velocity"], dtype=np.float32))

        x = solve_euler(estimator_fn, z, mask, mu, spks, cond, self.t_span, self.cfm.inference_cfg_rate, False)
        out = []
        for i in range(b):
            out.append(np.ascontiguousarray(x[i, :, prompt_len[i]: int(mel_len[i])].numpy(), dtype=np.float32))
        return out
