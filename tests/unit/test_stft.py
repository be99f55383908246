"""Real-valued STFT / iSTFT against torch.stft / torch.istft, and through ONNX Runtime."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cosyvoice_triton.models.stft import ISTFT, STFT

# (n_fft, hop, win_length): HiFT's iSTFT head, a speech-frontend-like config, a shorter window, odd n_fft
CONFIGS = [(16, 4, None), (400, 160, None), (16, 4, 12), (15, 5, None)]


def _torch_stft(x: torch.Tensor, n_fft: int, hop: int, win: int | None) -> torch.Tensor:
    spec = torch.stft(x, n_fft, hop, win, window=torch.hann_window(win or n_fft), return_complex=True)
    return torch.cat([spec.real, spec.imag], dim=1)


@pytest.mark.parametrize(("n_fft", "hop", "win"), CONFIGS)
@pytest.mark.parametrize("length", [401, 480, 4803])
def test_stft_matches_torch(n_fft, hop, win, length):
    x = torch.randn(3, length, generator=torch.Generator().manual_seed(length))
    ref = _torch_stft(x, n_fft, hop, win)
    out = STFT(n_fft, hop, win)(x)
    assert out.shape == ref.shape
    # float32 summation error of an n_fft-long dot product: ~1e-6 (n_fft 16) to ~3e-5 (n_fft 400) here
    assert (out - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    if n_fft == 16:
        assert (out - ref).abs().max().item() < 1e-5


def test_stft_center_false():
    x = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0))
    w = torch.hann_window(64)
    spec = torch.stft(x, 64, 16, window=w, center=False, return_complex=True)
    out = STFT(64, 16, center=False)(x)
    assert (out - torch.cat([spec.real, spec.imag], 1)).abs().max().item() < 1e-5


@pytest.mark.parametrize(("n_fft", "hop", "win"), CONFIGS)
@pytest.mark.parametrize("frames", [2, 7, 301])
def test_istft_matches_torch(n_fft, hop, win, frames):
    g = torch.Generator().manual_seed(frames)
    spec = torch.complex(torch.randn(2, n_fft // 2 + 1, frames, generator=g),
                         torch.randn(2, n_fft // 2 + 1, frames, generator=g))
    ref = torch.istft(spec, n_fft, hop, win, window=torch.hann_window(win or n_fft))
    out = ISTFT(n_fft, hop, win)(spec.real, spec.imag)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-5


def test_istft_inverts_stft():
    x = torch.randn(2, 4800, generator=torch.Generator().manual_seed(1))
    spec = STFT(16, 4)(x)
    y = ISTFT(16, 4)(spec[:, :9], spec[:, 9:])
    assert y.shape == x.shape  # hop * (frames - 1) = N when hop divides N
    assert (y - x).abs().max().item() < 1e-5


def test_bases_are_not_in_state_dict():
    assert STFT(16, 4).state_dict() == {} and ISTFT(16, 4).state_dict() == {}
    assert {n for n, _ in ISTFT(16, 4).named_buffers()} == {"basis", "window_sq"}


class _RoundTrip(torch.nn.Module):
    def __init__(self, n_fft: int, hop: int):
        super().__init__()
        self.stft, self.istft = STFT(n_fft, hop), ISTFT(n_fft, hop)
        self.bins = n_fft // 2 + 1

    def forward(self, x: torch.Tensor, spec: torch.Tensor):
        s = self.stft(x)
        return s, self.istft(spec[:, : self.bins], spec[:, self.bins:])


@pytest.mark.parametrize(("n_fft", "hop"), [(16, 4), (400, 160)])
def test_onnx_export_dynamic_length(tmp_path, n_fft, hop):
    path = tmp_path / "stft.onnx"
    model = _RoundTrip(n_fft, hop).eval()
    bins = n_fft // 2 + 1
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 1000, generator=g), torch.randn(2, 2 * bins, 20, generator=g))
    with warnings.catch_warnings():  # the legacy exporter's deprecation and constant-folding notices
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17,
                          input_names=["x", "spec"], output_names=["stft", "istft"],
                          dynamic_axes={"x": {0: "B", 1: "N"}, "spec": {0: "B", 2: "frames"},
                                        "stft": {0: "B", 2: "frames_out"}, "istft": {0: "B", 1: "N_out"}})
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x, spec = torch.randn(3, 2345, generator=g), torch.randn(3, 2 * bins, 57, generator=g)
    out_stft, out_istft = sess.run(None, {"x": x.numpy(), "spec": spec.numpy()})
    ref_stft, ref_istft = model(x, spec)
    assert out_stft.shape == tuple(ref_stft.shape) and out_istft.shape == tuple(ref_istft.shape)
    np.testing.assert_allclose(out_stft, ref_stft.numpy(), rtol=0, atol=1e-6 * ref_stft.abs().max().item())
    np.testing.assert_allclose(out_istft, ref_istft.numpy(), rtol=0, atol=1e-6)
