"""CosyVoice3's token-to-mel flow (``CausalMaskedDiffWithDiT``), batched over padded utterances.

Speech tokens (prompt then source, 25 Hz) are embedded (80 wide), passed through a look-ahead conv layer
(``PreLookaheadLayer``, 80 -> 1024 -> 80 with a residual), repeated ``token_mel_ratio`` times in time: that is
``mu`` [B, 80, T]; ``cond`` holds the prompt mel on the prompt frames, ``spks`` the projected speaker embedding.
The CFM solver of CosyVoice2 (:mod:`..cfm`: the fixed noise ``randn`` under seed 0, cosine time grid, 10 Euler
steps, CFG 0.7) integrates the DiT estimator (:mod:`.dit`) from noise to mel; the prompt frames are cropped.

One call with B = 1 reproduces the official ``flow.inference``; with B > 1 every item gets what it would get
alone (embeddings are zero after each item's tokens, which is the official look-ahead padding; the estimator's
conv is causal and its attention hides padding; each item takes its own prefix of the noise).

Streaming (``CosyVoice3Model.token2wav``): a chunk is run with ``streaming=True, finalize=False`` on all
tokens so far, whose last ``pre_lookahead_len`` tokens are look-ahead only (they produce no frames); the
caller keeps the frames from ``token_offset * token_mel_ratio`` on. The last call is ``finalize=True`` and,
in the official ``tts``, ``streaming=False`` (its default).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...config import CFMConfig
from ...errors import CheckpointError
from ..cfm import CausalConditionalCFM, EstimatorFn
from ..checkpoint import read_state_dict
from ..flow import FlowCondition, _lengths, concat_padded
from .dit import DiT, DiTDims

log = logging.getLogger(__name__)

#: Keys of the CosyVoice2 flow absent from CosyVoice3's (its conformer encoder and U-Net estimator).
COSYVOICE2_FLOW_KEY = "encoder_proj.weight"


@dataclass(frozen=True)
class Flow3Dims:
    """The ``flow:`` section of ``cosyvoice3.yaml`` (``full()``), or a small one of the same structure."""

    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    dit: DiTDims = field(default_factory=DiTDims)
    cfm: CFMConfig = field(default_factory=CFMConfig)

    @classmethod
    def full(cls) -> Flow3Dims:
        return cls()

    @classmethod
    def tiny(cls) -> Flow3Dims:
        return cls(pre_lookahead_channels=64, dit=DiTDims.tiny())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Flow3Dims:
        d = dict(d)
        return cls(dit=DiTDims(**d.pop("dit", {})), cfm=CFMConfig(**d.pop("cfm", {})), **d)


class PreLookaheadLayer(nn.Module):
    """x [B, T, C] -> [B, T, C]: ``conv1`` (C -> channels, kernel P+1) over x followed by P zero frames, so frame t
    sees tokens t..t+P; leaky_relu(0.01); ``conv2`` (channels -> C, kernel 3) after 2 zero frames on the left
    (causal); plus x. With zeros after each item's tokens, a padded batch looks ahead as each item alone."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    def forward(self, x: Tensor) -> Tensor:
        y = F.leaky_relu(self.conv1(F.pad(x.transpose(1, 2), (0, self.pre_lookahead_len))))
        y = self.conv2(F.pad(y, (self.conv2.kernel_size[0] - 1, 0)))
        return y.transpose(1, 2) + x


class CausalMaskedDiffWithDiT(nn.Module):
    """The flow of CosyVoice3's ``flow.pt``: module names give exactly the official state_dict keys."""

    def __init__(self, dims: Flow3Dims | None = None):
        super().__init__()
        self.dims = d = dims or Flow3Dims()
        self.token_mel_ratio = d.token_mel_ratio
        self.pre_lookahead_len = d.pre_lookahead_len
        self.input_embedding = nn.Embedding(d.vocab_size, d.input_size)
        self.spk_embed_affine_layer = nn.Linear(d.spk_embed_dim, d.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(d.input_size, d.pre_lookahead_channels, d.pre_lookahead_len)
        self.decoder = CausalConditionalCFM(DiT(d.dit), d.cfm)
        #: an estimator that replaces the local DiT in every :meth:`inference` not given one (e.g. the served graph
        #: of :mod:`cosyvoice_triton.serving.stages.cosyvoice3_graphs`); None: the DiT above
        self.estimator_fn: EstimatorFn | None = None

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
        finalize: bool = True,
    ) -> FlowCondition:
        """Everything before the solver.

        Args:
            token: [B, Ts] int source speech tokens; ``token_len`` [B] valid counts (default: all).
            prompt_token: [B, Tp] int prompt speech tokens; ``prompt_token_len`` [B].
            prompt_feat: [B, Tf, 80] prompt mel; ``prompt_feat_len`` [B]. Its frames are the first of the output
                (the official code does not require Tf == ratio * Tp).
            embedding: [B, 192] speaker embedding (not yet normalised).
            finalize: False for a streaming chunk whose last ``pre_lookahead_len`` tokens are look-ahead only.
        """
        spks = self.speaker_projection(embedding)
        token_len = _lengths(token_len, token)
        prompt_token_len = _lengths(prompt_token_len, prompt_token)
        prompt_feat_len = _lengths(prompt_feat_len, prompt_feat)

        tokens, lens = concat_padded(prompt_token, prompt_token_len, token, token_len)
        valid = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < lens.unsqueeze(1)
        emb = self.input_embedding(tokens.clamp(min=0).long()) * valid.unsqueeze(-1).to(spks.dtype)
        h = self.pre_lookahead_layer(emb)
        if not finalize:
            p = self.pre_lookahead_len
            if int(lens.min()) <= p:
                raise ValueError(f"finalize=False needs more than {p} tokens per item (prompt + source)")
            lens = lens - p
            h = h[:, : int(lens.max())]
        h = h.repeat_interleave(self.token_mel_ratio, dim=1)
        mel_len = lens * self.token_mel_ratio
        if bool((prompt_feat_len > mel_len).any()):
            raise ValueError("prompt_feat is longer than the mel frames of prompt + source tokens")
        t = h.shape[1]
        frames = torch.arange(t, device=h.device).unsqueeze(0)
        mask = (frames < mel_len.unsqueeze(1)).unsqueeze(1).to(h.dtype)  # [B, 1, T]
        mu = h.transpose(1, 2) * mask
        in_prompt = (frames < prompt_feat_len.unsqueeze(1)).unsqueeze(1)
        feat = prompt_feat.transpose(1, 2).to(h.dtype)
        feat = F.pad(feat, (0, max(t - feat.shape[-1], 0)))[:, :, :t]
        cond = torch.where(in_prompt, feat, torch.zeros((), dtype=h.dtype, device=h.device))
        return FlowCondition(mu=mu, mask=mask, spks=spks, cond=cond, mel_len=mel_len, prompt_mel_len=prompt_feat_len)

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
        streaming: bool | Tensor = False,
        finalize: bool = True,
        n_timesteps: int | None = None,
        noise: Tensor | None = None,
        estimator_fn: EstimatorFn | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Tokens to mel: ([B, 80, T_out] float32 without the prompt frames, [B] T_out per item).

        ``streaming`` selects the estimator's chunk-causal attention (bool, or a [B] bool tensor per item);
        ``noise`` [B or 1, 80, T] replaces the official fixed noise; ``estimator_fn`` replaces the local estimator
        (default :attr:`estimator_fn`). See :meth:`condition` for the other arguments.
        """
        c = self.condition(token, prompt_token, prompt_feat, embedding, token_len=token_len,
                           prompt_token_len=prompt_token_len, prompt_feat_len=prompt_feat_len, finalize=finalize)
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, n_timesteps=n_timesteps, streaming=streaming,
                           noise=noise, estimator_fn=estimator_fn or self.estimator_fn)
        return c.crop(mel)


def check_state(module: nn.Module, state: dict[str, Tensor], path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the keys that ``module`` lacks, does not have, or holds in
    another shape; a CosyVoice2 flow is named as such."""
    if COSYVOICE2_FLOW_KEY in state:
        raise CheckpointError(f"{path}: this is a CosyVoice2 flow (it has {COSYVOICE2_FLOW_KEY}, a conformer "
                              "encoder and a U-Net estimator), not the CosyVoice3 DiT flow")
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
             for k in sorted(expected) if k in state and state[k].shape != expected[k].shape]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({', '.join(missing[:5])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:5])})")
    if wrong:
        parts.append(f"{len(wrong)} with another shape ({'; '.join(wrong[:5])})")
    if parts:
        raise CheckpointError(f"{path}: does not match the CosyVoice3 flow of the given dims: " + ", ".join(parts)
                              + ". Are the dims those of the folder's cosyvoice3.yaml?")


def load_flow3(path: str | Path, dims: Flow3Dims | None = None) -> CausalMaskedDiffWithDiT:
    """The official CosyVoice3 ``flow.pt`` at ``path`` (read with ``weights_only=True``) in a
    :class:`CausalMaskedDiffWithDiT` of ``dims`` (default: the release's), checked key by key and shape by
    shape, loaded strictly, in eval mode."""
    state = read_state_dict(path)
    flow = CausalMaskedDiffWithDiT(dims or Flow3Dims.full())
    check_state(flow, state, path)
    flow.load_state_dict(state, strict=True)
    log.info("loaded %s (%d tensors)", path, len(state))
    return flow.eval()
