"""The velocity estimator of the CosyVoice3 flow: a diffusion transformer (``DiT``, F5-TTS style).

``v(x, t | mu, spks, cond)`` for x, mu, cond [B, 80, T]: the four inputs are concatenated per frame and
projected to ``dim``, a causal grouped-conv position embedding is added, then ``depth`` blocks of
AdaLN-Zero self-attention + feed-forward modulated by the time embedding, a final AdaLN and a projection
back to 80 channels. Module attribute names give exactly the official state_dict keys
(``time_embed.time_mlp.0``, ``input_embed.conv_pos_embed.conv1.0``, ``transformer_blocks.3.attn.to_q``,
``transformer_blocks.3.ff.ff.0.0``, ``rotary_embed.inv_freq``, ...), so ``decoder.estimator.*`` of a
release ``flow.pt`` loads with ``strict=True``.

Semantics reproduced from the official code, quirks included:

- Rotary position embedding with interleaved pairs (``x[2i], x[2i+1]`` rotate together by ``t * inv_freq[i]``)
  applied to the first ``dim_head`` channels of the projected queries and keys *before* they are split into
  heads: only head 0 is rotated, the other heads see no position except through the conv embedding.
  ``inv_freq`` is a persistent buffer, so the value in ``flow.pt`` is the one used.
- The attention mask is boolean: keys outside the frame mask are hidden, and when ``streaming`` keys in
  chunks of ``static_chunk_size`` frames to the right of the query's chunk too (all left chunks are seen).
  A query row that would see no key sees every key (an all-padding item). The attention output is zeroed at
  the frames hidden from the last query row, i.e. the padding.
- The output is not masked: padded frames carry values, which never reach valid frames (the conv is causal,
  attention hides padded keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..estimator import chunk_causal_mask, sinusoidal_embedding


@dataclass(frozen=True)
class DiTDims:
    """The ``estimator`` section of ``cosyvoice3.yaml`` (``full()``) and a small one of the same structure."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # chunk_size (25 tokens) * token_mel_ratio
    num_decoding_left_chunks: int = -1  # all left chunks (the only mode the official mask implements)
    time_freq_dim: int = 256  # the sinusoidal embedding's width (TimestepEmbedding's default)
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16

    @classmethod
    def full(cls) -> DiTDims:
        return cls()

    @classmethod
    def tiny(cls) -> DiTDims:
        """64 wide, 2 blocks, 4 heads of 16: every tensor at the interfaces has its full shape."""
        return cls(dim=64, depth=2, heads=4, dim_head=16)


def rotary_inv_freq(dim_head: int, base: float = 10000.0) -> Tensor:
    """[dim_head/2] ``1 / base^(2i/dim_head)``, the release's buffer (x-transformers' ``RotaryEmbedding``)."""
    return 1.0 / (base ** (torch.arange(0, dim_head, 2).float() / dim_head))


def rotate_pairs(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)`` over the last axis (interleaved pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of x [B, T, C] by the angles freqs [1, T, R]; the other
    channels pass unchanged."""
    r = freqs.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * freqs.cos() + rotate_pairs(rot) * freqs.sin()
    return torch.cat((rot, rest), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` [dim_head/2] (a state_dict entry); ``forward(T)`` -> angles [1, T, dim_head],
    each frequency repeated for its pair: ``[t f0, t f0, t f1, t f1, ...]``."""

    inv_freq: Tensor

    def __init__(self, dim_head: int):
        super().__init__()
        self.register_buffer("inv_freq", rotary_inv_freq(dim_head))

    def forward(self, seq_len: int) -> Tensor:
        t = torch.arange(seq_len, device=self.inv_freq.device).to(self.inv_freq.dtype)
        freqs = t.reshape(1, -1, 1) * self.inv_freq
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)


def layer_norm(x: Tensor) -> Tensor:
    """Affine-free LayerNorm over the last axis, eps 1e-6; the width is read as a Python int so that an ONNX trace
    keeps it constant (a traced ``x.shape[-1:]`` is not)."""
    return F.layer_norm(x, (int(x.shape[-1]),), eps=1e-6)


class TimestepEmbedding(nn.Module):
    """t [B] -> [B, dim]: the sinusoidal embedding (width ``freq_dim``, scale 1000), then Linear-SiLU-Linear."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(sinusoidal_embedding(t, self.freq_dim))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convs (kernel k, ``k - 1`` zeros of left padding each) with Mish: [B, T, D] -> [B, T, D]."""

    def __init__(self, dim: int, kernel_size: int = 31, groups: int = 16):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: Tensor) -> Tensor:
        pad = (self.kernel_size - 1, 0)
        h = self.conv1(F.pad(x.transpose(1, 2), pad))
        return self.conv2(F.pad(h, pad)).transpose(1, 2)


class InputEmbedding(nn.Module):
    """``h = proj([x, cond, mu, spks])`` per frame, then ``h + conv_pos_embed(h)``: -> [B, T, dim]."""

    def __init__(self, d: DiTDims):
        super().__init__()
        self.proj = nn.Linear(2 * d.mel_dim + d.mu_dim + d.spk_dim, d.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(d.dim, d.conv_pos_kernel, d.conv_pos_groups)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        """x, cond, mu [B, T, 80], spks [B, 80]."""
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat([x, cond, mu, spks], dim=-1))
        return self.conv_pos_embed(h) + h


class AdaLayerNormZero(nn.Module):
    """``Linear(SiLU(t_emb))`` -> 6 modulations; returns the modulated LayerNorm of x (affine-free, eps 1e-6)
    for attention and the gate / shift / scale / gate the block uses after it."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, x: Tensor, t_emb: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        shift, scale, gate, shift_ff, scale_ff, gate_ff = self.linear(F.silu(t_emb)).chunk(6, dim=1)
        x = layer_norm(x) * (1 + scale[:, None]) + shift[:, None]
        return x, gate, shift_ff, scale_ff, gate_ff


class AdaLayerNormFinal(nn.Module):
    """The output modulation: ``LayerNorm(x) * (1 + scale) + shift`` with ``(scale, shift) = Linear(SiLU(t_emb))``
    (in that order, unlike the blocks)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, t_emb: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(t_emb)).chunk(2, dim=1)
        return layer_norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class FeedForward(nn.Module):
    """``Linear(GELU_tanh(Linear(x)))``, dim -> ``ff_mult`` dim -> dim (``ff.1`` is the inference no-op dropout)."""

    def __init__(self, dim: int, mult: int):
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(),
                                nn.Linear(inner, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class Attention(nn.Module):
    """Self-attention with biased q/k/v projections, rotary on the first ``dim_head`` channels of q and k,
    SDPA with a boolean mask, the output projection, and zeros at the frames the mask's last row hides."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])

    def forward(self, x: Tensor, allowed: Tensor, freqs: Tensor) -> Tensor:
        """x [B, T, D], allowed [B, 1, T, T] bool (query row, key column), freqs [1, T, dim_head] -> [B, T, D]."""
        b = x.shape[0]
        q = apply_rotary(self.to_q(x), freqs)
        k = apply_rotary(self.to_k(x), freqs)
        v = self.to_v(x)
        q, k, v = (y.view(b, -1, self.heads, y.shape[-1] // self.heads).transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=0.0, is_causal=False)
        out = self.to_out[0](out.transpose(1, 2).reshape(b, -1, q.shape[1] * q.shape[-1]))
        return out.masked_fill(~allowed[:, 0, -1].unsqueeze(-1), 0.0)


class DiTBlock(nn.Module):
    """``x += gate * attn(AdaLN(x)); x += gate_ff * ff(LN(x) * (1 + scale_ff) + shift_ff)``."""

    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff = FeedForward(dim, ff_mult)

    def forward(self, x: Tensor, t_emb: Tensor, allowed: Tensor, freqs: Tensor) -> Tensor:
        norm, gate, shift_ff, scale_ff, gate_ff = self.attn_norm(x, t_emb)
        x = x + gate.unsqueeze(1) * self.attn(norm, allowed, freqs)
        norm = layer_norm(x) * (1 + scale_ff[:, None]) + shift_ff[:, None]
        return x + gate_ff.unsqueeze(1) * self.ff(norm)


class DiT(nn.Module):
    """Velocity estimator of the CosyVoice3 flow (the flow's ``decoder.estimator``); inference only."""

    def __init__(self, dims: DiTDims | None = None):
        super().__init__()
        self.dims = d = dims or DiTDims()
        self.static_chunk_size = d.static_chunk_size
        self.time_embed = TimestepEmbedding(d.dim, d.time_freq_dim)
        self.input_embed = InputEmbedding(d)
        self.rotary_embed = RotaryEmbedding(d.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(d.dim, d.heads, d.dim_head, d.ff_mult)
                                                for _ in range(d.depth))
        self.norm_out = AdaLayerNormFinal(d.dim)
        self.proj_out = nn.Linear(d.dim, d.mel_dim)

    def attention_mask(self, mask: Tensor, streaming: bool | Tensor) -> Tensor:
        """mask [B, 1, T] -> allowed [B, 1, T, T] bool (query row, key column).

        ``streaming``: a bool, a 0-d bool tensor, or a [B] bool tensor (one choice per row) adds the chunk-causal
        limit. A row that would see no key sees all (as the official ``add_optional_chunk_mask`` forces it).
        """
        t = mask.shape[-1]
        allowed = mask.bool().expand(-1, t, -1)
        if isinstance(streaming, Tensor) or streaming:
            chunk = chunk_causal_mask(t, self.static_chunk_size, mask.device)
            if isinstance(streaming, Tensor):
                chunk = chunk | ~streaming.bool().reshape(-1, 1, 1)
            allowed = allowed & chunk
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        return allowed.unsqueeze(1).contiguous()

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool | Tensor = False) -> Tensor:
        """x, mu, cond [B, 80, T], mask [B, 1, T] (1 valid / 0 pad), t [B] or 0-d, spks [B, 80] -> [B, 80, T]."""
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)
        if t.ndim == 0:
            t = t.repeat(x.shape[0])
        t_emb = self.time_embed(t)
        h = self.input_embed(x, cond, mu, spks)
        freqs = self.rotary_embed(x.shape[1])
        allowed = self.attention_mask(mask, streaming)
        for block in self.transformer_blocks:
            h = block(h, t_emb, allowed, freqs)
        return self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)
