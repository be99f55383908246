"""HiFT vocoder: parity with the official outputs (oracle), checkpoint layout, weight-norm folding,
batching, streaming cache, and ONNX export.

The source excitation accumulates ``2*pi*480*sum(f0*k/sr)`` radians, so float32 rounding differences in
f0 (~1e-6 relative: a different conv kernel, batch size or runtime) move the harmonic phases by ~1e-2 rad
and the waveform by ~1e-3 relative. Each stage is therefore checked twice: fed with the reference's own input,
where it must agree to float32 precision, and end to end, against a bar derived from the waveform spread the
oracle measured under float32-scale perturbations of the mel (conftest.waveform_bar).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from conftest import FIXTURES, flow_oracle_script, rel_err, waveform_bar

from cosyvoice_triton.config import F0PredictorConfig, HiftConfig, ModelConfig
from cosyvoice_triton.models.hift import HiFTGenerator, upsample_linear

CASES = ["hift_melA", "hift_flowout"]


def _load_hift(path) -> HiFTGenerator:
    model = HiFTGenerator(ModelConfig.tiny().hift).eval()
    model.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"), strict=True)
    return model


@pytest.fixture(scope="module")
def hift(tiny_dir) -> HiFTGenerator:
    return _load_hift(tiny_dir / "hift.pt")


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


def _noise(hift, z) -> torch.Tensor:
    """The official NSF noise of a case: drawn from the seeded generator, checked against the oracle's digest."""
    noise = hift.draw_noise(1, int(z["noise_sine_frames"]), generator=torch.Generator().manual_seed(int(z["seed"])))
    assert flow_oracle_script().sha256(noise) == str(z["noise_sine_sha256"])
    return noise


@pytest.fixture(scope="module")
def noises(hift, ref_npz) -> dict[str, torch.Tensor]:
    return {name: _noise(hift, ref_npz(name)) for name in CASES}


@pytest.fixture(scope="module")
def outputs(hift, ref_npz, noises):
    """Per case: our end-to-end f0, source, conv_post output and speech for the reference noise."""
    out = {}
    with torch.no_grad():
        for name in CASES:
            z = ref_npz(name)
            mel = _t(z["speech_feat"])
            f0 = hift.f0_predictor(mel)
            source = hift.source_from_f0(f0, noises[name])
            spec = hift.decode_spec(mel, source)
            out[name] = {"f0": f0, "source": source, "conv_post_out": spec, "speech": hift.spec_to_audio(spec)}
    return out


# ----------------------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("name", CASES)
def test_f0(outputs, ref_npz, name):
    assert rel_err(outputs[name]["f0"], ref_npz(name)["f0"]) <= 1e-5  # measured ~1e-7


@pytest.mark.parametrize("name", CASES)
def test_source(hift, outputs, ref_npz, noises, name):
    z = ref_npz(name)
    with torch.no_grad():
        exact = hift.source_from_f0(_t(z["f0"]), noises[name])
    assert rel_err(exact, z["source"]) <= 1e-5  # the reference f0 in: measured ~1.5e-7
    # our f0 in: measured 1.5e-7 here; ~8e-4 where the f0 convs round differently (1e-6 off): phase accumulation
    assert rel_err(outputs[name]["source"], z["source"]) <= 5e-3


@pytest.mark.parametrize("name", CASES)
def test_decode(hift, outputs, ref_npz, flow_oracle_meta, name):
    z = ref_npz(name)
    with torch.no_grad():
        if "conv_post_out" in z:  # kept for one case (file size)
            spec = hift.decode_spec(_t(z["speech_feat"]), _t(z["source"]))
            assert rel_err(spec, z["conv_post_out"]) <= 1e-5  # measured ~7e-7
            assert rel_err(hift.spec_to_audio(_t(z["conv_post_out"])), z["speech"]) <= 1e-5  # measured ~1.5e-6
            assert rel_err(outputs[name]["conv_post_out"], z["conv_post_out"]) <= 1e-3
        assert rel_err(hift.decode(_t(z["speech_feat"]), _t(z["source"])), z["speech"]) <= 1e-5
    bar = waveform_bar(flow_oracle_meta["hift_cases"][name]["waveform_spread"])
    assert rel_err(outputs[name]["speech"], z["speech"]) <= bar  # measured ~1e-6 here


def test_seeded_noise_replays_official_draws(hift, ref_npz):
    for name in CASES:
        _noise(hift, ref_npz(name))  # the digest of the official torch.manual_seed(seed) draw
    z = ref_npz("hift_melA")
    other = hift.draw_noise(1, int(z["noise_sine_frames"]), generator=torch.Generator().manual_seed(int(z["seed"]) + 1))
    assert flow_oracle_script().sha256(other) != str(z["noise_sine_sha256"])


@pytest.mark.parametrize("name", CASES)
def test_wrong_input_or_noise_fails_the_waveform_bar(hift, ref_npz, noises, flow_oracle_meta, name):
    """The derived bar still tells a wrong vocoder input apart: the mel off by 1e-4 relative, or another seed."""
    z = ref_npz(name)
    bar = waveform_bar(flow_oracle_meta["hift_cases"][name]["waveform_spread"])
    assert bar < 0.05, "the measured spread is implausibly large"
    mel = _t(z["speech_feat"])
    off = mel + 1e-4 * mel.abs().max() * torch.randn(mel.shape, generator=torch.Generator().manual_seed(0))
    assert rel_err(hift.inference(off, noise_sine=noises[name])[0], z["speech"]) > bar
    seed = int(z["seed"]) + 1
    assert rel_err(hift.inference(mel, generator=torch.Generator().manual_seed(seed))[0], z["speech"]) > bar


def test_inference_and_cache_source(hift, ref_npz, noises, flow_oracle_meta):
    z = ref_npz("hift_melA")
    mel, noise = _t(z["speech_feat"]), noises["hift_melA"]
    speech, source = hift.inference(mel, noise_sine=noise)
    with torch.no_grad():
        speech_fwd, source_fwd = hift(mel, noise)
    assert torch.equal(speech, speech_fwd) and torch.equal(source, source_fwd)
    assert rel_err(speech, z["speech"]) <= waveform_bar(flow_oracle_meta["hift_cases"]["hift_melA"]["waveform_spread"])

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


def test_fold_weight_norm(hift, ref_npz, noises):
    z = ref_npz("hift_flowout")
    mel, noise = _t(z["speech_feat"][:, :, :40]), noises["hift_flowout"][:, :40 * 480]
    folded = copy.deepcopy(hift).fold_weight_norm()
    assert not any("parametrizations" in k for k in folded.state_dict())
    assert "ups.0.weight" in folded.state_dict()
    with torch.no_grad():
        for a, b in zip(hift(mel, noise), folded(mel, noise), strict=True):
            assert rel_err(b, a) <= 1e-5  # measured 0.0


def test_batch_equals_single_calls(hift, ref_npz, noises):
    za, zb = ref_npz("hift_melA"), ref_npz("hift_flowout")
    t = za["speech_feat"].shape[2]
    mel = torch.cat([_t(za["speech_feat"]), _t(zb["speech_feat"][:, :, :t])])
    noise = torch.cat([noises["hift_melA"], noises["hift_flowout"][:, :t * 480]])
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


@pytest.mark.parametrize("name", CASES)
def test_external_reference_parity(external_tiny_dir, external_npz, name):
    """Cross-check on the external reference folder (official outputs made on another machine)."""
    model = _load_hift(external_tiny_dir / "hift.pt")
    z = external_npz(name)
    with torch.no_grad():
        exact = model.decode(_t(z["speech_feat"]), model.source_from_f0(_t(z["f0"]), _t(z["noise_sine"])))
        assert rel_err(model.f0_predictor(_t(z["speech_feat"])), z["f0"]) <= 1e-4
    assert rel_err(exact, z["speech"]) <= 1e-5
    np.testing.assert_array_equal(model.draw_noise(1, z["speech_feat"].shape[2], generator=torch.Generator()
                                                   .manual_seed(int(z["seed"]))).numpy(), z["noise_sine"])


def test_full_size_keys_and_shapes():
    expected = {}
    for line in (FIXTURES / "hift_keys_full.txt").read_text().splitlines():
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
