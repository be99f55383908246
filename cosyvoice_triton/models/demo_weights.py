"""What the demo model folders do to random weights so that their signal path is exercised like a trained model's:
constant tensors (biases, norms, Snake alpha) get small perturbations, the F0 predictor is rescaled so that the
predicted pitch spans a speaking range on a speech-like mel, and the LMs' logits get a common scale. Shared by the
CosyVoice2 (:mod:`.demo`) and CosyVoice3 (:mod:`.cosyvoice3.demo`) demo folders."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from ..frontend import features

SIZES = ("tiny", "full")
F0_MEAN_HZ, F0_STD_HZ = 160.0, 60.0
_DEMO_LOGIT_STD = 2.0


def _perturb(module: nn.Module, generator: torch.Generator) -> None:
    """Give constant-initialised parameters (biases, LayerNorm, Snake alpha) a little randomness."""
    with torch.no_grad():
        for p in module.parameters():
            flat = p.detach().flatten()
            if flat.numel() == 0 or not torch.all(flat == flat[0]):
                continue
            noise = torch.randn(p.shape, generator=generator)
            if flat[0] == 0:
                p.add_(0.02 * noise)
            else:
                p.mul_(1 + 0.1 * noise)


def _calibration_mel(config: ModelConfig, seconds: float = 2.0) -> torch.Tensor:
    """A deterministic speech-like mel [1, 80, T]: a gliding harmonic tone with a syllable envelope."""
    sr = config.sample_rate
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    y = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)
    y = (0.5 * y / np.max(np.abs(y))).astype(np.float32)
    mel = features.cosyvoice_mel(y, sample_rate=sr, config=config.mel)
    return torch.from_numpy(mel.T.copy())[None]


def _calibrate_f0(hift: nn.Module, config: ModelConfig) -> None:
    """Affinely rescale the F0 classifier of ``hift`` (CosyVoice2's or CosyVoice3's) so |f0| on a speech-like mel
    has mean/std F0_MEAN_HZ/F0_STD_HZ."""
    pred = hift.f0_predictor
    with torch.no_grad():
        raw = pred.classifier(pred.condnet(_calibration_mel(config)).transpose(1, 2)).flatten()
        scale = F0_STD_HZ / max(float(raw.std()), 1e-6)
        shift = F0_MEAN_HZ - float(raw.mean()) * scale
        pred.classifier.weight.mul_(scale)
        pred.classifier.bias.mul_(scale).add_(shift)
