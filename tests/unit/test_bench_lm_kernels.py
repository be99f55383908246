"""``cosyvoice-triton bench-lm-kernels`` on a tiny demo folder: every scheme computes the Linear it stands for,
the LM with a scheme's kernels is measured against fp32, and the figures it promises are written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cosyvoice_triton.bench import lm_kernels
from cosyvoice_triton.models.demo import write_demo_model

# relative to the largest output: fp32 kernels equal nn.Linear; the int8 schemes stay near it
TOLERANCE = {"torch-fp32": 1e-5, "ort-fp32": 1e-5, "ov-fp32": 1e-5, "torch-int8": 0.05, "ort-int8": 0.2,
             "ort-int8-block32": 0.05, "ov-int8-weights": 0.05}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("bench_lm_kernels") / "tiny", size="tiny", seed=0)


@pytest.mark.parametrize("scheme", lm_kernels.SCHEMES)
def test_each_scheme_computes_the_linear(scheme):
    g = np.random.default_rng(1)
    w = (g.standard_normal((96, 64)) / 8).astype(np.float32)
    b = g.standard_normal(96).astype(np.float32)
    try:
        run = lm_kernels.kernel(scheme, w, b)
    except lm_kernels.Unavailable as exc:
        assert scheme.startswith("ov-"), exc  # onnxruntime and torch are the project's own dependencies
        pytest.skip(str(exc))
    for rows in (1, 5):
        x = g.standard_normal((rows, 64)).astype(np.float32)
        ref = x @ w.T + b
        y = run(x)
        assert y.shape == ref.shape and y.dtype == np.float32
        assert np.abs(y - ref).max() <= TOLERANCE[scheme] * np.abs(ref).max(), scheme


def test_unknown_scheme():
    with pytest.raises(ValueError, match="scheme must be one of"):
        lm_kernels.kernel("int4", np.zeros((2, 2), np.float32))


def test_the_figures(demo_dir, tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = lm_kernels.main(["--model-dir", str(demo_dir), "--batches", "1,3", "--rounds", "2",
                          "--quality-tokens", "6", "--threads", "1", "--out-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "load average" in text and "| torch-int8 |" in text
    # tiny dims: 2 layers of q, k, v, o, gate, up, down
    assert sum(r["shapes"].values()) == 14
    for scheme in lm_kernels.SCHEMES:
        s = r["schemes"][scheme]
        if "unavailable" in s:
            assert scheme.startswith("ov-") and "pip install" in s["unavailable"]
            continue
        assert set(s["step_s"]) == {"1", "3"} and all(v > 0 for v in s["step_s"].values())
        for b, v in s["step_s"].items():
            assert s["tokens_per_s_ceiling"][b] == pytest.approx(int(b) / v)
        if scheme == "torch-fp32":
            assert "quality" not in s
            continue
        q = s["quality"]
        assert q["steps"] == 7 and 0 <= q["mean_tv"] <= q["max_tv"] <= 1 and isinstance(q["meets_bar"], bool)
        if scheme.endswith("fp32"):  # another runtime's fp32 is the same LM
            assert q["max_tv"] <= 1e-3 and q["same_token"] == 1.0


def test_with_kernels_leaves_the_original_and_the_head(demo_dir):
    from cosyvoice_triton.config import ModelConfig
    from cosyvoice_triton.models.llm import load_llm

    lm = load_llm(demo_dir, ModelConfig.from_yaml(demo_dir / "cosyvoice2.yaml"))
    cand = lm_kernels.with_kernels(lm, "ort-int8-block32")
    assert not any(isinstance(m, lm_kernels.KernelLinear) for m in lm.modules())
    swapped = [m for m in cand.qwen.modules() if isinstance(m, lm_kernels.KernelLinear)]
    assert len(swapped) == sum(lm_kernels.trunk_shapes(lm).values()) and type(cand.llm_decoder) is torch.nn.Linear
