"""HiFT vocoder of CosyVoice 2 (neural source filter + iSTFTNet), inference only and ONNX-exportable.

Mel ``[B, 80, T]`` to 24 kHz audio ``[B, 480 T]`` in three pieces a runtime can run or export apart:

1. ``f0_predictor(mel) -> f0 [B, T]`` (Hz).
2. ``source_from_f0(f0, noise_sine) -> source [B, 1, L]``, ``L = upsample_factor * T``: the ``SineGen2``
   harmonic excitation of the official code, with its Gaussian noise passed in as a tensor.
3. ``decode(mel, source) -> speech [B, L]``: upsampling convolutions fused with the source's STFT, then a
   magnitude/phase head and an iSTFT (both real-valued, from :mod:`.stft`).

Module and parameter names reproduce the official state_dict keys (``m_source.l_linear``, ``conv_pre``,
``ups.i``, ``source_downs.i``, ``source_resblocks.i``, ``resblocks.i``, ``conv_post``,
``f0_predictor.condnet.{0,2,4,6,8}``, ``f0_predictor.classifier``), with weight norm as
``torch.nn.utils.parametrizations.weight_norm`` (``...parametrizations.weight.original0/1``).

Numerics: the source's phase is ``2*pi * sum(f0 * k / sr)`` radians, about 1e4 rad per second for the
upper harmonics, where one float32 ulp is already ~1e-3 rad. The official float32 arithmetic is therefore
reproduced operation by operation (not made more accurate): the cumsum accumulates in float64 like
torch's CPU kernel, and the linear upsampling reproduces ``F.interpolate``'s fused multiply-adds exactly
(see :func:`upsample_linear`). Given the same f0 the source then matches the official one to ~1e-7; but
f0 itself carries ~1e-6 relative float32 noise (conv kernels, batch size, runtime), which the phase
accumulates, so two correct implementations differ by ~1e-3 in the source and a few 1e-4 in the waveform.
The float64 steps export as ONNX ``Cast``/``Mul``/``CumSum`` on doubles (fine in ONNX Runtime; TensorRT
has no float64).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from ..config import HiftConfig
from .stft import ISTFT, STFT


def draw_nsf_noise(batch: int, frames: int, *, upsample: int, harmonics: int,
                   generator: torch.Generator | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """The NSF source noise of ``frames`` mel frames: ``[batch, upsample * frames, harmonics]`` ~ N(0, 1).

    Replays the official draws (``rand [B, H]`` for the unused initial phase; this noise, drawn into a
    ``[B, H, L]``-strided tensor, which changes the values torch produces; then a ``randn [B, L, 1]`` that the
    official code discards), so that after ``torch.manual_seed(s)`` on CPU the default generator gives the
    official noise and ends in the official state. One generator across the chunks of a stream continues one
    sequence, as the official code's global generator does.
    """
    length = upsample * frames
    torch.rand(batch, harmonics, generator=generator, device=device)
    noise = torch.empty(batch, harmonics, length, device=device).transpose(1, 2).normal_(generator=generator)
    torch.randn(batch, length, 1, generator=generator, device=device)
    return noise.contiguous()


def upsample_linear(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``F.interpolate(x.transpose(1, 2), scale_factor=scale, mode="linear").transpose(1, 2)``, bit-exact.

    ``x [B, T, C] -> [B, T * scale, C]`` (align_corners=False). Written with elementwise ops and two
    gathers because the result must equal torch's CPU kernel to the last bit (the values are phases of
    1e4 rad; see the module docstring) and ONNX ``Resize`` rounds differently. That kernel computes, in
    float32 with fused multiply-adds, ``src = max(fma(s, i + 0.5, -0.5), 0)`` with ``s = float32(1/scale)``,
    ``i0 = floor(src)``, ``l1 = src - i0``, ``l0 = 1 - l1`` and ``y = fma(x[i0], l0, x[i1] * l1)``. Here each
    fma is evaluated in float64, where it is exact (but for a conceivable double rounding when the first
    samples' weights are tiny; never seen in tests), and rounded once to float32. Valid for
    ``T * scale < 2**23`` (about 349 s at 24 kHz), where torch's float32 ``i + 0.5`` is still exact.
    """
    pos = torch.arange(x.shape[1] * scale, device=x.device).to(torch.float64)
    step = float(np.float32(1.0 / scale))
    src = ((pos + 0.5) * step - 0.5).to(torch.float32).clamp(min=0.0)  # [L]
    i0 = torch.floor(src)
    l1 = src - i0
    l0 = 1.0 - l1
    i0 = i0.long()
    # x[i0 + 1] with the last frame repeated: the kernel uses i1 = i0 at the right edge
    x_next = torch.cat([x[:, 1:], x[:, -1:]], dim=1)
    x0, x1 = x[:, i0], x_next[:, i0]  # [B, L, C]
    l0, l1 = l0[:, None], l1[:, None]
    return (x0.double() * l0.double() + (x1 * l1).double()).to(x.dtype)


def fold_weight_norm(module: nn.Module) -> nn.Module:
    """Replace every weight-norm parametrization below ``module`` by its plain ``weight`` (in place).

    The folded weight is the tensor the parametrization computes, so outputs are unchanged; the state_dict
    keys become ``...weight``. Not ``parametrize.remove_parametrizations``: it deletes the ``weight``
    property from the generated ``Parametrized*`` class, which ``copy.deepcopy`` shares with the original
    module, so folding a copy would break the original.
    """
    for m in list(module.modules()):
        if parametrize.is_parametrized(m, "weight"):
            if set(m.parametrizations) != {"weight"}:
                raise NotImplementedError(f"{type(m).__name__}: parametrized beyond its weight")
            with torch.no_grad():
                weight = m.weight.detach().clone()
            del m.parametrizations
            m.__class__ = type(m).__bases__[0]  # the plain nn.Conv1d / nn.ConvTranspose1d
            m.weight = nn.Parameter(weight)
    return module


class Snake(nn.Module):
    """Snake activation ``x + sin(alpha x)**2 / (alpha + 1e-9)`` with one ``alpha`` per channel; x ``[B, C, T]``."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]
        return x + 1.0 / (alpha + 1e-9) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """HiFi-GAN residual block with Snake: per dilation d, ``x += conv(snake(conv_d(snake(x))))``.

    Length-preserving, ``[B, C, T] -> [B, C, T]``.
    """

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        conv = lambda d: weight_norm(self._conv(channels, kernel_size, d))
        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def _conv(self, channels: int, kernel_size: int, dilation: int) -> nn.Conv1d:
        """One convolution of the block, before weight norm: centred, length-preserving."""
        return nn.Conv1d(channels, channels, kernel_size, dilation=dilation, padding=dilation * (kernel_size - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
            x = c2(a2(c1(a1(x)))) + x
        return x


class ConvRNNF0Predictor(nn.Module):
    """Pitch from mel: five weight-normed ``Conv1d(k=3)`` + ELU, a Linear, and ``abs``.

    ``forward(mel [B, in_channels, T]) -> f0 [B, T]`` in Hz (``[B, T, num_class]`` if ``num_class > 1``).
    """

    def __init__(self, in_channels: int = 80, cond_channels: int = 512, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3,
                                             padding=1)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return torch.abs(self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1))


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise excitation from f0 (the official ``SourceModuleHnNSF`` with ``SineGen2``).

    ``forward(f0 [B, T], noise_sine [B, L, H]) -> source [B, 1, L]`` with ``L = upsample_scale * T`` and
    ``H = harmonic_num + 1``. For harmonic k = 1..H, at frame rate:
    ``rad_k = frac(f0 * k / sr)`` (cycles per sample), ``phase_k = 2 pi cumsum_t(rad_k)``; the phase is
    multiplied by ``upsample_scale`` and linearly interpolated to sample rate, and
    ``e_k = sine_amp * sin(phase_k) * uv + noise_amp * noise_sine[..., k]`` with ``uv = f0 > voiced_threshold``
    and ``noise_amp = noise_std`` if voiced else ``sine_amp / 3``; finally ``source = tanh(l_linear(e))``.

    The official code builds ``rad`` at sample rate (nearest-upsampled f0), adds a random initial phase
    ``rand_ini`` to sample 0 (zero for the fundamental) and downsamples it linearly by ``1/upsample_scale``.
    For ``upsample_scale >= 3`` that downsampling reads only samples ``s*t + (s-1)/2`` (the average of two
    equal values when s is even), which never include sample 0: it returns the frame-rate ``rad`` exactly and
    ``rand_ini`` has no effect, so neither is computed here. Its other random draw (the noise branch of
    ``SourceModuleHnNSF``) is discarded by ``HiFTGenerator``, so ``noise_sine`` is the only randomness.
    """

    def __init__(self, sampling_rate: int, upsample_scale: int, harmonic_num: int = 8, sine_amp: float = 0.1,
                 noise_std: float = 0.003, voiced_threshold: float = 10.0):
        super().__init__()
        if upsample_scale < 3:
            raise ValueError("upsample_scale < 3: the official random initial phase would matter")
        self.sampling_rate, self.upsample_scale, self.harmonics = sampling_rate, upsample_scale, harmonic_num + 1
        self.sine_amp, self.noise_std, self.voiced_threshold = sine_amp, noise_std, voiced_threshold
        self.l_linear = nn.Linear(harmonic_num + 1, 1)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        """Nearest upsampling along time, ``[B, T, C] -> [B, T * upsample_scale, C]``."""
        return x.unsqueeze(2).expand(-1, -1, self.upsample_scale, -1).flatten(1, 2)

    def _upsample_phase(self, phase: torch.Tensor) -> torch.Tensor:
        """Phase ``[B, T, H]`` to sample rate ``[B, T * upsample_scale, H]``: linear, as ``F.interpolate`` does."""
        return upsample_linear(phase, self.upsample_scale)

    def rad(self, f0: torch.Tensor) -> torch.Tensor:
        """``f0 [B, T]`` (Hz) -> each harmonic's phase step per sample ``[B, T, H]`` in cycles, in f0's dtype."""
        f0 = f0.unsqueeze(-1)  # [B, T, 1]
        k = torch.arange(1, self.harmonics + 1, dtype=f0.dtype, device=f0.device)
        rad = f0 * k / self.sampling_rate  # [B, T, H]
        return rad - torch.floor(rad)  # == rad % 1 (rad >= 0)

    def forward(self, f0: torch.Tensor, noise_sine: torch.Tensor, phase0: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``phase0`` (float64 ``[B, 1, H]``, cycles): the sum of :meth:`rad` over the frames before ``f0``'s first,
        for a caller that runs a stream's later frames alone (the phase then continues where those frames left
        it, as one call on every frame would compute it)."""
        rad = self.rad(f0)
        f0 = f0.unsqueeze(-1)  # [B, T, 1]
        cum = torch.cumsum(rad.double(), dim=1)  # torch CPU sums in float64
        if phase0 is not None:
            cum = cum + phase0
        phase = cum.to(f0.dtype) * 2 * math.pi
        phase = self._upsample_phase(phase * self.upsample_scale)  # [B, L, H]
        sines = torch.sin(phase) * self.sine_amp
        uv = (f0 > self.voiced_threshold).to(f0.dtype)  # [B, T, 1]
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        excitation = sines * self._repeat(uv) + self._repeat(noise_amp) * noise_sine
        return torch.tanh(self.l_linear(excitation)).transpose(1, 2)


class HiFTGenerator(nn.Module):
    """CosyVoice 2's HiFT vocoder; see the module docstring. ``forward(mel, noise_sine) -> (speech, source)``."""

    def __init__(self, config: HiftConfig):
        super().__init__()
        c = config
        self.config = c
        self.upsample_factor = c.upsample_factor
        self.lrelu_slope, self.audio_limit = c.lrelu_slope, c.audio_limit
        self.bins = c.n_fft // 2 + 1
        self.num_kernels = len(c.resblock_kernel_sizes)

        self.m_source = SourceModuleHnNSF(c.sampling_rate, c.upsample_factor, c.nb_harmonics, c.nsf_alpha,
                                          c.nsf_sigma, c.nsf_voiced_threshold)
        self.conv_pre = weight_norm(nn.Conv1d(c.in_channels, c.base_channels, 7, padding=3))
        ch = [c.base_channels // 2**i for i in range(len(c.upsample_rates) + 1)]
        # weight norm over dim 0, which for ConvTranspose1d is the input channel (g: [in, 1, 1])
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(ch[i], ch[i + 1], k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes, strict=True)))
        # Source STFT (hop_len per frame) down to the frame rate after upsampling stage i: stride
        # prod(upsample_rates[i+1:]); a stride s > 1 uses kernel 2s and padding s // 2.
        spec_ch = c.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        n_up = len(c.upsample_rates)
        for i, k, d in zip(range(n_up), c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes,
                           strict=True):
            s = int(np.prod(c.upsample_rates[i + 1:]))
            self.source_downs.append(nn.Conv1d(spec_ch, ch[i + 1], 1) if s == 1 else
                                     nn.Conv1d(spec_ch, ch[i + 1], 2 * s, s, padding=s // 2))
            self.source_resblocks.append(ResBlock(ch[i + 1], k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(ch[i + 1], k, d)
            for i in range(n_up)
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes, strict=True))
        self.conv_post = weight_norm(nn.Conv1d(ch[-1], spec_ch, 7, padding=3))
        self.f0_predictor = ConvRNNF0Predictor(c.f0_predictor.in_channels, c.f0_predictor.cond_channels,
                                               c.f0_predictor.num_class)
        self.stft = STFT(c.n_fft, c.hop_len)  # periodic Hann, center=True, reflect; no state_dict entries
        self.istft = ISTFT(c.n_fft, c.hop_len)

    # ----------------------------------------------------------------------------------------- pieces

    def source_from_f0(self, f0: torch.Tensor, noise_sine: torch.Tensor) -> torch.Tensor:
        """``f0 [B, T]`` (Hz) and ``noise_sine [B, L, nb_harmonics + 1]`` ~ N(0, 1) -> source ``[B, 1, L]``."""
        return self.m_source(f0, noise_sine)

    def decode_spec(self, speech_feat: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Mel ``[B, 80, T]`` and source ``[B, 1, L]`` -> ``conv_post`` output ``[B, n_fft + 2, L / hop + 1]``:
        log-magnitude rows ``[:n_fft // 2 + 1]``, then phase pre-activation rows."""
        s_stft = self.stft(source.squeeze(1))  # [B, n_fft + 2, L / hop + 1], real rows then imag rows
        x = self.conv_pre(speech_feat)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            xs = blocks[0](x)
            for block in blocks[1:]:
                xs = xs + block(x)
            x = xs / self.num_kernels
        return self.conv_post(F.leaky_relu(x))  # default slope 0.01 here, as in the official code

    def spec_to_audio(self, spec: torch.Tensor) -> torch.Tensor:
        """``conv_post`` output ``[B, n_fft + 2, frames]`` -> speech ``[B, hop * (frames - 1)]`` in [-limit, limit]."""
        magnitude = torch.clamp(torch.exp(spec[:, :self.bins]), max=1e2)
        phase = torch.sin(spec[:, self.bins:])  # the official head applies sin before using it as a phase
        speech = self.istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.clamp(speech, -self.audio_limit, self.audio_limit)

    def decode(self, speech_feat: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Mel ``[B, 80, T]`` and source ``[B, 1, L]`` -> speech ``[B, L]``."""
        return self.spec_to_audio(self.decode_spec(speech_feat, source))

    # ------------------------------------------------------------------------------------ entry points

    def forward(self, speech_feat: torch.Tensor, noise_sine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel ``[B, 80, T]``, ``noise_sine [B, L, nb_harmonics + 1]`` -> (speech ``[B, L]``, source
        ``[B, 1, L]``), ``L = upsample_factor * T``. No randomness and no data-dependent control flow."""
        source = self.source_from_f0(self.f0_predictor(speech_feat), noise_sine)
        return self.decode(speech_feat, source), source

    def draw_noise(self, batch: int, frames: int, generator: torch.Generator | None = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """``noise_sine [batch, upsample_factor * frames, nb_harmonics + 1]``: :func:`draw_nsf_noise`."""
        return draw_nsf_noise(batch, frames, upsample=self.upsample_factor, harmonics=self.m_source.harmonics,
                              generator=generator, device=device)

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, cache_source: torch.Tensor | None = None,
                  noise_sine: torch.Tensor | None = None, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Official ``HiFTGenerator.inference``: mel ``[B, 80, T]`` -> (speech ``[B, L]``, source ``[B, 1, L]``).

        ``cache_source [B, 1, C]`` (the tail of the previous chunk's source, C <= L) overwrites the first C
        source samples before decoding, which keeps streamed chunks phase-continuous. ``noise_sine`` is
        drawn with :meth:`draw_noise` when None: from ``generator`` on its own device (a CPU generator
        replays the official CPU draws whatever the model's device), else from torch's global RNG on the
        model's device; then moved to ``speech_feat``'s device and dtype.
        """
        f0 = self.f0_predictor(speech_feat)
        if noise_sine is None:
            device = speech_feat.device if generator is None else generator.device
            noise_sine = self.draw_noise(speech_feat.shape[0], speech_feat.shape[2], generator, device)
            noise_sine = noise_sine.to(device=speech_feat.device, dtype=speech_feat.dtype)
        source = self.source_from_f0(f0, noise_sine)
        if cache_source is not None and cache_source.shape[2] > 0:
            source[:, :, :cache_source.shape[2]] = cache_source
        return self.decode(speech_feat, source), source

    def fold_weight_norm(self) -> HiFTGenerator:
        """Fold every weight norm into a plain weight (faster inference and export); returns self."""
        return fold_weight_norm(self)
