"""CosyVoice3's streamed flow, incremental: a non-final chunk computes only the frames it does not already hold.

The official streaming ``token2wav`` (:class:`~.token2wav.Token2Wav3`) runs the flow at every chunk on the prompt and
*all* tokens so far, 10 Euler steps of the DiT with classifier-free guidance (2 rows), and keeps the chunk's new
frames. :func:`incremental_chunk3` computes the same frames from a per-stream :class:`Flow3StreamState`.

**Why settled frames cannot change.** A non-final chunk runs with ``streaming=True``: the DiT's attention is
chunk-causal, frame ``i`` sees the frames ``j < (i // C + 1) * C`` (``C = static_chunk_size``, 50 mel frames, the
chunk counted from the prompt's first frame), its two position convolutions are causal (left zeros), and everything
else is per frame (the input projection, the adaptive norms, the feed-forward, the output projection) or per step
(the time embedding). The inputs of a frame do not depend on later tokens: ``mu`` is the pre-lookahead layer's
output for a token whose three look-ahead tokens are present (``finalize=False`` drops the frames of the last three,
which are only context), ``cond`` is the prompt mel at its frame, the noise is the fixed buffer at its frame. So
by induction over the Euler steps, a frame in a *complete* attention chunk (``i < C * floor(T / C)`` for a call of
``T`` frames) has the same value at every step in every later call: it is settled. The state keeps, for every Euler
step and both CFG rows, the keys and values of every transformer block for the settled frames (after the rotary
embedding: positions are absolute) and the last ``kernel - 1`` inputs of both position convolutions, and the settled
mel. A call then runs the solver on the frames from the first unsettled one on, attending to the cached keys, and
settles the frames of its complete chunks. Any schedule works (the official hops settle every frame; the official
Triton runtime's 15-token first hop leaves a partial chunk that the next call computes again).

The final chunk (``finalize=True``) runs with full attention in the official loop, where every frame sees every
later frame and no cached value holds: it takes the recompute path, as does a chunk whose state would pass the
cap. The new frames equal the recomputed ones up to float rounding (the products have other sizes).

**Size.** Per settled mel frame: ``n_timesteps x 2 rows x depth x (K + V) x heads x dim_head x 4`` bytes, plus 80
floats of mel: about 3.6 MB at Fun-CosyVoice3-0.5B dims (10 steps, 22 blocks, 1024 wide), 180 MB per second of
prompt and speech (:func:`cache_bytes_per_frame3`; the tiny demo model: about 21 KB). The keys and values live in
buffers as long as the last call's frames (the unsettled ones past the settled: at most one attention chunk and the
look-ahead, overwritten by the next call), written in place: a call copies the cache once, when it grows, not at
every block of every step (the state counts the buffers). The cap ``max_bytes`` bounds one stream; past it the stream
drops its state and recomputes from there (never refused for it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .dit import DiT, DiTBlock, apply_rotary, layer_norm
from .flow import CausalMaskedDiffWithDiT, Flow3Dims

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BYTES", "Flow3StreamState", "cache_bytes_per_frame3", "dit_step", "incremental_chunk3"]

#: Default cap on one stream's state (2 GiB): about 590 settled mel frames (11.8 s of prompt + speech) at full dims.
DEFAULT_MAX_BYTES = 2 << 30


def _kv_bytes_per_frame(dims: Flow3Dims, n_timesteps: int) -> int:
    d = dims.dit
    return 4 * n_timesteps * 2 * d.depth * 2 * d.heads * d.dim_head


def cache_bytes_per_frame3(dims: Flow3Dims, n_timesteps: int | None = None) -> int:
    """fp32 bytes of state per settled mel frame: keys and values of every block, every Euler step, both CFG rows,
    and the frame's mel."""
    n = dims.cfm.n_timesteps if n_timesteps is None else n_timesteps
    return _kv_bytes_per_frame(dims, n) + 4 * dims.dit.out_channels


@dataclass
class _StepCache:
    """One Euler step's cache (both CFG rows): per block the keys / values [2, heads, capacity, dim_head], the
    settled frames first (the frames after them: the last call's, overwritten by the next); the last ``kernel - 1``
    inputs [2, kernel - 1, dim] of the two position convolutions."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    conv_tails: list[Tensor] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.conv_tails))


class Flow3StreamState:
    """One stream's settled frames (module docstring): :attr:`frames` of them (prompt frames included), their mel
    and the per-step caches. ``max_bytes`` caps it; ``reserve(nbytes) -> bool`` (optional) is asked before the state
    grows to ``nbytes`` (an instance's budget; False: the stream drops its state and recomputes); ``release()``
    (optional) is told once when the state is closed."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, reserve: Callable[[int], bool] | None = None,
                 release: Callable[[], None] | None = None):
        self.max_bytes, self.reserve, self.release = int(max_bytes), reserve, release
        self.steps: list[_StepCache] = []
        self.frames = 0
        self.mel: Tensor | None = None  # [1, 80, frames]
        self.active = True
        self.chunks = 0  # chunks computed from the state

    def nbytes(self) -> int:
        mel = 0 if self.mel is None else self.mel.numel() * self.mel.element_size()
        return mel + sum(s.nbytes() for s in self.steps)

    def reset(self) -> None:
        self.steps, self.frames, self.mel = [], 0, None

    def drop(self) -> None:
        """Forget everything and stop: every later chunk recomputes."""
        self.reset()
        self.active = False

    def close(self) -> None:
        """:meth:`drop`, and tell ``release`` (once)."""
        self.drop()
        release, self.release = self.release, None
        if release is not None:
            release()


def _attend(block: DiTBlock, x: Tensor, keys: Tensor, values: Tensor, lo: int, allowed: Tensor, freqs: Tensor
            ) -> Tensor:
    """The block's attention for the new frames x [2, n, D] (frames ``lo .. lo + n``) against the cached keys /
    values [2, H, >= lo + n, dh] of the frames before: their keys and values are written there, in place."""
    attn, (b, n) = block.attn, x.shape[:2]
    q = apply_rotary(attn.to_q(x), freqs)
    k = apply_rotary(attn.to_k(x), freqs)
    v = attn.to_v(x)
    q, k, v = (y.view(b, n, attn.heads, y.shape[-1] // attn.heads).transpose(1, 2) for y in (q, k, v))
    hi = lo + n
    keys[:, :, lo:hi] = k
    values[:, :, lo:hi] = v
    out = F.scaled_dot_product_attention(q, keys[:, :, :hi], values[:, :, :hi], attn_mask=allowed, dropout_p=0.0,
                                         is_causal=False)
    return attn.to_out[0](out.transpose(1, 2).reshape(b, n, q.shape[1] * q.shape[-1]))


def _room(cache: list[Tensor], lo: int, frames: int) -> list[Tensor]:
    """Each buffer [2, H, capacity, dh] of ``cache`` with room for ``frames`` frames: as it is, or its first ``lo``
    frames moved to a new buffer of ``frames`` frames."""
    if cache[0].shape[2] >= frames:
        return cache
    out = []
    for old in cache:
        new = old.new_empty(*old.shape[:2], frames, old.shape[3])
        new[:, :, :lo] = old[:, :, :lo]
        out.append(new)
    return out


def _conv(conv: torch.nn.Sequential, tail: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """A causal position convolution over x [2, n, D] after its cached inputs ``tail`` [2, k - 1, D]: (output
    [2, n, D], the inputs [2, k - 1 + n, D] it read)."""
    full = torch.cat([tail, x], dim=1)
    return conv(full.transpose(1, 2)).transpose(1, 2), full


def _positions(dit: DiT, lo: int, hi: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The rotary frequencies of the frames ``lo .. hi`` and their chunk-causal mask [1, 1, hi - lo, hi] over the
    frames ``0 .. hi``: the same at every Euler step of a call."""
    size = dit.dims.static_chunk_size
    query = torch.arange(lo, hi, device=device)
    ends = (torch.div(query, size, rounding_mode="floor") + 1) * size
    allowed = (torch.arange(hi, device=device).unsqueeze(0) < ends.unsqueeze(1)).view(1, 1, hi - lo, hi)
    return dit.rotary_embed(hi)[:, lo:], allowed


def dit_step(dit: DiT, cache: _StepCache, lo: int, settle: int, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor,
             cond: Tensor, positions: tuple[Tensor, Tensor]) -> Tensor:
    """One velocity evaluation of the DiT (streaming attention, both CFG rows) for the frames ``lo .. lo + n`` of an
    unpadded utterance, the frames before ``lo`` read from ``cache``; the frames ``lo .. settle`` are then added to
    it (the cache's buffers grown to ``lo + n`` frames if shorter: one copy per call, none per block). x, mu, cond
    [2, 80, n], t [2], spks [2, 80] -> [2, 80, n]; ``positions``: :func:`_positions` of ``lo .. lo + n``."""
    d = dit.dims
    rows, n = x.shape[0], x.shape[-1]
    hi, k1 = lo + n, d.conv_pos_kernel - 1
    if not cache.conv_tails:  # the convolutions' left padding: zeros
        cache.conv_tails = [x.new_zeros(rows, k1, d.dim), x.new_zeros(rows, k1, d.dim)]
        cache.keys = [x.new_zeros(rows, d.heads, 0, d.dim_head) for _ in dit.transformer_blocks]
        cache.values = [k.clone() for k in cache.keys]
    cache.keys, cache.values = _room(cache.keys, lo, hi), _room(cache.values, lo, hi)
    t_emb = dit.time_embed(t)
    emb = dit.input_embed
    h = emb.proj(torch.cat([x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2),
                            spks.unsqueeze(1).expand(-1, n, -1)], dim=-1))
    pe = emb.conv_pos_embed
    h1, in1 = _conv(pe.conv1, cache.conv_tails[0], h)
    h2, in2 = _conv(pe.conv2, cache.conv_tails[1], h1)
    h = h2 + h
    freqs, allowed = positions
    keep = settle - lo
    for i, block in enumerate(dit.transformer_blocks):
        norm, gate, shift_ff, scale_ff, gate_ff = block.attn_norm(h, t_emb)
        out = _attend(block, norm, cache.keys[i], cache.values[i], lo, allowed, freqs)
        h = h + gate.unsqueeze(1) * out
        norm = layer_norm(h) * (1 + scale_ff[:, None]) + shift_ff[:, None]
        h = h + gate_ff.unsqueeze(1) * block.ff(norm)
    if keep:
        cache.conv_tails = [in1[:, keep: keep + k1].clone(), in2[:, keep: keep + k1].clone()]
    return dit.proj_out(dit.norm_out(h, t_emb)).transpose(1, 2)


def incremental_chunk3(flow: CausalMaskedDiffWithDiT, state: Flow3StreamState, token: Tensor, prompt_token: Tensor,
                       prompt_feat: Tensor, embedding: Tensor) -> Tensor | None:
    """The mel [1, 80, T - Tf] (prompt frames dropped) of one non-final streaming chunk (``streaming=True,
    finalize=False``: ``token`` [1, Ts] is every source token so far, the three look-ahead ones last), computed from
    ``state`` and settling its complete attention chunks there. The flow's local DiT runs (not its
    ``estimator_fn``). Returns None when the chunk must be recomputed: a state stopped before, or one that would
    pass its cap or its budget (it is then closed: its memory and its place in the budget given back)."""
    if not state.active:
        return None
    c = flow.condition(token, prompt_token, prompt_feat, embedding, finalize=False)
    total = int(c.mu.shape[-1])
    if state.frames > total:  # a foreign stream's state: start again
        state.reset()
    lo = state.frames
    chunk = flow.decoder.estimator.static_chunk_size
    settle = max(lo, total // chunk * chunk)
    n_steps, d = flow.decoder.config.n_timesteps, flow.dims.dit
    # after the call: the settled mel, the keys / values of every frame of the call, the convolutions' tails
    per_frame = _kv_bytes_per_frame(flow.dims, n_steps)
    capacity = max(total, state.steps[0].capacity if state.steps else 0)
    grown = (4 * d.out_channels * settle + per_frame * capacity
             + 4 * n_steps * 2 * 2 * (d.conv_pos_kernel - 1) * d.dim)
    if grown > state.max_bytes or (state.reserve is not None and not state.reserve(grown)):
        log.info("stream state: a CosyVoice3 stream's state would hold %d MiB, past %s; it recomputes from here",
                 grown >> 20, f"its cap ({state.max_bytes >> 20} MiB)" if grown > state.max_bytes
                 else "what the instance's budget has left")
        state.close()  # its memory and its place in the budget, now
        return None
    decoder, dit = flow.decoder, flow.decoder.estimator
    steps = iter(range(1 << 30))
    positions = _positions(dit, lo, total, c.mu.device)

    def step_fn(x, mask, mu, t, spks, cond, streaming):
        i = next(steps)
        if i == len(state.steps):
            state.steps.append(_StepCache())
        return dit_step(dit, state.steps[i], lo, settle, x, mu, t, spks, cond, positions)

    mu = c.mu[:, :, lo:]
    new = decoder(mu, torch.ones_like(mu[:, :1]), c.spks, c.cond[:, :, lo:], streaming=True,
                  noise=decoder.noise(total)[:, :, lo:], estimator_fn=step_fn)
    mel = new if state.mel is None else torch.cat([state.mel, new], dim=2)
    state.mel, state.frames = mel[:, :, :settle].clone(), settle
    state.chunks += 1
    return mel[:, :, int(c.prompt_mel_len[0]):]
