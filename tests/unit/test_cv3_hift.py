"""CosyVoice3's causal HiFT vocoder against the official outputs (tests/fixtures/cv3_hift_oracle), its loading
checks and its full-size layout.

Each stage is checked fed with the official input (f0 from the official mel, source from the official f0, waveform
from the official source), where it must agree to floating-point precision, and end to end, against the waveform
bar derived from the spread the oracle measured under float32-scale perturbations of the mel
(conftest.waveform_bar). The weights are seeded draws regenerated here and checked by digest; the noise buffer is
replayed from the seed and checked against the official buffer's digest. tests/oracle/cosyvoice3_hift.md has the
measured figures.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import FIXTURES, oracle_fixtures, oracle_script, rel_err, waveform_bar

from cosyvoice_triton.config import load_hyperpyyaml
from cosyvoice_triton.errors import CheckpointError, ConfigError
from cosyvoice_triton.models.cosyvoice3.hift import (
    NOISE_MAX_SAMPLES,
    CausalConv1dUpsample,
    CausalHiFTGenerator,
    CausalNsfNoise,
    Hift3Dims,
    draw_causal_nsf_noise,
    load_hift3,
)

ORACLE = FIXTURES / "cv3_hift_oracle"
CASES = ["hift_nonstream", "hift_lookahead"]
F0_BAR = 1e-12  # float64 f0 from the official mel (relative)
STAGE_BAR = 1e-5  # source from the official f0, waveform / conv_post from the official source (relative)


def _oracle_script():
    return oracle_script("make_cv3_hift_oracle")


meta, npz = oracle_fixtures(ORACLE)


@pytest.fixture(scope="module")
def hift_file(tmp_path_factory, meta):
    """The oracle's tiny ``hift.pt``, regenerated from its seeded draws and checked against the loaded digest."""
    script = _oracle_script()
    d = tmp_path_factory.mktemp("cv3_hift")
    digest = script.write_weights(d, seed=meta["seeds"]["weights"])
    assert digest == meta["weights"]["state_sha256"], (
        "hift.pt regenerated from the seeded draws differs from the oracle's: torch's normal draws follow another "
        "kernel here (ATEN_CPU_CAPABILITY=default changes them) or another torch initialises differently")
    return d / "hift.pt"


@pytest.fixture(scope="module")
def hift(hift_file, meta) -> CausalHiFTGenerator:
    return load_hift3(hift_file, Hift3Dims.tiny(), noise_seed=meta["seeds"]["noise"])


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


# ----------------------------------------------------------------------------------------- oracle


def test_noise_replays_the_official_buffer(npz, meta):
    seed = meta["seeds"]["noise"]
    for name in [*CASES, "hift_stream"]:
        z = npz(name)
        noise = draw_causal_nsf_noise(int(z["noise_samples"]), torch.Generator().manual_seed(seed))
        assert _oracle_script().sha256(noise) == str(z["noise_sha256"]), name
    z = npz("hift_stream")
    other = draw_causal_nsf_noise(int(z["noise_samples"]), torch.Generator().manual_seed(seed + 1))
    assert _oracle_script().sha256(other) != str(z["noise_sha256"])
    # grown on demand, the buffer is one long draw
    grown = CausalNsfNoise(seed)
    for samples in (1000, 1500, 7000, 480 * 160, 10):
        part = grown(samples)
        assert part.shape == (1, samples, 9)
    assert _oracle_script().sha256(grown(int(z["noise_samples"]))) == str(z["noise_sha256"])
    assert meta["unused_draws"]["max_change_zeroing_rand_ini_and_uv"] == 0.0
    with pytest.raises(ValueError, match="300 s"):
        draw_causal_nsf_noise(NOISE_MAX_SAMPLES + 1)


@pytest.mark.parametrize("name", CASES)
def test_f0(hift, npz, name):
    z = npz(name)
    finalize = bool(z["finalize"])
    with torch.inference_mode():
        f0 = hift.f0_predictor(_t(z["speech_feat"]).double(), finalize=finalize)
        f0_32 = hift.predict_f0(_t(z["speech_feat"]), finalize)
    assert f0.dtype == torch.float64 and f0_32.dtype == torch.float32
    assert rel_err(f0, z["f0"]) <= F0_BAR
    assert rel_err(f0_32, z["f0"].astype(np.float32)) <= 1e-7


@pytest.mark.parametrize("name", CASES)
def test_source(hift, npz, name):
    z = npz(name)
    with torch.inference_mode():
        given = hift.source_from_f0(_t(z["f0"].astype(np.float32)))  # the official cast to float32
        ours = hift.source_from_f0(hift.predict_f0(_t(z["speech_feat"]), bool(z["finalize"])))
    assert rel_err(given, z["source"]) <= STAGE_BAR
    assert rel_err(ours, z["source"]) <= STAGE_BAR


@pytest.mark.parametrize("name", CASES)
def test_decode(hift, npz, name):
    z = npz(name)
    finalize = bool(z["finalize"])
    mel = _t(z["speech_feat"]) if finalize else _t(z["speech_feat"][:, :, :-3])
    with torch.inference_mode():
        if "conv_post_out" in z:
            spec = hift.decode_spec(mel, _t(z["source"]), finalize)
            assert rel_err(spec, z["conv_post_out"]) <= STAGE_BAR
            assert rel_err(hift.spec_to_audio(_t(z["conv_post_out"])), z["speech"]) <= STAGE_BAR
        assert rel_err(hift.decode(mel, _t(z["source"]), finalize), z["speech"]) <= STAGE_BAR


@pytest.mark.parametrize("name", CASES)
def test_waveform(hift, npz, meta, name):
    z = npz(name)
    speech, source = hift.inference(_t(z["speech_feat"]), finalize=bool(z["finalize"]))
    frames = z["speech_feat"].shape[2]
    assert speech.shape == (1, 480 * (frames if z["finalize"] else frames - 8))
    assert source.shape == (1, 1, 480 * (frames if z["finalize"] else frames - 3))
    bar = waveform_bar(meta["hift_cases"][name.removeprefix("hift_")]["waveform_spread"])
    assert rel_err(speech, z["speech"]) <= bar
    assert rel_err(source, z["source"]) <= STAGE_BAR


def _stream(hift, mel: torch.Tensor, calls, noise=None) -> list[torch.Tensor]:
    """``CosyVoice3Model.token2wav``'s use of the vocoder: each call on the whole mel so far, the last one
    finalizing, keeping the samples past those already returned."""
    chunks, offset = [], 0
    for i, frames in enumerate(calls):
        speech, _ = hift.inference(mel[:, :, :frames], finalize=i == len(calls) - 1, noise=noise)
        chunks.append(speech[:, offset:])
        offset += chunks[-1].shape[1]
    return chunks


def test_stream(hift, npz, meta):
    z = npz("hift_stream")
    mel = _t(z["speech_feat"])
    chunks = _stream(hift, mel, z["calls_frames"].tolist())
    assert [c.shape[1] for c in chunks] == z["chunk_lens"].tolist()
    bar = waveform_bar(meta["hift_cases"]["stream"]["waveform_spread"])
    assert rel_err(torch.cat(chunks, dim=1), z["speech"]) <= bar
    oneshot, _ = hift.inference(mel)
    assert rel_err(oneshot, z["oneshot_speech"]) <= bar
    # causal: the stream equals the one-shot output, as in the official code
    assert rel_err(torch.cat(chunks, dim=1), oneshot) <= 1e-5  # official 1.1e-6 (different conv lengths)


@pytest.mark.parametrize("name", CASES)
def test_wrong_input_or_noise_fails_the_waveform_bar(hift, npz, meta, name):
    """The derived bar still tells a wrong vocoder input apart: the mel off by 1e-4 relative, or another seed."""
    z = npz(name)
    finalize = bool(z["finalize"])
    bar = waveform_bar(meta["hift_cases"][name.removeprefix("hift_")]["waveform_spread"])
    assert bar < 0.05, "the measured spread is implausibly large"
    mel = _t(z["speech_feat"])
    off = mel + 1e-4 * mel.abs().max() * torch.randn(mel.shape, generator=torch.Generator().manual_seed(0))
    assert rel_err(hift.inference(off, finalize)[0], z["speech"]) > bar
    other = draw_causal_nsf_noise(480 * mel.shape[2], torch.Generator().manual_seed(meta["seeds"]["noise"] + 1))
    assert rel_err(hift.inference(mel, finalize, noise=other)[0], z["speech"]) > bar


# ----------------------------------------------------------------------------------- behaviour


def test_batch_equals_single_calls(hift, npz):
    za, zb = npz("hift_nonstream"), npz("hift_stream")
    t = za["speech_feat"].shape[2]
    mel = torch.cat([_t(za["speech_feat"]), _t(zb["speech_feat"][:, :, :t])])
    for finalize in (True, False):
        speech, source = hift.inference(mel, finalize)
        for i in range(2):
            one_speech, one_source = hift.inference(mel[i:i + 1], finalize)
            assert rel_err(source[i:i + 1], one_source) <= 1e-6
            assert rel_err(speech[i:i + 1], one_speech) <= 1e-5


def test_fold_weight_norm(hift, npz):
    z = npz("hift_nonstream")
    mel = _t(z["speech_feat"])
    folded = copy.deepcopy(hift).fold_weight_norm()
    keys = folded.state_dict()
    assert not any("parametrizations" in k for k in keys)
    assert keys["ups.0.weight"].dtype == torch.float32 and keys["f0_predictor.condnet.0.weight"].dtype == torch.float64
    for finalize in (True, False):
        a, b = hift.inference(mel, finalize)[0], folded.inference(mel, finalize)[0]
        assert rel_err(b, a) <= 1e-5


def test_nearest_upsampling_is_torchs():
    """The repetitions stand for ``nn.Upsample(mode="nearest")`` (the layers) and ``F.interpolate(mode="nearest")``
    (the source's phase); torch computes those indices in float32, so check they are the plain repetitions."""
    g = torch.Generator().manual_seed(0)
    for rate in (8, 5, 3):
        layer = CausalConv1dUpsample(4, 4, 3, rate)
        x = torch.randn(2, 4, 1500, generator=g)
        assert torch.equal(torch.repeat_interleave(x, rate, dim=2),
                           torch.nn.Upsample(scale_factor=rate, mode="nearest")(x))
        assert layer(x).shape == (2, 4, 1500 * rate)
    x = torch.randn(1, 9, 2000, generator=g)
    ref = F.interpolate(x, scale_factor=480, mode="nearest")
    assert torch.equal(torch.repeat_interleave(x, 480, dim=2), ref)


def test_lookahead_lengths_and_causality():
    """``finalize=False`` returns 480 (T - 8) samples that more mel does not change."""
    torch.manual_seed(0)
    model = CausalHiFTGenerator(Hift3Dims(base_channels=16, f0_cond_channels=16)).eval()
    assert model.dims.held_frames == 8
    mel = torch.randn(1, 80, 30, generator=torch.Generator().manual_seed(1)) - 5.0
    part, source = model.inference(mel[:, :, :20], finalize=False)
    assert part.shape == (1, 480 * 12) and source.shape == (1, 1, 480 * 17)
    whole, _ = model.inference(mel)
    assert rel_err(whole[:, :part.shape[1]], part) <= 1e-6


# ------------------------------------------------------------------------------------------ layout


def test_full_size_keys_and_shapes(meta):
    expected = {}
    for line in (FIXTURES / "cv3_hift_keys_full.txt").read_text().splitlines():
        if line.strip():
            key, shape, dtype = line.split("\t")
            expected[key] = (shape, dtype)
    model = CausalHiFTGenerator(Hift3Dims.full())
    got = {k: (str(tuple(v.shape)), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
    assert got == expected
    assert sum(p.numel() for p in model.parameters()) == meta["full"]["parameters"]


def test_dims(meta):
    assert Hift3Dims(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
                        for k, v in meta["full"]["dims"].items()}) == Hift3Dims.full()
    text = """
sample_rate: 24000
hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    base_channels: 64
    sampling_rate: !ref <sample_rate>
    upsample_rates: [8, 5, 3]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        cond_channels: 64
"""
    assert Hift3Dims.from_section(load_hyperpyyaml(text)["hift"]) == Hift3Dims.tiny()
    with pytest.raises(ConfigError, match="CausalHiFTGenerator"):
        Hift3Dims.from_section(load_hyperpyyaml(text.replace("CausalHiFTGenerator", "HiFTGenerator"))["hift"])
    with pytest.raises(ConfigError, match="CausalConvRNNF0Predictor"):
        Hift3Dims.from_section(load_hyperpyyaml(text.replace("CausalConvRNN", "ConvRNN"))["hift"])
    with pytest.raises(ConfigError, match="9 columns"):
        Hift3Dims(nb_harmonics=7)


def test_load_accepts_the_official_spellings(hift, hift_file, tmp_path):
    state = torch.load(hift_file, weights_only=True)
    renamed = {}
    for k, v in state.items():  # "generator." prefixes (removed by the official loader), legacy weight norm names
        k = k.replace(".parametrizations.weight.original0", ".weight_g").replace(".parametrizations.weight.original1",
                                                                                 ".weight_v")
        renamed["generator." + k] = v
    torch.save(renamed, tmp_path / "hift.pt")
    again = load_hift3(tmp_path / "hift.pt", Hift3Dims.tiny())
    ref = hift.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in again.state_dict().items())
    assert again.f0_predictor.classifier.weight.dtype == torch.float64 and not again.training


def test_load_refuses(hift_file, tmp_path):
    state = torch.load(hift_file, weights_only=True)
    cases = {
        "missing": {k: v for k, v in state.items() if k != "conv_post.bias"},
        "unexpected": {**state, "conv_post.extra": torch.zeros(1)},
        "shape": {**state, "m_source.l_linear.weight": torch.zeros(1, 8)},
    }
    for name, bad in cases.items():
        torch.save(bad, tmp_path / f"{name}.pt")
    with pytest.raises(CheckpointError, match="1 missing.*conv_post.bias"):
        load_hift3(tmp_path / "missing.pt", Hift3Dims.tiny())
    with pytest.raises(CheckpointError, match="1 unexpected.*conv_post.extra"):
        load_hift3(tmp_path / "unexpected.pt", Hift3Dims.tiny())
    with pytest.raises(CheckpointError, match=r"m_source.l_linear.weight: file \(1, 8\) vs model \(1, 9\)"):
        load_hift3(tmp_path / "shape.pt", Hift3Dims.tiny())
    with pytest.raises(CheckpointError, match="other shapes.*CosyVoice2 hift.pt"):  # the CosyVoice2 vocoder
        load_hift3(FIXTURES / "flow_oracle" / "hift.pt", Hift3Dims.tiny())
    with pytest.raises(CheckpointError, match="other shapes"):  # right file, wrong dims
        load_hift3(hift_file, Hift3Dims(base_channels=32, f0_cond_channels=64))
    torch.save({"conv_pre.bias": "text"}, tmp_path / "pickled.pt")
    with pytest.raises(CheckpointError, match="refusing|not a tensor"):
        load_hift3(tmp_path / "pickled.pt", Hift3Dims.tiny())
    with pytest.raises(CheckpointError, match="not found"):
        load_hift3(tmp_path / "absent.pt", Hift3Dims.tiny())
