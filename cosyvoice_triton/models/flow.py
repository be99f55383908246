"""CosyVoice2's token-to-mel flow (``CausalMaskedDiffWithXvec``), batched over padded utterances.

One call of :meth:`CausalMaskedDiffWithXvec.inference` with B = 1 reproduces the official
``flow.inference``. With B > 1, every item gets the result it would get alone (the encoder masks padding
before its look-ahead, the estimator is causal and masked, each item takes its own prefix of the noise).

The work is split so that a server can put the pieces on different models: :meth:`condition` (token
embedding, speaker projection, encoder, ``encoder_proj``, prompt conditioning) produces a
:class:`FlowCondition`; ``decoder`` (the CFM solver) turns it into mel; :meth:`FlowCondition.crop` removes the
prompt part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import FlowConfig
from .cfm import CausalConditionalCFM, EstimatorFn
from .encoder import UpsampleConformerEncoder
from .estimator import CausalConditionalDecoder


def _lengths(x: Tensor | None, like: Tensor) -> Tensor:
    """[B] int64 lengths; ``None`` means every item uses the whole time axis of ``like`` [B, T, ...]."""
    if x is None:
        return torch.full((like.shape[0],), like.shape[1], dtype=torch.int64, device=like.device)
    return x.to(device=like.device, dtype=torch.int64).reshape(-1)


def concat_padded(a: Tensor, a_len: Tensor, b: Tensor, b_len: Tensor) -> tuple[Tensor, Tensor]:
    """Per item, ``cat([a[i, :a_len[i]], b[i, :b_len[i]]])``, right-padded with zeros.

    a [B, Ta, ...], b [B, Tb, ...] -> ([B, max(a_len + b_len), ...], [B] lengths).
    """
    lens = a_len + b_len
    out = a.new_zeros((a.shape[0], int(lens.max()), *a.shape[2:]))
    for i, (na, nb) in enumerate(zip(a_len.tolist(), b_len.tolist(), strict=True)):
        out[i, :na] = a[i, :na]
        out[i, na : na + nb] = b[i, :nb]
    return out, lens


@dataclass
class FlowCondition:
    """Everything the CFM solver needs, for B padded items (T = max mel frames of the batch).

    mu [B, 80, T], mask [B, 1, T] float, spks [B, 80], cond [B, 80, T] (prompt mel, zeros after it),
    mel_len [B] (T_h per item), prompt_mel_len [B] (Tf per item).
    """

    mu: Tensor
    mask: Tensor
    spks: Tensor
    cond: Tensor
    mel_len: Tensor
    prompt_mel_len: Tensor

    def crop(self, mel: Tensor) -> tuple[Tensor, Tensor]:
        """Drop each item's prompt frames: mel [B, 80, T] -> ([B, 80, max(T_h - Tf)], [B] lengths)."""
        out_len = self.mel_len - self.prompt_mel_len
        t = int(out_len.max()) if out_len.numel() else 0
        idx = (torch.arange(t, device=mel.device).unsqueeze(0) + self.prompt_mel_len.unsqueeze(1))
        idx = idx.clamp(max=mel.shape[-1] - 1)
        out = torch.gather(mel, 2, idx.unsqueeze(1).expand(-1, mel.shape[1], -1))
        keep = torch.arange(t, device=mel.device).unsqueeze(0) < out_len.unsqueeze(1)
        return out * keep.unsqueeze(1), out_len


class CausalMaskedDiffWithXvec(nn.Module):
    """The flow of ``flow.pt``: module names give exactly the official state_dict keys."""

    def __init__(self, config: FlowConfig | None = None):
        super().__init__()
        self.config = config = config or FlowConfig()
        self.token_mel_ratio = config.token_mel_ratio
        self.pre_lookahead_len = config.pre_lookahead_len
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.encoder = UpsampleConformerEncoder(config.encoder)
        self.encoder_proj = nn.Linear(config.encoder.output_size, config.output_size)
        self.decoder = CausalConditionalCFM(CausalConditionalDecoder(config.estimator), config.cfm)

    def speaker_projection(self, embedding: Tensor) -> Tensor:
        """[B, 192] speaker embedding -> [B, 80] ``spks`` (L2-normalised, then the affine layer)."""
        return self.spk_embed_affine_layer(F.normalize(embedding.float(), dim=1))

    def condition(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        token_len: Tensor | None = None,
        prompt_token_len: Tensor | None = None,
        prompt_feat_len: Tensor | None = None,
        streaming: bool | Tensor = False,
        finalize: bool = True,
    ) -> FlowCondition:
        """Encoder side of the flow.

        Args:
            token: [B, Ts] int source speech tokens (25 Hz); ``token_len`` [B] valid counts (default: all).
            prompt_token: [B, Tp] int prompt speech tokens; ``prompt_token_len`` [B].
            prompt_feat: [B, Tf, 80] prompt mel (the 24 kHz CosyVoice mel); ``prompt_feat_len`` [B].
            embedding: [B, 192] CAM++ speaker embedding (not yet normalised).
            streaming: chunk-causal attention in the encoder (and, later, in the estimator).
            finalize: False for a streaming chunk whose last ``pre_lookahead_len`` tokens are only look-ahead.
        """
        spks = self.speaker_projection(embedding)
        token_len = _lengths(token_len, token)
        prompt_token_len = _lengths(prompt_token_len, prompt_token)
        prompt_feat_len = _lengths(prompt_feat_len, prompt_feat)

        tokens, lens = concat_padded(prompt_token, prompt_token_len, token, token_len)
        valid = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < lens.unsqueeze(1)
        emb = self.input_embedding(tokens.clamp(min=0).long()) * valid.unsqueeze(-1).to(spks.dtype)

        context = context_lens = None
        if not finalize:
            p = self.pre_lookahead_len
            if int(lens.min()) <= p:
                raise ValueError(f"finalize=False needs more than {p} tokens per item")
            lens = lens - p
            idx = (lens.unsqueeze(1) + torch.arange(p, device=emb.device).unsqueeze(0))  # [B, p]
            context = torch.gather(emb, 1, idx.unsqueeze(-1).expand(-1, -1, emb.shape[-1]))
            context_lens = torch.full_like(lens, p)
            emb = emb[:, : int(lens.max())] * (
                torch.arange(int(lens.max()), device=emb.device).unsqueeze(0) < lens.unsqueeze(1)
            ).unsqueeze(-1).to(emb.dtype)

        h, h_mask = self.encoder(emb, lens, context=context, streaming=streaming, context_lens=context_lens)
        mel_len = h_mask.squeeze(1).sum(-1)
        if bool((prompt_feat_len > mel_len).any()):
            raise ValueError("prompt_feat is longer than the mel frames of prompt + source tokens")
        mu = self.encoder_proj(h).transpose(1, 2)  # [B, 80, T]
        t = mu.shape[-1]
        mask = h_mask.to(mu.dtype)
        frames = torch.arange(t, device=mu.device).unsqueeze(0)
        in_prompt = (frames < prompt_feat_len.unsqueeze(1)).unsqueeze(1)  # [B, 1, T]
        feat = prompt_feat.transpose(1, 2).to(mu.dtype)
        feat = F.pad(feat, (0, max(t - feat.shape[-1], 0)))[:, :, :t]
        cond = torch.where(in_prompt, feat, torch.zeros((), dtype=mu.dtype, device=mu.device))
        return FlowCondition(mu=mu * mask, mask=mask, spks=spks, cond=cond, mel_len=mel_len,
                             prompt_mel_len=prompt_feat_len)

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        token_len: Tensor | None = None,
        prompt_token_len: Tensor | None = None,
        prompt_feat_len: Tensor | None = None,
        streaming: bool = False,
        finalize: bool = True,
        n_timesteps: int | None = None,
        noise: Tensor | None = None,
        estimator_fn: EstimatorFn | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Tokens to mel: ([B, 80, T_out] float32 without the prompt frames, [B] T_out per item).

        ``noise`` [B or 1, 80, T] replaces the official fixed noise; ``estimator_fn`` replaces the local
        estimator (an ONNX session, a remote model). See :meth:`condition` for the other arguments.
        """
        c = self.condition(token, prompt_token, prompt_feat, embedding, token_len=token_len,
                           prompt_token_len=prompt_token_len, prompt_feat_len=prompt_feat_len,
                           streaming=streaming, finalize=finalize)
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, n_timesteps=n_timesteps, streaming=streaming,
                           noise=noise, estimator_fn=estimator_fn)
        return c.crop(mel)
