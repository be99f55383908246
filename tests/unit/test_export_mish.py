"""The exported estimator's Mish (``ExportMish``: one Exp and element-wise ops instead of onnxruntime's scalar
Softplus): equal to ``nn.Mish`` and what the fp32 export writes; ``test_onnx_export`` verifies the whole graph
against PyTorch and ``test_serving_stages`` the served pipeline against the in-process one."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from cosyvoice_triton.export.onnx_export import EstimatorGraph, ExportMish, export_graph, with_export_mish
from cosyvoice_triton.models.estimator import CausalConditionalDecoder


def test_export_mish_equals_mish_everywhere():
    x = torch.cat([torch.linspace(-200, 200, 200_001), torch.tensor([-1e30, -88.0, 19.99, 20.0, 20.01, 1e30])])
    got, ref = ExportMish()(x), nn.Mish()(x)
    assert torch.isfinite(got).all()
    err = (got - ref).abs() / ref.abs().clamp(min=1e-6)
    assert float(err.max()) < 2e-6, float(err.max())


def test_with_export_mish_replaces_a_copy_and_keeps_the_original():
    model = nn.Sequential(nn.Linear(4, 4), nn.Mish(), nn.Sequential(nn.Mish()))
    fast = with_export_mish(model)
    assert sum(isinstance(m, nn.Mish) for m in model.modules()) == 2  # untouched
    assert sum(isinstance(m, ExportMish) for m in fast.modules()) == 2
    assert not any(isinstance(m, nn.Mish) for m in fast.modules())


def test_fp32_estimator_export_has_no_softplus_and_equals_pytorch(tmp_path):
    from cosyvoice_triton.config import EstimatorConfig

    torch.manual_seed(0)
    est = CausalConditionalDecoder(EstimatorConfig(channels=(32,), attention_head_dim=8, n_blocks=1,
                                                   num_mid_blocks=1, num_heads=2)).eval()
    paths = {}
    for fast in (False, True):
        paths[fast] = tmp_path / f"est_{fast}.onnx"
        export_graph(EstimatorGraph(est, fast_mish=fast).eval(), "flow_estimator", paths[fast])
    ops = {fast: {n.op_type for n in onnx.load(str(p)).graph.node} for fast, p in paths.items()}
    assert "Softplus" in ops[False] and "Softplus" not in ops[True] and "Exp" in ops[True]
    T = 60
    g = torch.Generator().manual_seed(1)
    x, mu, cond = (torch.randn(2, 80, T, generator=g) * 3 for _ in range(3))
    feeds = {"x": x, "mask": torch.ones(2, 1, T), "mu": mu, "t": torch.rand(2, generator=g),
             "spks": torch.randn(2, 80, generator=g), "cond": cond}
    with torch.inference_mode():
        ref = est(*feeds.values(), torch.zeros(2, dtype=torch.bool)).numpy()
    sess = ort.InferenceSession(str(paths[True]), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    inputs = {k: v.numpy() for k, v in feeds.items() if k in names}
    if "streaming" in names:
        inputs["streaming"] = np.zeros(2, bool)
    got = sess.run(None, inputs)[0]
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
