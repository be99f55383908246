"""Incremental streaming flow: each streaming chunk computes only its new frames, against cached keys.

In the official streaming loop every chunk call runs the flow on the prompt and *all* tokens so far, at every
one of the 10 Euler steps (CFG batch 2), and keeps only the new frames. This module computes the same new
frames from a per-stream :class:`FlowStreamState` instead.

**Why earlier frames cannot change.** Let a non-final chunk call see N = Tp + end tokens (prompt + source up to
the chunk's end; its P = 3 look-ahead tokens are only context), and the previous call N' < N tokens.

* Encoder, token rate. The embedding and ``embed`` (Linear + LayerNorm) are per token. The pre-lookahead conv1
  makes frame t depend on tokens t..t+P; in the previous call tokens N'..N'+P-1 were its context, and here they
  are real tokens with the same ids, so the same values (the context is placed by an exact one-hot matmul).
  conv2 is causal. Chunk-causal attention lets frame t see keys j < (t // 25 + 1) * 25 (every left chunk):
  if N' is a multiple of 25, no frame t < N' saw or sees a key >= N', and a frame >= N' never feeds one < N'.
  The relative position term depends on t - j only. So frames < N' are unchanged, layer by layer.
* Upsample: output frame u depends on token frames <= u // 2 (nearest x2, causal conv k5), so mel-rate frames
  < 2N' depend on tokens < N' only. The up-encoders' chunk is 50 frames; 2N' is a multiple of 50.
* ``encoder_proj`` is per frame; ``spks`` is per stream; ``cond`` is the prompt mel at frame f < Tf, zeros
  after it, indexed by frame: the same at every call. The noise is ``rand_noise[:, :, :T]``: a prefix.
* Estimator (per Euler step, each CFG row on its own: the unconditional row zeroes mu/spks/cond, the same in
  every call): causal convs (k3, left zeros), per-frame LayerNorm/Mish/1x1 convs, the time embedding (shared),
  chunk-causal attention with a 50-frame chunk (2N' a multiple of 50, as above). By induction over the steps,
  x_k on frames < 2N' is the same at every step, so is the mel.
* Alignment needed: the previous call's token count N' must be a multiple of the encoder chunk (25), and
  2N' of the estimator's (50). The official schedule gives that (first hop padded so that prompt + chunk is a
  multiple of 25, then hops of 50 and 100). When it does not hold the stream falls back to a full computation.
* The final chunk (``finalize=True``) runs with ``streaming=False`` in the official loop: full attention in the
  encoder and the estimator, so every frame sees every later frame and no cached value is valid there. It is
  computed by the official (recompute) path; so is any chunk whose state would exceed the cache cap.

Numerically the new frames are the official ones up to float rounding: the matrices have other sizes (the
official 28- and 78-token calls agree to 4.8e-7 on their shared frames for the same reason).

**What is cached, per stream.** Encoder: keys and values of every attention layer for settled frames (6 layers
at token rate, 4 at mel rate), the last 2 conformer outputs before the upsample. Estimator: for every Euler
step and both CFG rows, keys and values of every transformer block (4 + 12 * 4 + 4 = 56 at full dims) and the
last 2 input frames of every causal conv; plus the settled mel (80 floats per frame). At full dims that is
about 4.6 MB per settled mel frame (10 steps x 2 rows x 56 blocks x (K + V) x 512 x 4 bytes; the encoder adds
29 KB): 229 MB per second of prompt + speech. A 10 s answer after a 3 s prompt would hold 2.3 GB before its
final chunk (settled up to token 75 + 175); a 4-6 s answer 1.4 GB (75 + 75). Hence the cap
``max_cache_bytes`` (:data:`DEFAULT_MAX_CACHE_BYTES`, 2 GiB, about 9 s of prompt + speech): a chunk whose cached
state would pass it runs the recompute path and the stream stops caching (so that 10 s answer recomputes its
third chunk). The state is dropped before the final chunk. :func:`cache_bytes_per_frame` gives the figure for a
config (tiny dims: about 40 KB per frame).

The served streams keep this state in the model that owns each stream, with this module's code and the checkpoint's
PyTorch flow (:mod:`cosyvoice_triton.serving.stages.stream_state`, which says why not through the ONNX graphs).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import FlowConfig
from .encoder import ConformerEncoderLayer, RelPositionMultiHeadedAttention, UpsampleConformerEncoder
from .estimator import Attention, BasicTransformerBlock, CausalConditionalDecoder, sinusoidal_embedding
from .flow import CausalMaskedDiffWithXvec

__all__ = ["DEFAULT_MAX_CACHE_BYTES", "FlowStreamState", "cache_bytes_per_frame", "estimator_step",
           "incremental_chunk", "prompt_state", "window_chunk"]

#: Default cap on one stream's cached state (2 GiB): about 460 settled mel frames (9 s) at full dims.
DEFAULT_MAX_CACHE_BYTES = 2 << 30


def cache_bytes_per_frame(config: FlowConfig, n_timesteps: int | None = None) -> float:
    """fp32 bytes of cached state per settled mel frame (estimator for every Euler step and both CFG rows,
    plus the encoder at half rate for its token-rate layers, plus the mel)."""
    e, enc = config.estimator, config.encoder
    n = config.cfm.n_timesteps if n_timesteps is None else n_timesteps
    blocks = e.n_blocks * (2 + e.num_mid_blocks)
    estimator = n * 2 * blocks * 2 * e.num_heads * e.attention_head_dim
    encoder = 2 * enc.output_size * (enc.num_blocks / enc.upsample_stride + enc.num_up_blocks)
    return 4.0 * (estimator + encoder + e.out_channels)


@dataclass
class _Cache:
    """Keys/values and conv tails of one pass (one Euler step, or the encoder), in call order; ``positions``: the
    frame index of each cached key (every layer of a pass caches the same frames)."""

    kv: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    tails: list[Tensor] = field(default_factory=list)
    positions: Tensor | None = None

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv) + sum(t.nbytes for t in self.tails)

    def keep(self, keep: Tensor) -> None:
        """Forget the keys/values of the frames where ``keep`` [len(positions)] is False."""
        if self.positions is None or bool(keep.all()):
            return
        idx = keep.nonzero().reshape(-1)
        self.kv = [(k.index_select(2, idx), v.index_select(2, idx)) for k, v in self.kv]
        self.positions = self.positions[idx]


class _Pass:
    """One incremental pass over new frames [start, total): hands out each layer's cache entry in order.

    The keys are the cached frames (``cache.positions``) then the new ones; ``n_keys`` of them, the new ones from key
    ``key_start`` on (``total`` and ``start`` unless frames were forgotten: :func:`window_chunk`). The chunk-causal
    mask is on frame indices."""

    def __init__(self, cache: _Cache, start: int, total: int, chunk: int, device: torch.device):
        self.cache, self.start, self.total = cache, start, total
        self.conv_i = self.attn_i = 0
        q = torch.arange(start, total, device=device)
        old = cache.positions if cache.positions is not None else torch.arange(start, device=device)
        keys = torch.cat([old.to(device), q])
        cache.positions = keys
        self.n_keys, self.key_start = int(keys.numel()), int(old.numel())
        self.allowed = keys.unsqueeze(0) < ((q // chunk + 1) * chunk).unsqueeze(1)  # [n, n_keys]

    def tail(self, x: Tensor, k: int) -> Tensor:
        """x [B, C, n] -> [B, C, k + n]: the last k frames seen before (zeros at first) in front."""
        i, self.conv_i = self.conv_i, self.conv_i + 1
        if i == len(self.cache.tails):
            self.cache.tails.append(x.new_zeros(x.shape[0], x.shape[1], k))
        out = torch.cat([self.cache.tails[i], x], dim=-1)
        self.cache.tails[i] = out[..., out.shape[-1] - k:]
        return out

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """New k, v [B, H, n, d] -> every key/value so far [B, H, total, d] (and remember them)."""
        i, self.attn_i = self.attn_i, self.attn_i + 1
        if i == len(self.cache.kv):
            self.cache.kv.append((k, v))
        else:
            pk, pv = self.cache.kv[i]
            self.cache.kv[i] = (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        return self.cache.kv[i]


# --------------------------------------------------------------------------------------------- estimator

def _causal_conv(run: _Pass, conv: torch.nn.Conv1d, x: Tensor) -> Tensor:
    return F.conv1d(run.tail(x, conv.kernel_size[0] - 1), conv.weight, conv.bias)


def _causal_block(run: _Pass, block, x: Tensor) -> Tensor:  # CausalBlock1D with an all-ones mask
    conv, _, norm, _, act = block.block
    return act(norm(_causal_conv(run, conv, x).transpose(1, 2)).transpose(1, 2))


def _attention(run: _Pass, attn: Attention, x: Tensor, bias: Tensor) -> Tensor:
    b, n, _ = x.shape
    q, k, v = (p(x).view(b, n, attn.heads, -1).transpose(1, 2) for p in (attn.to_q, attn.to_k, attn.to_v))
    k, v = run.keys_values(k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1))


def _transformer(run: _Pass, tf: BasicTransformerBlock, x: Tensor, bias: Tensor) -> Tensor:
    x = x + _attention(run, tf.attn1, tf.norm1(x), bias)
    return x + tf.ff(tf.norm3(x))


def estimator_step(est: CausalConditionalDecoder, cache: _Cache, start: int, x: Tensor, mu: Tensor, t: Tensor,
                   spks: Tensor, cond: Tensor) -> Tensor:
    """The streaming (chunk-causal) velocity of the new frames [start, start + n) of unpadded rows.

    x, mu, cond [B, 80, n], t [B], spks [B, 80]; ``cache`` holds this Euler step's state for frames < start
    (empty when ``start`` is 0) and is extended with the new frames. Returns v [B, 80, n].
    """
    n = x.shape[-1]
    run = _Pass(cache, start, start + n, est.static_chunk_size, x.device)
    bias = ((1.0 - run.allowed.to(x.dtype)) * est.mask_bias)[None, None]  # [1, 1, n, total]
    t_emb = est.time_mlp(sinusoidal_embedding(t, est.in_channels))
    h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, n), cond], dim=1)

    def body(blocks, h: Tensor) -> Tensor:
        res = blocks[0]
        y = _causal_block(run, res.block1, h) + res.mlp(t_emb).unsqueeze(-1)
        h = (_causal_block(run, res.block2, y) + res.res_conv(h)).transpose(1, 2)
        for tf in blocks[1]:
            h = _transformer(run, tf, h, bias)
        return h.transpose(1, 2)

    down, up = est.down_blocks[0], est.up_blocks[0]
    skip = body(down, h)
    h = _causal_conv(run, down[2], skip)
    for blocks in est.mid_blocks:
        h = body(blocks, h)
    h = _causal_conv(run, up[2], body(up, torch.cat([h, skip], dim=1)))
    h = _causal_block(run, est.final_block, h)
    return est.final_proj(h)


# ----------------------------------------------------------------------------------------------- encoder

def _rel_attention(run: _Pass, attn: RelPositionMultiHeadedAttention, x: Tensor, p: Tensor) -> Tensor:
    """x [1, n, D] normed new frames; p [1, H, 2 n_keys - 1, dk] (projected rel-pos rows) -> [1, n, D]. The relative
    positions are those of the keys in order (the cached ones then the new ones, without gaps where frames were
    forgotten)."""
    b, n, _ = x.shape
    q = attn.linear_q(x).view(b, n, attn.h, attn.d_k)
    k = attn.linear_k(x).view(b, n, attn.h, attn.d_k).transpose(1, 2)
    v = attn.linear_v(x).view(b, n, attn.h, attn.d_k).transpose(1, 2)
    k, v = run.keys_values(k, v)
    ac = torch.matmul((q + attn.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))  # [1, H, n, total]
    full = torch.matmul((q + attn.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # [1, H, n, 2 total - 1]
    # row r of p encodes relative position total-1-r; query start+a, key j: r = total-1-(start+a)+j
    total = run.n_keys
    col = (total - 1 - run.key_start - torch.arange(n, device=x.device)).unsqueeze(1) + torch.arange(
        total, device=x.device)
    bd = torch.gather(full, 3, col.expand(b, attn.h, n, total))
    scores = (ac + bd) / math.sqrt(attn.d_k)
    blocked = ~run.allowed
    weights = torch.softmax(scores.masked_fill(blocked, -float("inf")), dim=-1).masked_fill(blocked, 0.0)
    out = torch.matmul(weights, v).transpose(1, 2).reshape(b, n, attn.h * attn.d_k)
    return attn.linear_out(out)


def _conformer(run: _Pass, layer: ConformerEncoderLayer, x: Tensor, p: Tensor) -> Tensor:
    x = x + _rel_attention(run, layer.self_attn, layer.norm_mha(x), p)
    return x + layer.feed_forward(layer.norm_ff(x))


def _layers(run: _Pass, embed, layers, x: Tensor) -> Tensor:
    """The conformer layers of one rate over the new frames x [1, n, D]."""
    _, pos_emb = embed.pos_enc(x.new_zeros(1, run.n_keys, 1))  # rows for relative positions n-1 .. -(n-1)
    for layer in layers:
        attn = layer.self_attn
        p = attn.linear_pos(pos_emb).view(1, -1, attn.h, attn.d_k).transpose(1, 2)
        x = _conformer(run, layer, x, p)
    return x


def encoder_chunk(enc: UpsampleConformerEncoder, caches: tuple[_Cache, _Cache], emb: Tensor, start: int,
                  context: Tensor, *, emb_start: int = 0) -> Tensor:
    """Streaming encoder output [1, stride * (N - start), D] of the new tokens [start, N).

    emb [1, N - emb_start, input_size]: the raw embeddings of the tokens from ``emb_start`` (at most ``start - 2``,
    or 0) to N (without the look-ahead); context [1, P, input_size]: those of the look-ahead tokens. ``caches``
    (token rate, mel rate) hold the state of tokens < start and are extended.
    """
    low, high = caches
    total, pre = emb_start + emb.shape[1], enc.pre_lookahead_layer
    p_len = pre.pre_lookahead_len
    lo = max(start - 2, 0)  # conv2 of the look-ahead layer reads 2 frames back
    if emb_start > lo:
        raise ValueError(f"encoder_chunk: the embeddings start at token {emb_start}, after {lo}")
    x = enc.embed.out(torch.cat([emb[:, lo - emb_start:], context], dim=1)) * enc.embed.pos_enc.xscale
    x = F.pad(x, (0, 0, 0, p_len - context.shape[1]))  # missing look-ahead frames are zeros
    y = F.leaky_relu(pre.conv1(x.transpose(1, 2)), 0.01)  # frames lo .. total-1
    y = F.pad(y, (2 - (start - lo), 0))
    x = pre.conv2(y).transpose(1, 2) + x[:, start - lo: total - lo]  # [1, n, D]

    run = _Pass(low, start, total, enc.static_chunk_size, x.device)
    x = _layers(run, enc.embed, enc.encoders, x)

    stride = enc.up_layer.stride
    up = run.tail(x.transpose(1, 2), 2)  # [1, D, 2 + n]: the 2 token frames the upsample conv reads back
    up = F.interpolate(up, scale_factor=float(stride), mode="nearest")
    x = F.conv1d(up, enc.up_layer.conv.weight, enc.up_layer.conv.bias).transpose(1, 2).contiguous()
    x = enc.up_embed.out(x) * enc.up_embed.pos_enc.xscale

    x = _layers(_Pass(high, stride * start, stride * total, enc.static_chunk_size * stride, x.device),
               enc.up_embed, enc.up_encoders, x)
    return enc.after_norm(x)


# ------------------------------------------------------------------------------------------------ stream

def _stage(timer, name: str):
    return nullcontext() if timer is None else timer.stage(name)


@dataclass
class FlowStreamState:
    """One stream's cached state. ``tokens``: the token count (prompt + source, without look-ahead) whose
    frames are settled; ``mel`` [1, 80, frames] the settled mel."""

    max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES
    tokens: int = 0
    mel: Tensor | None = None
    encoder: tuple[_Cache, _Cache] = field(default_factory=lambda: (_Cache(), _Cache()))
    steps: list[_Cache] = field(default_factory=list)
    active: bool = True  # False once the stream fell back to recompute for good
    recent: Tensor | None = None  # window_chunk: the last 2 settled token ids [1, 2] (the look-ahead conv reads back)

    def nbytes(self) -> int:
        mel = 0 if self.mel is None else self.mel.nbytes
        return mel + sum(c.nbytes() for c in (*self.encoder, *self.steps))

    def reset(self) -> None:
        self.tokens, self.mel = 0, None
        self.encoder, self.steps = (_Cache(), _Cache()), []

    def copy(self) -> FlowStreamState:
        """A state to continue from, leaving this one as it is: new lists over the same tensors (a chunk
        extends a cache by concatenation and replaces the list entries, never a tensor in place)."""
        def fresh(c: _Cache) -> _Cache:
            return _Cache(list(c.kv), list(c.tails), c.positions)

        return FlowStreamState(self.max_cache_bytes, self.tokens, self.mel, (fresh(self.encoder[0]),
                               fresh(self.encoder[1])), [fresh(c) for c in self.steps], self.active, self.recent)


def prompt_state(flow: CausalMaskedDiffWithXvec, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, *,
                 max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES) -> FlowStreamState | None:
    """The state of a stream after the prompt's settled frames, before any source token: every whole
    attention chunk of the prompt whose look-ahead tokens are prompt tokens too (the first
    ``((Tp - P) // 25) * 25`` tokens). No later token can change those frames (see the module docstring), so
    every stream with this prompt (a registered speaker) can start from a :meth:`~FlowStreamState.copy` of it.
    ``None`` when the prompt is shorter than one chunk plus the look-ahead, or the state would pass the cap.
    """
    chunk, p_len = flow.encoder.static_chunk_size, flow.pre_lookahead_len
    settled = max(prompt_token.shape[1] - p_len, 0) // chunk * chunk
    if settled == 0:
        return None
    state = FlowStreamState(max_cache_bytes)
    ratio = flow.token_mel_ratio
    mel = incremental_chunk(flow, state, prompt_token[:, settled: settled + p_len], prompt_token[:, :settled],
                            prompt_feat[:, : ratio * settled], embedding)
    return None if mel is None else state


def _cached_steps(decoder, state: FlowStreamState, lo: int):
    """The solver's estimator callable: Euler step i runs :func:`estimator_step` on ``state.steps[i]`` (made at the
    stream's first chunk) for the new frames from ``lo`` on."""
    calls = iter(range(decoder.config.n_timesteps))

    def step_fn(x, mask, mu_in, t, spks_in, cond_in, streaming):
        i = next(calls)
        if i == len(state.steps):
            state.steps.append(_Cache())
        return estimator_step(decoder.estimator, state.steps[i], lo, x, mu_in, t, spks_in, cond_in)

    return step_fn


def incremental_chunk(flow: CausalMaskedDiffWithXvec, state: FlowStreamState, token: Tensor, prompt_token: Tensor,
                      prompt_feat: Tensor, embedding: Tensor, *, timer=None) -> Tensor | None:
    """The mel [1, 80, T - Tf] (prompt frames dropped, as ``FlowCondition.crop``) of one non-final streaming
    chunk (``streaming=True, finalize=False``; ``token`` [1, Ts] ends with the look-ahead tokens), computed from
    ``state`` and extending it. Returns ``None`` when the chunk must take the recompute path (the cap, or a
    stream that fell back before); the state is then dropped. ``timer``: a ``StageTimer`` (``flow.encoder``,
    ``flow.solver``) or None.
    """
    if not state.active:
        return None
    p_len, ratio = flow.pre_lookahead_len, flow.token_mel_ratio
    tokens = torch.cat([prompt_token, token], dim=1)
    n = tokens.shape[1] - p_len
    enc_chunk, est_chunk = flow.encoder.static_chunk_size, flow.decoder.estimator.static_chunk_size
    aligned = state.tokens % enc_chunk == 0 and (ratio * state.tokens) % est_chunk == 0
    if not aligned or state.tokens > n:
        state.reset()  # a misaligned (or foreign) previous end: recompute this chunk from the first frame
    start = state.tokens
    if state.nbytes() + (n - start) * cache_bytes_per_frame(flow.config) * ratio > state.max_cache_bytes:
        state.reset()
        state.active = False
        return None

    lo, hi = ratio * start, ratio * n
    tf = prompt_feat.shape[1]
    if tf > hi:
        raise ValueError("prompt_feat is longer than the mel frames of prompt + source tokens")
    with _stage(timer, "flow.encoder"):
        spks = flow.speaker_projection(embedding)
        emb = flow.input_embedding(tokens.clamp(min=0).long())
        h = encoder_chunk(flow.encoder, state.encoder, emb[:, :n], start, emb[:, n:])
        mu = flow.encoder_proj(h).transpose(1, 2)  # [1, 80, frames]
        frames = torch.arange(lo, hi, device=mu.device)
        feat = F.pad(prompt_feat.transpose(1, 2).to(mu.dtype), (0, max(hi - tf, 0)))[:, :, lo:hi]
        cond = torch.where((frames < tf).view(1, 1, -1), feat, torch.zeros((), dtype=mu.dtype, device=mu.device))

    decoder = flow.decoder
    with _stage(timer, "flow.solver"):
        mel = decoder(mu, torch.ones_like(mu[:, :1]), spks, cond, streaming=True,
                      noise=decoder.noise(hi)[:, :, lo:], estimator_fn=_cached_steps(decoder, state, lo))
    state.mel = mel if state.mel is None else torch.cat([state.mel, mel], dim=-1)
    state.tokens = n
    return state.mel[:, :, tf:]


def window_chunk(flow: CausalMaskedDiffWithXvec, state: FlowStreamState, token: Tensor, prompt_token: Tensor,
                 prompt_feat: Tensor, embedding: Tensor, *, context_tokens: int) -> Tensor | None:
    """A live chunk's mel [1, 80, frames] of its new tokens only (prompt frames dropped), from ``state``, which then
    forgets every frame the next chunk will not see: live conversion with a bounded flow window, cached.

    ``token`` [1, m]: the chunk's new source tokens then the look-ahead ones (on the first call the prompt tokens
    come before them, from ``prompt_token``). The next chunk's frames see the prompt's attention chunks and the
    chunks from ``(end - context_tokens)`` on, rounded down to a 25-token chunk (``end``: the chunk's last token, as
    the sliding window of :mod:`cosyvoice_triton.serving.stages.live_vc` counts it); their relative positions are
    those of the keys kept, in order, without the gap. Unlike that window, which recomputes every frame of it
    against the window's first token, a frame here is computed once, when it is new, with the keys then visible,
    so it is final: each chunk costs only its own frames, however long the stream. The noise is the official
    buffer indexed by frame, wrapping around after its end.

    Returns None (and the state stops: ``active`` False) when the chunk does not start and end on the attention
    chunks (25 tokens, 50 mel frames): the caller recomputes instead.
    """
    if not state.active:
        return None
    p_len, ratio = flow.pre_lookahead_len, flow.token_mel_ratio
    enc_chunk, est_chunk = flow.encoder.static_chunk_size, flow.decoder.estimator.static_chunk_size
    start = state.tokens
    if start == 0:
        tokens, emb_start = torch.cat([prompt_token, token], dim=1), 0
    else:
        tokens, emb_start = torch.cat([state.recent, token], dim=1), start - state.recent.shape[1]
    settled = tokens.shape[1] - p_len
    n = emb_start + settled
    if n <= start or any(x % enc_chunk or (ratio * x) % est_chunk for x in (start, n)) or settled < 2:
        state.reset()
        state.active = False
        return None
    lo, hi = ratio * start, ratio * n
    tf = prompt_feat.shape[1]
    spks = flow.speaker_projection(embedding)
    emb = flow.input_embedding(tokens.clamp(min=0).long())
    h = encoder_chunk(flow.encoder, state.encoder, emb[:, :settled], start, emb[:, settled:], emb_start=emb_start)
    mu = flow.encoder_proj(h).transpose(1, 2)  # [1, 80, hi - lo]
    cond = torch.zeros_like(mu)
    if lo < tf:
        cond[:, :, : min(tf, hi) - lo] = prompt_feat[:, lo: min(tf, hi)].transpose(1, 2).to(mu.dtype)
    decoder = flow.decoder
    buffer = decoder.rand_noise
    noise = buffer[:, :, torch.arange(lo, hi, device=buffer.device) % buffer.shape[-1]]
    mel = decoder(mu, torch.ones_like(mu[:, :1]), spks, cond, streaming=True, noise=noise,
                  estimator_fn=_cached_steps(decoder, state, lo))
    state.tokens, state.recent = n, tokens[:, settled - 2: settled]
    # what the next chunk sees: the prompt's chunks and the window before its first token
    prompt_end = -(-prompt_token.shape[1] // enc_chunk) * enc_chunk
    window = max(0, (n - context_tokens) // enc_chunk * enc_chunk)
    low, high = state.encoder
    for cache, rate in ((low, 1), (high, ratio), *((c, ratio) for c in state.steps)):
        pos = cache.positions
        cache.keep((pos < rate * prompt_end) | (pos >= rate * window))
    return mel[:, :, max(tf - lo, 0):]
