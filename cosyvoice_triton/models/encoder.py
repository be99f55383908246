"""``UpsampleConformerEncoder``: the token encoder of the CosyVoice2 flow (inference only).

Token embeddings [B, T, 512] go through

    embed (Linear + LayerNorm 1e-5, x*sqrt(d), ESPnet rel-pos) -> PreLookaheadLayer -> N conformer layers
    -> Upsample1D (nearest x2, causal conv k5) -> up_embed -> 4 conformer layers -> after_norm (1e-5)

and come out at twice the frame rate, [B, 2T, 512]. Attribute names reproduce the official state_dict keys
(``cosyvoice/transformer/upsample_encoder.py``), so a release ``flow.pt``'s ``encoder.*`` tensors load with
``strict=True``. Dropout layers have no parameters and are left out.

Masking as in the official module, and two deliberate extensions for batched serving:

* **Masks.** Attention keys are limited to each item's valid frames. With ``streaming`` on, each query also
  sees only frames up to the end of its own chunk (``static_chunk_size`` frames before the upsample,
  ``static_chunk_size * upsample_stride`` after it, every left chunk). ``streaming`` may be a Python bool, a
  0-d bool tensor or a [B] bool tensor (one flag per item); both masks are built and one is picked with a
  tensor op, so an exported graph can take ``streaming`` as an input.
* **Padding (extension).** The official encoder lets the PreLookaheadLayer of a padded item read the
  embedded padding frames (``embed(0)`` is not zero), so a batched item differs from the same item run
  alone. Here the frames beyond ``xs_lens`` are zeroed before the look-ahead convolution, and a right
  ``context`` is placed right after each item's valid frames. A batched item then equals its solo run; for
  unpadded input the result is the official one.
* **``context_lens`` (extension).** Optional [B] count of valid context frames per item (0 means "no
  context, zero look-ahead" as with ``finalize=True``), so that one graph with a fixed-size context input
  serves finalizing and non-finalizing requests in the same batch.

``xs_lens`` larger than T is allowed and means "all T frames are valid": the official flow passes the token
count that still includes the look-ahead context when ``finalize=False``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_triton.config import EncoderConfig

__all__ = [
    "ConformerEncoderLayer",
    "LinearEmbed",
    "PositionwiseFeedForward",
    "PreLookaheadLayer",
    "RelPositionMultiHeadedAttention",
    "RelPositionalEncoding",
    "Upsample1D",
    "UpsampleConformerEncoder",
    "chunk_attention_mask",
]


def chunk_attention_mask(valid: Tensor, chunk_size: int, streaming: Tensor) -> Tensor:
    """Self-attention mask [B, T, T] (True = may attend) from the key padding mask ``valid`` [B, T].

    ``streaming`` (0-d bool tensor, or [B] for a per-item choice) adds the chunk-causal limit: query i sees
    the keys j < (i // chunk + 1) * chunk, i.e. its own chunk and every chunk to its left.
    """
    pos = torch.arange(valid.size(1), device=valid.device)
    chunk_end = (pos // chunk_size + 1) * chunk_size
    causal = (pos.unsqueeze(0) < chunk_end.unsqueeze(1)) | ~streaming.reshape(-1, 1, 1)  # [1 or B, T, T]
    return valid.unsqueeze(1) & causal


class RelPositionalEncoding(nn.Module):
    """ESPnet relative positional encoding (``rel_pos_espnet``), computed for the length at hand.

    ``forward(x [B, T, D]) -> (x * sqrt(D), pos_emb [1, 2T-1, D])``; row k of ``pos_emb`` encodes the relative
    position T-1-k (from T-1 down to -(T-1)) as interleaved sin/cos. No table, no state_dict entry.
    """

    def __init__(self, d_model: int):
        super().__init__()
        self.xscale = math.sqrt(d_model)
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(1e4) / d_model))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        t = x.size(1)
        rel = torch.arange(t - 1, -t, -1, device=x.device, dtype=torch.float32)  # [2T-1]
        angle = rel.unsqueeze(1) * self.inv_freq  # [2T-1, D/2]
        pos_emb = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).flatten(1)  # [2T-1, D]
        return x * self.xscale, pos_emb.unsqueeze(0).to(x.dtype)


class LinearEmbed(nn.Module):
    """``LinearNoSubsampling``: ``out`` = Linear + LayerNorm(eps 1e-5), then the rel-pos encoding.

    ``forward(x [B, T, idim]) -> (x [B, T, odim] scaled by sqrt(odim), pos_emb [1, 2T-1, odim])``.
    """

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.pos_enc = RelPositionalEncoding(odim)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.pos_enc(self.out(x))


class RelPositionMultiHeadedAttention(nn.Module):
    """Transformer-XL style self-attention with relative positions (``rel_selfattn``).

    scores = ((q + u) k^T + rel_shift((q + v) p^T)) / sqrt(d_k), with p = linear_pos(pos_emb) (no bias).
    """

    def __init__(self, n_head: int, n_feat: int):
        super().__init__()
        assert n_feat % n_head == 0, "n_feat must be divisible by n_head"
        self.h, self.d_k = n_head, n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    @staticmethod
    def rel_shift(x: Tensor) -> Tensor:
        """[B, H, T, 2T-1] scores against ``pos_emb`` rows -> [B, H, T, T] with out[i, j] = x[i, T-1-i+j],
        i.e. the score for relative position i - j (pad one zero column, refold, drop the first row)."""
        b, h, t, n = x.shape
        x = F.pad(x, (1, 0)).reshape(b, h, n + 1, t)[:, :, 1:]
        return x.reshape(b, h, t, n)[..., :t]

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor) -> Tensor:
        """x [B, T, D], mask [B, T, T] bool (True = attend), pos_emb [1, 2T-1, D] -> [B, T, D]."""
        b = x.size(0)
        q = self.linear_q(x).view(b, -1, self.h, self.d_k)  # [B, T, H, dk]
        k = self.linear_k(x).view(b, -1, self.h, self.d_k).transpose(1, 2)  # [B, H, T, dk]
        v = self.linear_v(x).view(b, -1, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)  # [1, H, 2T-1, dk]
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        bd = self.rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (ac + bd) / math.sqrt(self.d_k)  # [B, H, T, T]
        blocked = ~mask.unsqueeze(1)
        attn = torch.softmax(scores.masked_fill(blocked, -float("inf")), dim=-1).masked_fill(blocked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(out)


class PositionwiseFeedForward(nn.Module):
    """w_2(SiLU(w_1(x))), applied per frame."""

    def __init__(self, idim: int, hidden_units: int):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerEncoderLayer(nn.Module):
    """Pre-norm block without macaron FFN or conv module: x += MHA(LN(x)); x += FFN(LN(x)).

    Both LayerNorms use eps 1e-12 (the official value, unlike the 1e-5 of the embeds and ``after_norm``).
    """

    def __init__(self, size: int, n_head: int, linear_units: int):
        super().__init__()
        self.self_attn = RelPositionMultiHeadedAttention(n_head, size)
        self.feed_forward = PositionwiseFeedForward(size, linear_units)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor) -> Tensor:
        """x [B, T, D], mask [B, T, T], pos_emb [1, 2T-1, D] -> [B, T, D]."""
        x = x + self.self_attn(self.norm_mha(x), mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """Look ``pre_lookahead_len`` (P) frames ahead, then a causal conv, plus the residual.

    conv1 (kernel P+1) runs on the input followed by P right frames (the context, else zeros);
    leaky_relu(0.01); conv2 (kernel 3) after 2 zero frames on the left.
    """

    def __init__(self, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: Tensor, valid: Tensor, context: Tensor | None = None,
                context_valid: Tensor | None = None) -> Tensor:
        """x [B, T, D], valid [B, T] bool, context [B, P, D] (embedded), context_valid [B, P] -> [B, T, D].

        Frames of ``x`` beyond each item's valid length are zeroed, and the item's context frames are
        placed right after its last valid frame, so padding never leaks into the look-ahead.
        """
        p = self.pre_lookahead_len
        ext = F.pad(x * valid.unsqueeze(-1).to(x.dtype), (0, 0, 0, p))  # [B, T+P, D]
        if context is not None:
            if context_valid is not None:
                context = context * context_valid.unsqueeze(-1).to(context.dtype)
            # one-hot placement: frame t of item b takes context row t - len_b when that is in [0, P)
            t_ext = torch.arange(ext.size(1), device=x.device)
            offset = t_ext.unsqueeze(0) - valid.sum(1, keepdim=True)  # [B, T+P]
            rows = torch.arange(p, device=x.device)
            place = (offset.unsqueeze(-1) == rows).to(context.dtype)  # [B, T+P, P]
            ext = ext + torch.matmul(place, context)
        y = F.leaky_relu(self.conv1(ext.transpose(1, 2)), 0.01)
        y = self.conv2(F.pad(y, (2, 0)))
        return y.transpose(1, 2) + x


class Upsample1D(nn.Module):
    """Nearest x``stride`` in time, ``2*stride`` zero frames on the left, conv kernel ``2*stride+1``.

    ``forward(x [B, C, T]) -> [B, C, stride*T]``; output frame t depends only on input frames <= t // stride.
    """

    def __init__(self, channels: int, stride: int = 2):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, kernel_size=2 * stride + 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(x, (2 * self.stride, 0)))


class UpsampleConformerEncoder(nn.Module):
    """CosyVoice2 flow encoder; see the module docstring for the masking and padding rules."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        d = config.output_size
        self.config = config
        self.static_chunk_size = config.static_chunk_size
        self.embed = LinearEmbed(config.input_size, d)
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(d, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerEncoderLayer(d, config.attention_heads, config.linear_units)
            for _ in range(config.num_blocks)
        )
        self.up_layer = Upsample1D(d, config.upsample_stride)
        self.up_embed = LinearEmbed(d, d)
        self.up_encoders = nn.ModuleList(
            ConformerEncoderLayer(d, config.attention_heads, config.linear_units)
            for _ in range(config.num_up_blocks)
        )

    def forward(
        self,
        xs: Tensor,
        xs_lens: Tensor,
        context: Tensor | None = None,
        streaming: bool | Tensor = False,
        context_lens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Encode token embeddings.

        Args:
            xs: [B, T, input_size] token embeddings (look-ahead frames already split off into ``context``).
            xs_lens: [B] int valid frames per item; values >= T mean all T frames (the official flow passes
                the count that includes the context).
            context: None, or [B, C, input_size] raw embeddings of the C <= P look-ahead tokens that follow
                each item's valid frames (``finalize=False``); missing frames are zeros (the official pad).
            streaming: Python bool, 0-d or [B] bool tensor: chunk-causal attention on top of the padding mask.
            context_lens: None, or [B] int number of valid context frames per item (0 = none).

        Returns:
            encoder_out [B, stride*T, output_size] (frames past ``stride*xs_lens`` are finite but meaningless)
            and encoder_mask [B, 1, stride*T] bool, True on the valid frames.
        """
        stride = self.up_layer.stride
        if not isinstance(streaming, Tensor):
            streaming = torch.tensor(bool(streaming))
        streaming = streaming.to(device=xs.device, dtype=torch.bool)
        xs_lens = xs_lens.to(device=xs.device, dtype=torch.int64).view(-1, 1)

        valid = torch.arange(xs.size(1), device=xs.device).unsqueeze(0) < xs_lens  # [B, T]
        x, pos_emb = self.embed(xs)
        p = self.pre_lookahead_layer.pre_lookahead_len
        if context is not None and not torch.jit.is_tracing():  # a traced graph keeps its context size
            if context.size(1) == 0:  # the official "no context" default is torch.zeros(0, 0, 0)
                context = None
            elif context.size(1) > p:
                raise ValueError(f"context has {context.size(1)} frames, at most {p} allowed")
        context_valid = None
        if context is not None:
            context, _ = self.embed(context)  # rel-pos adds nothing to x: only the Linear+LN and the scale
            context = F.pad(context, (0, 0, 0, p - context.size(1)))
            if context_lens is not None:
                rows = torch.arange(p, device=xs.device).unsqueeze(0)
                context_valid = rows < context_lens.to(device=xs.device, dtype=torch.int64).view(-1, 1)
        x = self.pre_lookahead_layer(x, valid, context, context_valid)
        mask = chunk_attention_mask(valid, self.static_chunk_size, streaming)
        for layer in self.encoders:
            x = layer(x, mask, pos_emb)

        # contiguous() as the official code does: the up_embed Linear rounds differently on a strided input, and
        # HiFT's phase accumulation amplifies that ~3000x in the waveform.
        x = self.up_layer(x.transpose(1, 2).contiguous()).transpose(1, 2).contiguous()  # [B, stride*T, D]
        valid = torch.arange(x.size(1), device=xs.device).unsqueeze(0) < xs_lens * stride
        x, pos_emb = self.up_embed(x)
        mask = chunk_attention_mask(valid, self.static_chunk_size * stride, streaming)
        for layer in self.up_encoders:
            x = layer(x, mask, pos_emb)
        return self.after_norm(x), valid.unsqueeze(1)
