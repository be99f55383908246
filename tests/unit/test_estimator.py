"""CausalConditionalDecoder: official-checkpoint parity, full-size keys, padding, causality, ONNX export."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conftest import FIXTURES, rel_err

from cosyvoice_triton.config import EstimatorConfig, ModelConfig
from cosyvoice_triton.errors import ConfigError
from cosyvoice_triton.models.estimator import CausalConditionalDecoder, chunk_causal_mask

PREFIX = "decoder.estimator."
INPUTS = ("x", "mask", "mu", "t", "spks", "cond")
TINY = ModelConfig.tiny().flow.estimator


def load_tiny_estimator(tiny_dir) -> CausalConditionalDecoder:
    sd = torch.load(tiny_dir / "flow.pt", map_location="cpu", weights_only=True)
    est = CausalConditionalDecoder(TINY).eval()
    est.load_state_dict({k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}, strict=True)
    return est


@pytest.fixture(scope="module")
def tiny_est(tiny_dir) -> CausalConditionalDecoder:
    return load_tiny_estimator(tiny_dir)


@pytest.fixture(scope="module")
def random_est() -> CausalConditionalDecoder:
    """Tiny dims, seeded random weights with non-trivial norms and biases (no oracle needed)."""
    torch.manual_seed(1)
    est = CausalConditionalDecoder(TINY).eval()
    with torch.no_grad():
        for p in est.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return est


def random_inputs(b: int, t: int, lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None, None, :] < torch.tensor(lengths)[:, None, None]).float()
    return {
        "x": torch.randn(b, 80, t, generator=g), "mask": mask, "mu": torch.randn(b, 80, t, generator=g),
        "t": torch.rand(b, generator=g), "spks": torch.randn(b, 80, generator=g),
        "cond": torch.randn(b, 80, t, generator=g),
    }


@pytest.mark.parametrize("case", ["estimator_nonstream", "estimator_stream"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["bool", "tensor"])
def test_official_parity(tiny_est, ref_npz, case, as_tensor):
    ref = ref_npz(case)
    streaming = torch.from_numpy(ref["streaming"]) if as_tensor else bool(ref["streaming"])
    with torch.no_grad():
        out = tiny_est(*(torch.from_numpy(ref[k]) for k in INPUTS), streaming=streaming)
    assert rel_err(out.numpy(), ref["out"]) <= 1e-5


@pytest.mark.parametrize("case", ["estimator_nonstream", "estimator_stream"])
def test_external_reference_parity(external_tiny_dir, external_npz, case):
    """Cross-check on the external reference folder (official outputs made on another machine)."""
    est = load_tiny_estimator(external_tiny_dir)
    ref = external_npz(case)
    with torch.no_grad():
        out = est(*(torch.from_numpy(ref[k]) for k in INPUTS), streaming=bool(ref["streaming"]))
    assert rel_err(out.numpy(), ref["out"]) <= 1e-4


def test_full_size_state_dict_matches_release_keys():
    rows = (FIXTURES / "flow_keys_full.txt").read_text().splitlines()
    expected = {}
    for row in rows:
        key, shape, dtype = row.split("\t")
        if key.startswith(PREFIX):
            expected[key] = (shape, dtype)
    with torch.device("meta"):
        est = CausalConditionalDecoder(ModelConfig.full().flow.estimator)
    got = {PREFIX + k: (str(tuple(v.shape)), str(v.dtype).removeprefix("torch."))
           for k, v in est.state_dict().items()}
    assert got == expected
    assert len(got) == 910 and sum(p.numel() for p in est.parameters()) == 71_302_480


def test_rejects_multi_level_unet():
    with pytest.raises(ConfigError):
        CausalConditionalDecoder(EstimatorConfig(channels=(64, 64)))


def test_chunk_causal_mask():
    m = chunk_causal_mask(7, 3)
    assert m.dtype == torch.bool and m.shape == (7, 7)
    for i in range(7):
        assert m[i].tolist() == [j < (i // 3 + 1) * 3 for j in range(7)]


@pytest.mark.parametrize("streaming", [False, True])
def test_padded_batch_equals_per_item(random_est, streaming):
    lengths = [97, 61]
    batch = random_inputs(2, 97, lengths)
    with torch.no_grad():
        out = random_est(**batch, streaming=streaming)
        for i, n in enumerate(lengths):
            item = {k: v[i:i + 1, :, :n] if v.dim() == 3 else v[i:i + 1] for k, v in batch.items()}
            one = random_est(**item, streaming=streaming)
            assert rel_err(out[i:i + 1, :, :n].numpy(), one.numpy()) <= 1e-5
    assert torch.all(out[1, :, 61:] == 0)


def test_streaming_is_chunk_causal(random_est):
    """With streaming, frames of chunk k (50 frames) do not depend on any later frame; without, they do."""
    a = random_inputs(1, 130, [130])
    b = {k: v.clone() for k, v in a.items()}
    b["x"][:, :, 100:] += 1.0
    b["cond"][:, :, 100:] -= 1.0
    with torch.no_grad():
        sa, sb = random_est(**a, streaming=True), random_est(**b, streaming=True)
        fa, fb = random_est(**a, streaming=False), random_est(**b, streaming=False)
    assert torch.equal(sa[..., :100], sb[..., :100])
    assert not torch.allclose(sa[..., 100:], sb[..., 100:])
    assert not torch.allclose(fa[..., :100], fb[..., :100])


def test_fully_padded_item_is_finite_and_zero(random_est):
    batch = random_inputs(2, 40, [40, 0])
    with torch.no_grad():
        out = random_est(**batch, streaming=torch.tensor(True))
    assert torch.isfinite(out).all() and torch.all(out[1] == 0)


def test_fp16_safe_mask_bias_matches_fp32(random_est):
    safe = CausalConditionalDecoder(TINY, mask_bias=-1e4).eval()
    safe.load_state_dict(random_est.state_dict())
    batch = random_inputs(2, 120, [120, 83])
    with torch.no_grad():
        for streaming in (False, True):
            ref = random_est(**batch, streaming=streaming)
            assert rel_err(safe(**batch, streaming=streaming).numpy(), ref.numpy()) <= 1e-6


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_onnx_export_dynamic_batch_time_and_streaming_input(random_est):
    ort = pytest.importorskip("onnxruntime")
    names = [*INPUTS, "streaming"]
    dyn = {k: ({0: "batch"} if k in ("t", "spks") else {0: "batch", 2: "time"}) for k in (*INPUTS, "out")}
    example = random_inputs(2, 60, [60, 60])
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(random_est, (*example.values(), torch.tensor(False)), buf, dynamo=False,
                          opset_version=17, input_names=names, output_names=["out"], dynamic_axes=dyn)
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == names
    feed = random_inputs(3, 131, [131, 100, 57], seed=3)
    for streaming in (False, True):
        with torch.no_grad():
            ref = random_est(**feed, streaming=streaming).numpy()
        out = sess.run(None, {**{k: v.numpy() for k, v in feed.items()}, "streaming": np.array(streaming)})[0]
        assert rel_err(out, ref) <= 1e-4
