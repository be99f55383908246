"""The flow-matching velocity estimator of CosyVoice2: ``CausalConditionalDecoder``.

A 1-D U-Net without resampling: one down block, ``num_mid_blocks`` mid blocks and one up block, each a causal
resnet block followed by transformer blocks. Module attribute names reproduce the official state_dict keys
(``time_mlp.linear_1``, ``down_blocks.0.0.block1.block.0``, ``mid_blocks.3.1.2.attn1.to_q``,
``ff.net.0.proj``, ...), so ``decoder.estimator.*`` of a release ``flow.pt`` loads with ``strict=True``.

Semantics follow the official code exactly (fp32 parity ~1e-6): every conv input is multiplied by the frame
mask, the attention mask is the key padding mask (ANDed with a chunk-causal mask when streaming) turned into
the additive bias ``(1 - m) * -1e10``, and query rows that would see no key at all see every key (the
official ``add_optional_chunk_mask`` fix-up, done here without a data-dependent branch). The estimator is
exportable with the legacy ONNX exporter; ``streaming`` may be a 0-d bool tensor so that one graph serves both
modes, or a [B] bool tensor so that one batch mixes them (one flag per row).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import EstimatorConfig
from ..errors import ConfigError

#: The official additive attention bias for masked keys. Exact in fp32 (``exp`` underflows to 0), but it is
#: ``-inf`` in fp16; pass ``mask_bias=-1e4`` (or ``torch.finfo(torch.float16).min``) for fp16 engines.
OFFICIAL_MASK_BIAS = -1.0e10


def sinusoidal_embedding(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """Matcha's ``SinusoidalPosEmb``: ``t`` [B] -> [B, dim] = ``[sin(s t f_i), cos(s t f_i)]``,
    ``f_i = exp(-i log(1e4) / (dim/2 - 1))``, computed in fp32 and cast back to ``t.dtype``."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000.0) / (half - 1)))
    arg = scale * t.reshape(-1, 1) * freqs.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1).to(t.dtype)


def chunk_causal_mask(size: int | Tensor, chunk: int, device: torch.device | None = None) -> Tensor:
    """[T, T] bool, ``[i, j] = j < (i // chunk + 1) * chunk``: every frame sees its own chunk and all chunks
    to its left (the official ONNX-friendly ``subsequent_chunk_mask``, which ignores a left-chunk limit)."""
    pos = torch.arange(size, device=device)
    end = (torch.div(pos, chunk, rounding_mode="floor") + 1) * chunk
    return pos.unsqueeze(0) < end.unsqueeze(1)


class _Transpose(nn.Module):
    """Swap the channel and time axes; parameterless, it only keeps the official ``block.N`` numbering."""

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class CausalConv1d(nn.Conv1d):
    """Stride-1 ``Conv1d`` with ``kernel_size - 1`` zeros of left padding: [B, Cin, T] -> [B, Cout, T]."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.causal_padding = kernel_size - 1

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class CausalBlock1D(nn.Module):
    """``Mish(LayerNorm_channels(CausalConv_k3(x * mask))) * mask``: [B, Cin, T] -> [B, Cout, T]."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out), _Transpose(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock1D(nn.Module):
    """``block2(block1(x) + Linear(Mish(t_emb))) + Conv1x1(x * mask)``: x [B, Cin, T], mask [B, 1, T],
    t_emb [B, E] -> [B, Cout, T]."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t_emb: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(t_emb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class TimestepEmbedding(nn.Module):
    """``Linear -> SiLU -> Linear``: [B, in] -> [B, dim]."""

    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(t)))


class Attention(nn.Module):
    """diffusers ``Attention`` as the estimator uses it: self-attention, no q/k/v bias, output projection
    with bias (``to_out.0``; ``to_out.1`` is the inference no-op dropout), SDPA with an additive bias."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """x [B, T, C], bias [B, 1, T or 1, T] (added to the scores, broadcast over heads) -> [B, T, C]."""
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class GELUProj(nn.Module):
    """diffusers ``GELU``: ``gelu(Linear(x))`` with the exact (erf) GELU."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    """``Linear(GELU(Linear(x)))``, dim -> 4 dim -> dim (``net.1`` is the inference no-op dropout)."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(GELUProj(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    """Matcha/diffusers pre-norm block: ``x += attn1(norm1(x)); x += ff(norm3(x))``. x [B, T, C]."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


class CausalConditionalDecoder(nn.Module):
    """Velocity estimator ``v(x, t | mu, spks, cond)`` of the CosyVoice2 flow.

    ``mask_bias`` is the additive score bias of masked keys. The default ``-1e10`` is the official value and
    is exact in fp32; it becomes ``-inf`` in fp16, which is still finite after softmax here (every row keeps
    at least one visible key) but is fragile in fp16 engines, so fp16 exports should pass ``-1e4``.
    Streaming attention sees all left chunks (``num_decoding_left_chunks`` is ignored, as officially).
    """

    def __init__(self, config: EstimatorConfig | None = None, mask_bias: float = OFFICIAL_MASK_BIAS):
        super().__init__()
        c = config or EstimatorConfig()
        if len(c.channels) != 1:
            raise ConfigError(f"estimator channels {c.channels}: only the single-level (no resampling) U-Net "
                              "of CosyVoice2 is supported")
        ch = c.channels[0]
        emb = 4 * ch
        self.in_channels = c.in_channels
        self.static_chunk_size = c.static_chunk_size
        self.mask_bias = mask_bias
        self.time_mlp = TimestepEmbedding(c.in_channels, emb)

        def stage(dim_in: int, tail: bool) -> nn.ModuleList:
            tfs = nn.ModuleList(BasicTransformerBlock(ch, c.num_heads, c.attention_head_dim)
                                for _ in range(c.n_blocks))
            mods = [CausalResnetBlock1D(dim_in, ch, emb), tfs]
            return nn.ModuleList([*mods, CausalConv1d(ch, ch, 3)] if tail else mods)

        self.down_blocks = nn.ModuleList([stage(c.in_channels, True)])
        self.mid_blocks = nn.ModuleList(stage(ch, False) for _ in range(c.num_mid_blocks))
        self.up_blocks = nn.ModuleList([stage(2 * ch, True)])
        self.final_block = CausalBlock1D(ch, ch)
        self.final_proj = nn.Conv1d(ch, c.out_channels, 1)

    def attention_bias(self, mask: Tensor, streaming: bool | Tensor, dtype: torch.dtype) -> Tensor:
        """mask [B, 1, T] -> additive bias [B, 1, T, T] ([B, 1, 1, T] for a Python ``streaming=False``).

        Keys outside the mask are hidden; with ``streaming`` (bool, 0-d bool tensor, or [B] bool tensor for a
        per-row choice) keys in chunks to the right of the query's chunk too. A query that would see no key
        sees all (only an all-padding item).
        """
        allowed = mask.bool()
        if isinstance(streaming, Tensor) or streaming:
            chunk = chunk_causal_mask(mask.shape[-1], self.static_chunk_size, mask.device)
            if isinstance(streaming, Tensor):
                chunk = chunk | ~streaming.bool().reshape(-1, 1, 1)  # [1 or B, T, T]
            allowed = allowed & chunk
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        return ((1.0 - allowed.to(dtype)) * self.mask_bias).unsqueeze(1)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool | Tensor = False) -> Tensor:
        """x, mu, cond [B, 80, T], mask [B, 1, T] (1 valid / 0 pad), t [B], spks [B, 80],
        streaming bool, 0-d or [B] bool tensor -> velocity [B, 80, T] (zero where ``mask`` is 0)."""
        t_emb = self.time_mlp(sinusoidal_embedding(t, self.in_channels))
        spks = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        h = torch.cat([x, mu, spks, cond], dim=1)
        bias = self.attention_bias(mask, streaming, h.dtype)

        def body(blocks: nn.ModuleList, h: Tensor) -> Tensor:  # resnet + transformers, [B, C, T]
            h = blocks[0](h, mask, t_emb).transpose(1, 2)
            for tf in blocks[1]:
                h = tf(h, bias)
            return h.transpose(1, 2)

        down, up = self.down_blocks[0], self.up_blocks[0]
        skip = body(down, h)
        h = down[2](skip * mask)
        for blocks in self.mid_blocks:
            h = body(blocks, h)
        h = up[2](body(up, torch.cat([h, skip], dim=1)) * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask
