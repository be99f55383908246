"""HiFT vocoder: parity with the official outputs (oracle), checkpoint layout, weight-norm folding,
batching, streaming cache, and ONNX export.

The source excitation accumulates ``2*pi*480*sum(f0*k/sr)`` radians, so float32 rounding differences in
f0 (~1e-6 relative: a different conv kernel, batch size or runtime) move the harmonic phases by ~1e-2 rad
and the waveform by a few 1e-4 relative. Each stage is therefore checked twice: fed with the reference's
own input, where it must agree to float32 precision, and end to end, against the oracle README's bars.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from cosyvoice_triton.config import F0PredictorConfig, HiftConfig, ModelConfig
from cosyvoice_triton.models.hift import HiFTGenerator, upsample_linear

CASES = ["hift_melA", "hift_flowout"]


@pytest.fixture(scope="module")
def hift(tiny_dir) -> HiFTGenerator:
    model = HiFTGenerator(ModelConfig.tiny().hift).eval()
    state = torch.load(tiny_dir / "hift.pt", weights_only=True, map_location="cpu")
    model.load_state_dict(state, strict=True)
    return model


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


@pytest.fixture(scope="module")
def outputs(hift, ref_npz):
    """Per case: our end-to-end f0, source, conv_post output and speech for the reference noise."""
    out = {}
    with torch.no_grad():
        for name in CASES:
            z = ref_npz(name)
            mel = _t(z["speech_feat"])
            f0 = hift.f0_predictor(mel)
            source = hift.source_from_f0(f0, _t(z["noise_sine"]))
            spec = hift.decode_spec(mel, source)
            out[name] = {"f0": f0, "source": source, "conv_post_out": spec, "speech": hift.spec_to_audio(spec)}
    return out


# ----------------------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("name", CASES)
def test_f0(outputs, ref_npz, name):
    assert rel_err(outputs[name]["f0"], ref_npz(name)["f0"]) <= 1e-4  # measured ~1e-6


@pytest.mark.parametrize("name", CASES)
def test_source(hift, outputs, ref_npz, name):
    z = ref_npz(name)
    with torch.no_grad():
        exact = hift.source_from_f0(_t(z["f0"]), _t(z["noise_sine"]))
    assert rel_err(exact, z["source"]) <= 1e-5  # the reference f0 in: measured ~1.2e-7
    assert rel_err(outputs[name]["source"], z["source"]) <= 5e-3  # our f0 (1e-6 off) in: measured ~8e-4


@pytest.mark.parametrize("name", CASES)
def test_decode(hift, outputs, ref_npz, name):
    z = ref_npz(name)
    with torch.no_grad():
        spec = hift.decode_spec(_t(z["speech_feat"]), _t(z["source"]))
        speech = hift.spec_to_audio(_t(z["conv_post_out"]))
    assert rel_err(spec, z["conv_post_out"]) <= 1e-5  # measured ~7e-7
    assert rel_err(speech, z["speech"]) <= 1e-5  # measured ~1.5e-6
    assert rel_err(outputs[name]["conv_post_out"], z["conv_post_out"]) <= 1e-3  # measured ~4.5e-4
    assert rel_err(outputs[name]["speech"], z["speech"]) <= 1e-3  # measured ~4-6e-4


def test_seeded_noise_replays_official_draws(hift, ref_npz):
    z = ref_npz("hift_melA")
    g = torch.Generator().manual_seed(int(z["seed"]))
    noise = hift.draw_noise(1, z["speech_feat"].shape[2], generator=g)
    np.testing.assert_array_equal(noise.numpy(), z["noise_sine"])


def test_inference_and_cache_source(hift, ref_npz):
    z = ref_npz("hift_melA")
    mel, noise = _t(z["speech_feat"]), _t(z["noise_sine"])
    speech, source = hift.inference(mel, noise_sine=noise)
    with torch.no_grad():
        speech_fwd, source_fwd = hift(mel, noise)
    assert torch.equal(speech, speech_fwd) and torch.equal(source, source_fwd)
    assert rel_err(speech, z["speech"]) <= 1e-3

    cache = torch.full((1, 1, 3840), 0.05)
    speech_c, source_c = hift.inference(mel, cache_source=cache, noise_sine=noise)
    assert torch.equal(source_c[:, :, :3840], cache) and torch.equal(source_c[:, :, 3840:], source[:, :, 3840:])
    with torch.no_grad():
        assert torch.equal(speech_c, hift.decode(mel, source_c))
    assert not torch.equal(speech_c, speech)
    empty = torch.zeros(1, 1, 0)
    assert torch.equal(hift.inference(mel, cache_source=empty, noise_sine=noise)[0], speech)


def test_seeded_noise_is_drawn_on_the_generators_device(monkeypatch):
    """A CPU generator draws on the CPU whatever device the model runs on (here: meta), so that a seed gives
    the official CPU noise on a GPU too; without a generator the noise comes from the model's device."""
    model = HiFTGenerator(ModelConfig.tiny().hift).eval()
    draw, devices = model.draw_noise, []

    def spy(batch, frames, generator=None, device=None):
        devices.append(torch.device(device))
        return draw(batch, frames, generator, device)

    monkeypatch.setattr(model, "draw_noise", spy)
    model.to("meta")
    mel = torch.zeros(1, 80, 4, device="meta")
    speech, source = model.inference(mel, generator=torch.Generator().manual_seed(0))
    assert devices == [torch.device("cpu")]
    assert speech.device.type == "meta" and speech.shape == (1, 4 * 480) and source.shape == (1, 1, 4 * 480)
    model.inference(mel)
    assert devices[-1] == torch.device("meta")


def test_fold_weight_norm(hift, ref_npz):
    z = ref_npz("hift_flowout")
    mel, noise = _t(z["speech_feat"][:, :, :40]), _t(z["noise_sine"][:, :40 * 480])
    folded = copy.deepcopy(hift).fold_weight_norm()
    assert not any("parametrizations" in k for k in folded.state_dict())
    assert "ups.0.weight" in folded.state_dict()
    with torch.no_grad():
        for a, b in zip(hift(mel, noise), folded(mel, noise), strict=True):
            assert rel_err(b, a) <= 1e-5  # measured 0.0


def test_batch_equals_single_calls(hift, ref_npz):
    za, zb = ref_npz("hift_melA"), ref_npz("hift_flowout")
    t = za["speech_feat"].shape[2]
    mel = torch.cat([_t(za["speech_feat"]), _t(zb["speech_feat"][:, :, :t])])
    noise = torch.cat([_t(za["noise_sine"]), _t(zb["noise_sine"][:, :t * 480])])
    with torch.no_grad():
        f0 = hift.f0_predictor(mel)
        source = hift.source_from_f0(f0, noise)
        speech = hift.decode(mel, source)
        speech_fwd, _ = hift(mel, noise)
        for i in range(2):
            one = slice(i, i + 1)
            # conv kernels may round differently for B=1 and B=2 (~1e-6 in f0); given the same input,
            # each later stage must agree to float32 precision, and end to end within the oracle bar
            assert rel_err(hift.f0_predictor(mel[one]), f0[one]) <= 1e-5
            assert rel_err(hift.source_from_f0(f0[one], noise[one]), source[one]) <= 1e-6
            assert rel_err(hift.decode(mel[one], source[one]), speech[one]) <= 1e-5
            assert rel_err(hift(mel[one], noise[one])[0], speech_fwd[one]) <= 1e-3


# ---------------------------------------------------------------------------------------- layout


def test_full_size_keys_and_shapes(reference_dir):
    expected = {}
    for line in (reference_dir / "hift_keys_full.txt").read_text().splitlines():
        if line.strip():
            key, shape, dtype = line.split("\t")
            expected[key] = (shape, dtype)
    model = HiFTGenerator(ModelConfig.full().hift)
    got = {k: (str(tuple(v.shape)), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
    assert got == expected
    assert sum(p.numel() for p in model.parameters()) == 20_821_295


def test_upsample_linear_is_bit_exact():
    g = torch.Generator().manual_seed(0)
    for t in (1, 2, 7, 150):
        x = torch.cumsum(torch.rand(2, t, 9, generator=g), 1) * 3000.0
        ref = F.interpolate(x.transpose(1, 2), scale_factor=480, mode="linear").transpose(1, 2)
        assert torch.equal(upsample_linear(x, 480), ref)


# ------------------------------------------------------------------------------------------- ONNX


def _small_voiced_model() -> HiFTGenerator:
    """Random tiny HiFT whose f0 is mostly voiced (random init gives f0 ~ 0.1 Hz: all unvoiced)."""
    torch.manual_seed(0)
    cfg = HiftConfig(base_channels=16, f0_predictor=F0PredictorConfig(cond_channels=16))
    model = HiFTGenerator(cfg).eval()
    with torch.no_grad():
        model.f0_predictor.classifier.weight.mul_(200.0)
        model.f0_predictor.classifier.bias.fill_(150.0)
    return model


class _WithF0(torch.nn.Module):
    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        self.hift = hift

    def forward(self, speech_feat, noise_sine):
        f0 = self.hift.f0_predictor(speech_feat)
        source = self.hift.source_from_f0(f0, noise_sine)
        return self.hift.decode(speech_feat, source), source, f0


def test_onnx_export_matches_torch(tmp_path):
    model = _small_voiced_model().fold_weight_norm()
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 80, 5, generator=g) - 5.0, torch.randn(1, 5 * 480, 9, generator=g))
    path = tmp_path / "hift.onnx"
    with warnings.catch_warnings():  # the legacy exporter's deprecation and constant-folding notices
        warnings.simplefilter("ignore")
        torch.onnx.export(_WithF0(model), args, str(path), dynamo=False, opset_version=17,
                          input_names=["speech_feat", "noise_sine"], output_names=["speech", "source", "f0"],
                          dynamic_axes={"speech_feat": {0: "B", 2: "T"}, "noise_sine": {0: "B", 1: "L"},
                                        "speech": {0: "B", 1: "L"}, "source": {0: "B", 2: "L"},
                                        "f0": {0: "B", 1: "T"}})
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    mel, noise = torch.randn(2, 80, 23, generator=g) - 5.0, torch.randn(2, 23 * 480, 9, generator=g)
    speech, source, f0 = sess.run(None, {"speech_feat": mel.numpy(), "noise_sine": noise.numpy()})
    with torch.no_grad():
        ref_speech, _, ref_f0 = _WithF0(model)(mel, noise)
        assert (ref_f0 > 10).float().mean() > 0.5  # the harmonic path is exercised
        assert rel_err(f0, ref_f0) <= 1e-5
        # the graph, given ONNX Runtime's f0 (its convs round differently), against PyTorch
        src_given_f0 = model.source_from_f0(torch.from_numpy(f0), noise)
        assert rel_err(source, src_given_f0) <= 1e-4
        assert rel_err(speech, model.decode(mel, src_given_f0)) <= 1e-4
    assert rel_err(speech, ref_speech) <= 1e-3  # end to end
