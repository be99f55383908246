"""STFT and inverse STFT from real-valued convolutions, so that they export to ONNX / TensorRT.

``torch.stft(return_complex=True)`` and ``torch.istft`` have no ONNX export (complex types, and an
overlap-add through ScatterND). Both are linear maps with a fixed kernel, so they are written here as a
strided ``conv1d`` with windowed DFT bases and a strided ``conv_transpose1d`` with windowed inverse-DFT
bases. The bases are computed in float64 and stored as float32 buffers that are *not* part of the
state_dict (``persistent=False``), so checkpoints are unaffected.

Conventions match torch (``normalized=False``, ``onesided=True``): ``F = n_fft // 2 + 1`` bins, the window
(``win_length`` samples) is zero-padded to ``n_fft`` in the middle, and with ``center=True`` the signal
is reflect-padded by ``n_fft // 2`` on both sides.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def hann_window(win_length: int) -> np.ndarray:
    """Periodic Hann window in float64 (``torch.hann_window(periodic=True)``, ``scipy`` ``fftbins=True``)."""
    n = np.arange(win_length, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * n / win_length)


def _padded_window(n_fft: int, win_length: int | None, window: np.ndarray | torch.Tensor | None) -> np.ndarray:
    """The analysis/synthesis window as ``[n_fft]`` float64, centred like ``torch.stft`` does."""
    win_length = n_fft if win_length is None else win_length
    w = hann_window(win_length) if window is None else np.asarray(window, dtype=np.float64).reshape(-1)
    if w.shape[0] != win_length or win_length > n_fft:
        raise ValueError(f"window has {w.shape[0]} samples, expected win_length={win_length} <= n_fft={n_fft}")
    left = (n_fft - win_length) // 2
    return np.pad(w, (left, n_fft - win_length - left))


def _dft_angles(n_fft: int) -> np.ndarray:
    """``2*pi*k*n/n_fft`` as ``[F, n_fft]`` float64, with ``k*n`` reduced mod ``n_fft`` (exact angles)."""
    k = np.arange(n_fft // 2 + 1)[:, None]
    n = np.arange(n_fft)[None, :]
    return 2.0 * np.pi * ((k * n) % n_fft) / n_fft


class STFT(nn.Module):
    """``torch.stft(x, n_fft, hop_length, win_length, window, center, pad_mode, return_complex=True)``
    with the real and imaginary parts stacked on the channel axis.

    ``forward(x [B, N]) -> [B, 2F, frames]``: rows ``0..F-1`` are the real part and rows ``F..2F-1`` the
    imaginary part (``torch.view_as_real`` of bin ``f`` is ``(out[:, f], out[:, F + f])``); ``frames`` is
    ``1 + N // hop_length`` with ``center=True`` and ``1 + (N - n_fft) // hop_length`` without.
    """

    def __init__(self, n_fft: int, hop_length: int, win_length: int | None = None,
                 window: np.ndarray | torch.Tensor | None = None, center: bool = True,
                 pad_mode: str = "reflect"):
        super().__init__()
        self.n_fft, self.hop_length, self.center, self.pad_mode = n_fft, hop_length, center, pad_mode
        w = _padded_window(n_fft, win_length, window)
        ang = _dft_angles(n_fft)
        # X[f] = sum_n w[n] x[n] exp(-i ang[f, n])
        basis = np.concatenate([np.cos(ang) * w, -np.sin(ang) * w])  # [2F, n_fft]
        self.register_buffer("basis", torch.from_numpy(basis[:, None, :]).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(1)  # [B, 1, N]
        if self.center:
            pad = self.n_fft // 2
            x = F.pad(x, (pad, pad), mode=self.pad_mode)
        return F.conv1d(x, self.basis, stride=self.hop_length)


class ISTFT(nn.Module):
    """``torch.istft(real + 1j*imag, n_fft, hop_length, win_length, window, center)`` without ``length``.

    ``forward(real [B, F, frames], imag [B, F, frames]) -> [B, N]`` with
    ``N = hop_length * (frames - 1) + n_fft - 2 * (n_fft // 2 if center else 0)``, i.e.
    ``hop_length * (frames - 1)`` for even ``n_fft`` and ``center=True``.

    Each frame is the inverse real DFT (the imaginary parts of the DC and Nyquist bins are ignored, as
    ``irfft`` does) times the window; frames are overlap-added by ``conv_transpose1d`` and divided by the
    overlap-added squared window, which ``conv_transpose1d`` also builds from the precomputed ``w**2``
    kernel for the actual frame count. The window must satisfy NOLA on the kept samples (Hann with
    ``hop_length <= n_fft // 2`` does); unlike torch there is no runtime check.
    """

    def __init__(self, n_fft: int, hop_length: int, win_length: int | None = None,
                 window: np.ndarray | torch.Tensor | None = None, center: bool = True):
        super().__init__()
        self.n_fft, self.hop_length, self.center = n_fft, hop_length, center
        w = _padded_window(n_fft, win_length, window)
        ang = _dft_angles(n_fft)
        # irfft: x[n] = (1/N) sum_k c_k (Re X_k cos(ang) - Im X_k sin(ang)), c_0 = c_{N/2} = 1, others 2
        c = np.full(n_fft // 2 + 1, 2.0)
        c[0] = 1.0
        if n_fft % 2 == 0:
            c[-1] = 1.0
        sin = np.sin(ang)
        sin[0] = 0.0
        if n_fft % 2 == 0:
            sin[-1] = 0.0
        basis = np.concatenate([c[:, None] * np.cos(ang), -c[:, None] * sin]) * w / n_fft  # [2F, n_fft]
        self.register_buffer("basis", torch.from_numpy(basis[:, None, :]).float(), persistent=False)
        self.register_buffer("window_sq", torch.from_numpy((w**2)[None, None, :]).float(), persistent=False)

    def forward(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        spec = torch.cat([real, imag], dim=1)  # [B, 2F, frames]
        y = F.conv_transpose1d(spec, self.basis, stride=self.hop_length)  # [B, 1, n_fft + hop*(frames-1)]
        env = F.conv_transpose1d(torch.ones_like(spec[:1, :1]), self.window_sq, stride=self.hop_length)
        if self.center:  # drop the reflect padding (n_fft // 2 >= 1 samples) before dividing
            trim = self.n_fft // 2
            y, env = y[..., trim:-trim], env[..., trim:-trim]
        return (y / env).squeeze(1)
