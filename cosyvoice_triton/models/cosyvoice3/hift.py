"""CosyVoice3's causal HiFT vocoder (the official ``CausalHiFTGenerator`` with ``CausalConvRNNF0Predictor``).

Mel ``[B, 80, T]`` to 24 kHz audio, like CosyVoice2's HiFT (:mod:`cosyvoice_triton.models.hift`, whose pieces are
reused) but causal, so that a stream can re-run the vocoder on the growing mel and keep only the new samples:

- every convolution pads on one side only. Three look ahead: the F0 predictor's first convolution (kernel 4) sees 3
  frames to the right, ``conv_pre`` (kernel ``conv_pre_look_right + 1``) 4; the rest look back only. The
  upsampling layers are nearest repetition + a left-padded ``Conv1d`` (not transposed convolutions), the source's
  downsampling layers left-padded strided ``Conv1d``.
- ``finalize=False`` (a stream's chunk that more mel will follow): the look-ahead frames are real mel, not zero
  padding, and the output stops where future mel could still change it. A call on ``T`` frames returns
  ``upsample_factor * (T - 8)`` samples (3 frames held by the F0 predictor, 4 by ``conv_pre``, 1 by the iSTFT's
  overlap); ``finalize=True`` returns ``upsample_factor * T``.
- the F0 predictor runs in float64: the official ``inference`` converts it (``self.f0_predictor.to(float64)``)
  before each call, because the source's phase accumulates f0 over the whole utterance. f0 is cast back to float32.
- the source's phase is repeated to sample rate (nearest), not linearly interpolated.
- the NSF noise is not drawn per call. The official ``SineGen2(causal=True)`` draws, when it is constructed, a
  uniform ``torch.rand(1, 300 * 24000, 9)`` buffer (after a ``torch.rand(1, 9)`` initial phase that has no effect,
  see :class:`~cosyvoice_triton.models.hift.SourceModuleHnNSF`), and every call uses its first ``L`` samples. So
  sample ``i`` gets the same noise in every call, and a stream's chunks equal the one-shot output. Here
  :func:`draw_causal_nsf_noise` replays that buffer from a seed: it equals the official one when
  ``torch.manual_seed(seed)`` ran right before ``CausalHiFTGenerator(...)`` was constructed (its F0 predictor,
  an argument, built before). A third official draw (``SourceModuleHnNSF.uv``, the noise branch) is discarded by
  the generator.

State_dict keys and shapes are the official ones (``m_source.l_linear``, ``conv_pre``, ``ups.i``,
``source_downs.i``, ``source_resblocks.i``, ``resblocks.i``, ``conv_post``, ``f0_predictor.condnet.{0,2,4,6,8}``,
``f0_predictor.classifier``; weight norm as ``parametrizations.weight.original0/1``). :func:`load_hift3` reads an
official ``hift.pt`` as ``CosyVoice3Model.load`` does (``generator.`` removed from the keys, strict).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from ...errors import CheckpointError, ConfigError
from ..checkpoint import normalize_keys, read_state_dict
from ..hift import HiFTGenerator, ResBlock, SourceModuleHnNSF, fold_weight_norm
from ..stft import ISTFT, STFT

log = logging.getLogger(__name__)

#: The official causal source draws its noise buffer for 300 s at 24 kHz, with 9 columns whatever
#: ``nb_harmonics`` is; longer outputs fail there.
NOISE_MAX_SAMPLES = 300 * 24000
NOISE_COLUMNS = 9


@dataclass(frozen=True)
class Hift3Dims:
    """The ``hift:`` section of ``cosyvoice3.yaml`` (defaults: the released Fun-CosyVoice3-0.5B values)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_in_channels: int = 80  # f0_predictor.in_channels
    f0_cond_channels: int = 512  # f0_predictor.cond_channels
    f0_num_class: int = 1  # f0_predictor.num_class

    def __post_init__(self):
        if self.nb_harmonics + 1 != NOISE_COLUMNS:
            raise ConfigError(f"hift.nb_harmonics is {self.nb_harmonics}; the official causal source's noise has "
                              f"{NOISE_COLUMNS} columns, so only {NOISE_COLUMNS - 1} works")
        if self.f0_num_class != 1:
            raise ConfigError("hift.f0_predictor.num_class must be 1 (one f0 per frame)")

    @classmethod
    def full(cls) -> Hift3Dims:
        return cls()

    @classmethod
    def tiny(cls) -> Hift3Dims:
        """Test dims: 64 base channels (64, 32, 16, 8 along the upsampling), a 64-wide F0 predictor; every tensor
        at the interfaces has its full-size shape (80 mel bins, 480 samples per frame, 18 spectrum rows)."""
        return cls(base_channels=64, f0_cond_channels=64)

    @classmethod
    def from_section(cls, hift: dict[str, Any]) -> Hift3Dims:
        """From the ``hift:`` mapping of a ``cosyvoice3.yaml`` parsed by
        :func:`cosyvoice_triton.config.load_hyperpyyaml` (tags kept as ``__class__``)."""
        name = hift.get("__class__", "")
        if not name.endswith("CausalHiFTGenerator"):
            raise ConfigError(f"hift is {name or 'untagged'}, not cosyvoice.hifigan.generator.CausalHiFTGenerator")
        f0 = hift.get("f0_predictor", {})
        if not f0.get("__class__", "").endswith("CausalConvRNNF0Predictor"):
            raise ConfigError(f"hift.f0_predictor is {f0.get('__class__')}, not CausalConvRNNF0Predictor")
        tup = lambda v: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: tup(v) for k, v in hift.items() if k in names}
        istft = hift.get("istft_params", {})
        kw.update({k: int(istft[k]) for k in ("n_fft", "hop_len") if k in istft})
        kw.update({f"f0_{k}": int(f0[k]) for k in ("in_channels", "cond_channels", "num_class") if k in f0})
        return cls(**kw)

    @property
    def upsample_factor(self) -> int:
        """Output samples per mel frame (480 for the release: 8*5*3 upsampling times the iSTFT hop of 4)."""
        return int(np.prod(self.upsample_rates)) * self.hop_len

    @property
    def held_frames(self) -> int:
        """Mel frames whose audio a ``finalize=False`` call does not return: 3 (F0 look-ahead) +
        ``conv_pre_look_right`` + 1 (the iSTFT's last hop of frames)."""
        return CausalConvRNNF0Predictor.LOOK_AHEAD + self.conv_pre_look_right + 1


# ----------------------------------------------------------------------------------------------- noise


def draw_causal_nsf_noise(samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The first ``samples`` rows of the official causal source's noise buffer: ``[1, samples, 9]`` ~ U[0, 1).

    Replays the construction draws of ``SineGen2(causal=True)``: ``rand(1, 9)`` (its initial phase, without
    effect), then ``rand(1, 300 * 24000, 9)``, of which this is the prefix (torch's CPU uniform draws are serial,
    one per element, so a prefix of a draw is the draw of the prefix). With ``generator`` seeded ``s`` this is the
    official buffer of a generator constructed right after ``torch.manual_seed(s)``. CPU only.
    """
    if not 0 <= samples <= NOISE_MAX_SAMPLES:
        raise ValueError(f"{samples} samples: the official causal source has noise for {NOISE_MAX_SAMPLES} (300 s)")
    torch.rand(1, NOISE_COLUMNS, generator=generator)
    return torch.rand(1, samples, NOISE_COLUMNS, generator=generator)


#: Requests computing at once in one process extend a noise buffer one after the other (growth is rare: the buffer
#: doubles).
_NOISE_GROWTH = threading.Lock()


class CausalNsfNoise:
    """A seeded :func:`draw_causal_nsf_noise` buffer, drawn as far as it was asked for and extended on demand.

    The extension continues the same generator, so it equals one long draw (see :func:`draw_causal_nsf_noise`).
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._noise = draw_causal_nsf_noise(0, self._generator)

    def __call__(self, samples: int) -> torch.Tensor:
        """``[1, samples, 9]``: the buffer's first ``samples`` rows (a view; do not modify it)."""
        noise = self._noise
        if samples > noise.shape[1]:
            if samples > NOISE_MAX_SAMPLES:
                raise ValueError(f"{samples} samples: the official causal source has noise for {NOISE_MAX_SAMPLES}")
            with _NOISE_GROWTH:
                have = self._noise.shape[1]
                if samples > have:
                    grow = min(max(samples - have, have), NOISE_MAX_SAMPLES - have)  # doubling: few, large draws
                    more = torch.rand(1, grow, NOISE_COLUMNS, generator=self._generator)
                    self._noise = torch.cat([self._noise, more], dim=1)
                noise = self._noise
        return noise[:, :samples]


# ---------------------------------------------------------------------------------------- convolutions


class CausalConv1d(nn.Conv1d):
    """Stride-1 ``Conv1d`` whose output has the input's length: ``(kernel_size - 1) * dilation`` frames go on the
    left (``look_right=False``) or on the right (``look_right=True``) before an unpadded convolution.

    Those frames are zeros, or ``context`` when given: for a right-looking layer in a stream, the real frames
    that follow (the official ``cache`` argument).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 look_right: bool = False):
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation)
        # the official formula, which equals (k - 1) * d for odd kernels and for dilation 1
        self.pad = (kernel_size * dilation - dilation) // 2 * 2 + (kernel_size + 1) % 2
        if self.pad != (kernel_size - 1) * dilation:
            raise ValueError(f"kernel {kernel_size} with dilation {dilation} changes the length (official assert)")
        self.look_right = look_right

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        if context is None:
            context = torch.zeros(x.shape[0], x.shape[1], self.pad, dtype=x.dtype, device=x.device)
        elif context.shape[2] != self.pad:
            raise ValueError(f"context of {context.shape[2]} frames, expected {self.pad}")
        return super().forward(torch.cat([x, context] if self.look_right else [context, x], dim=2))


class CausalConv1dDownSample(nn.Conv1d):
    """``Conv1d(kernel 2 * stride, stride)`` after ``stride - 1`` zeros on the left: ``N`` frames -> ``N // stride``
    when ``N`` is ``stride * n + 1`` (the source STFT's frames)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__(in_channels, out_channels, 2 * stride, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest upsampling by ``rate`` (each frame repeated) and a ``Conv1d(kernel_size)`` after ``kernel_size - 1``
    zeros on the left: ``[B, C, T] -> [B, C_out, rate * T]``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, rate: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.repeat_interleave(x, self.rate, dim=2)  # == nn.Upsample(scale_factor=rate, mode="nearest")
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalResBlock(ResBlock):
    """CosyVoice2's HiFi-GAN residual block with left-padded convolutions (the official ``ResBlock(causal=True)``)."""

    def _conv(self, channels: int, kernel_size: int, dilation: int) -> nn.Conv1d:
        return CausalConv1d(channels, channels, kernel_size, dilation)


# ------------------------------------------------------------------------------------------- f0, source


class CausalConvRNNF0Predictor(nn.Module):
    """Pitch from mel: five weight-normed causal convolutions + ELU, a Linear, and ``abs``.

    The first convolution (kernel 4) looks 3 frames ahead, the four others (kernel 3) 2 frames back.
    ``forward(mel [B, in_channels, T], finalize) -> f0 [B, T]`` (Hz) in the parameters' dtype; with
    ``finalize=False`` the last 3 mel frames are the look-ahead of the frames before them: ``[B, T - 3]``.
    """

    LOOK_AHEAD = 3

    def __init__(self, in_channels: int = 80, cond_channels: int = 512, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            conv = (CausalConv1d(in_channels, cond_channels, self.LOOK_AHEAD + 1, look_right=True) if i == 0
                    else CausalConv1d(cond_channels, cond_channels, 3))
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        first = self.condnet[0]
        x = first(mel) if finalize else first(mel[:, :, :-first.pad], mel[:, :, -first.pad:])
        for layer in self.condnet[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


class CausalSourceModuleHnNSF(SourceModuleHnNSF):
    """CosyVoice2's harmonic-plus-noise source with the causal phase upsampling: each frame's phase repeated
    (``F.interpolate(mode="nearest")``) instead of linearly interpolated. ``noise_sine`` is the causal buffer's
    prefix (:func:`draw_causal_nsf_noise`), uniform in [0, 1) rather than Gaussian, as the official code uses it."""

    def _upsample_phase(self, phase: torch.Tensor) -> torch.Tensor:
        return self._repeat(phase)


# ------------------------------------------------------------------------------------------- generator


class CausalHiFTGenerator(nn.Module):
    """CosyVoice3's causal HiFT vocoder; see the module docstring.

    ``inference(mel, finalize, noise)`` is the official entry point; :meth:`predict_f0`,
    :meth:`source_from_f0` and :meth:`decode` are its three stages.
    """

    def __init__(self, dims: Hift3Dims, noise_seed: int = 0):
        super().__init__()
        d = self.dims = dims
        self.upsample_factor = d.upsample_factor
        self.stft_per_frame = int(np.prod(d.upsample_rates))  # source STFT frames per mel frame
        self.lrelu_slope, self.audio_limit = d.lrelu_slope, d.audio_limit
        self.bins = d.n_fft // 2 + 1
        self.num_kernels = len(d.resblock_kernel_sizes)
        self.conv_pre_look_right = d.conv_pre_look_right

        self.m_source = CausalSourceModuleHnNSF(d.sampling_rate, d.upsample_factor, d.nb_harmonics, d.nsf_alpha,
                                                d.nsf_sigma, d.nsf_voiced_threshold)
        self.conv_pre = weight_norm(CausalConv1d(d.in_channels, d.base_channels, d.conv_pre_look_right + 1,
                                                 look_right=True))
        n_up = len(d.upsample_rates)
        ch = [d.base_channels // 2**i for i in range(n_up + 1)]
        self.ups = nn.ModuleList(
            weight_norm(CausalConv1dUpsample(ch[i], ch[i + 1], k, u))
            for i, (u, k) in enumerate(zip(d.upsample_rates, d.upsample_kernel_sizes, strict=True)))
        spec_ch = d.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, k, dil in zip(range(n_up), d.source_resblock_kernel_sizes, d.source_resblock_dilation_sizes,
                             strict=True):
            s = int(np.prod(d.upsample_rates[i + 1:]))  # source STFT frames per frame after upsampling stage i
            self.source_downs.append(CausalConv1d(spec_ch, ch[i + 1], 1) if s == 1 else
                                     CausalConv1dDownSample(spec_ch, ch[i + 1], s))
            self.source_resblocks.append(CausalResBlock(ch[i + 1], k, dil))
        self.resblocks = nn.ModuleList(
            CausalResBlock(ch[i + 1], k, dil)
            for i in range(n_up)
            for k, dil in zip(d.resblock_kernel_sizes, d.resblock_dilation_sizes, strict=True))
        self.conv_post = weight_norm(CausalConv1d(ch[-1], spec_ch, 7))
        self.f0_predictor = CausalConvRNNF0Predictor(d.f0_in_channels, d.f0_cond_channels, d.f0_num_class)
        self.stft = STFT(d.n_fft, d.hop_len)  # periodic Hann, center=True, reflect; no state_dict entries
        self.istft = ISTFT(d.n_fft, d.hop_len)
        self.noise = CausalNsfNoise(noise_seed)
        #: runs :meth:`decode`'s generator in place of the layers above (``decode_fn(mel, source) -> speech``, the
        #: ``finalize=True`` decode of what it is given, e.g. the served ``hift3_decoder`` graph of
        #: :mod:`cosyvoice_triton.serving.stages.cosyvoice3_graphs`); None: these layers
        self.decode_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    # CosyVoice2's head: conv_post output [B, n_fft + 2, frames] -> speech [B, hop * (frames - 1)], clamped
    spec_to_audio = HiFTGenerator.spec_to_audio

    # ----------------------------------------------------------------------------------------- stages

    def predict_f0(self, speech_feat: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel ``[B, 80, T]`` -> f0 ``[B, T]`` (``[B, T - 3]`` unless ``finalize``) in Hz, in ``speech_feat``'s dtype.

        Computed in float64 like the official ``inference``, which converts the predictor's parameters to float64
        (weight norm included) on every call; here they are converted once, on the first call.
        """
        if self.f0_predictor.classifier.weight.dtype != torch.float64:
            self.f0_predictor.double()
        return self.f0_predictor(speech_feat.double(), finalize=finalize).to(speech_feat.dtype)

    def source_from_f0(self, f0: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """``f0 [B, T]`` (Hz) -> source ``[B, 1, L]``, ``L = upsample_factor * T``. ``noise``: ``[1 or B, >= L, 9]``
        (its first ``L`` rows are used); None: the model's seeded buffer (``self.noise``)."""
        samples = self.upsample_factor * f0.shape[1]
        noise = self.noise(samples) if noise is None else noise[:, :samples]
        if noise.shape[1] != samples:
            raise ValueError(f"noise of {noise.shape[1]} samples for a source of {samples}")
        return self.m_source(f0, noise.to(device=f0.device, dtype=f0.dtype))

    def decode_spec(self, speech_feat: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel ``[B, 80, T]`` and source ``[B, 1, 480 T]`` -> ``conv_post`` output ``[B, n_fft + 2, 120 T' + 1]``,
        ``T' = T`` with ``finalize``, else ``T - conv_pre_look_right`` (the last frames are ``conv_pre``'s
        look-ahead, and the source STFT's frames past them are dropped)."""
        s_stft = self.stft(source.squeeze(1))  # [B, n_fft + 2, 120 T + 1], real rows then imag rows
        if finalize:
            x = self.conv_pre(speech_feat)
        else:
            look = self.conv_pre_look_right
            x = self.conv_pre(speech_feat[:, :, :-look], speech_feat[:, :, -look:])
            s_stft = s_stft[:, :, :-self.stft_per_frame * look]
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

    def decode(self, speech_feat: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel ``[B, 80, T]`` and source ``[B, 1, 480 T]`` -> speech ``[B, 480 T]`` with ``finalize``, else
        ``[B, 480 (T - conv_pre_look_right - 1)]`` (the last hop of samples still lacks its overlap).

        With :attr:`decode_fn`, ``finalize=False`` is the prefix of its ``finalize=True`` decode of the same input:
        only ``conv_pre`` looks ahead, so the frames before its look-ahead see the same values either way, and
        every later layer (the source STFT's included, taken of the same whole source) is causal."""
        if self.decode_fn is not None:
            speech = self.decode_fn(speech_feat, source)
            return speech if finalize else speech[:, : self.upsample_factor * (
                speech_feat.shape[2] - self.conv_pre_look_right - 1)]
        return self.generate(speech_feat, source, finalize)

    def generate(self, speech_feat: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """:meth:`decode` on this module's own layers, whatever :attr:`decode_fn` (with ``finalize``: a
        ``decode_fn``, e.g. for the calls a served graph cannot take)."""
        speech = self.spec_to_audio(self.decode_spec(speech_feat, source, finalize))
        return speech if finalize else speech[:, :-self.upsample_factor]

    # ------------------------------------------------------------------------------------ entry point

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, finalize: bool = True, noise: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Official ``CausalHiFTGenerator.inference``: mel ``[B, 80, T]`` -> (speech, source ``[B, 1, 480 T']``).

        ``finalize=True``: speech ``[B, 480 T]``, ``T' = T``. ``finalize=False``: the last ``held_frames`` (8) mel
        frames are look-ahead; speech ``[B, 480 (T - 8)]``, ``T' = T - 3``. A stream calls this on the whole mel
        so far and keeps the samples past those it already has (``CosyVoice3Model.token2wav``).
        """
        f0 = self.predict_f0(speech_feat, finalize)
        source = self.source_from_f0(f0, noise)
        if not finalize:
            speech_feat = speech_feat[:, :, :-CausalConvRNNF0Predictor.LOOK_AHEAD]
        return self.decode(speech_feat, source, finalize), source

    def fold_weight_norm(self) -> CausalHiFTGenerator:
        """Fold every weight norm into a plain weight; the F0 predictor's in float64, as it runs. Returns self."""
        self.f0_predictor.double()
        return fold_weight_norm(self)


# ---------------------------------------------------------------------------------------------- loading


def check_layout(module: nn.Module, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing, unexpected and mis-shaped keys of ``state``."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
             for k in sorted(expected) if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing (e.g. {', '.join(missing[:3])})"] if missing else []
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        if wrong:
            parts.append(f"{len(wrong)} with other shapes (e.g. {'; '.join(wrong[:3])})")
        cv2 = any(k.startswith(("ups.", "conv_pre.")) for k in (*missing, *unexpected, *wrong))
        hint = " (another upsampling or conv_pre layout: a CosyVoice2 hift.pt, or other dims?)" if cv2 else ""
        raise CheckpointError(f"{path}: does not match CosyVoice3's CausalHiFTGenerator at these dims: "
                              + ", ".join(parts) + hint)


def load_hift3(path: str | Path, dims: Hift3Dims, noise_seed: int = 0) -> CausalHiFTGenerator:
    """The official CosyVoice3 ``hift.pt`` at ``path`` in a :class:`CausalHiFTGenerator` built from ``dims``, in
    eval mode: ``torch.load(weights_only=True)``, every ``generator.`` removed from the keys (as
    ``CosyVoice3Model.load`` does), legacy ``weight_g`` / ``weight_v`` accepted, keys and shapes checked, strict
    ``load_state_dict``. The F0 predictor is then converted to float64, as the official ``inference`` does."""
    state = normalize_keys(read_state_dict(path))
    model = CausalHiFTGenerator(dims, noise_seed=noise_seed)
    check_layout(model, state, path)
    model.load_state_dict(state, strict=True)
    model.f0_predictor.double()
    log.info("loaded %s (%d tensors)", path, len(state))
    return model.eval()
