"""Serving one model folder after another with the same build folders: ``serve`` (its ``prepare``) exports again
the graphs that are not this folder's (the export manifest's source digests against the folder's checkpoint
files), refuses quantised graphs made from another folder's fp32 ones, and each served folder answers with its
own weights (against the library on that folder)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import PATIENCE_S, PATIENT_TEST_S, rel_err, served, speech_pair

from cosyvoice_triton.export import onnx_export
from cosyvoice_triton.export.onnx_export import stale_graphs
from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.serving.launch.serve import check_precision_sources, prepare
from cosyvoice_triton.shapes import GRAPHS


@pytest.fixture(autouse=True)
def _unverified_export(monkeypatch):
    """prepare's exports without their verification (tests/unit/test_onnx_export.py checks it): half the time."""
    export = onnx_export.export_onnx
    monkeypatch.setattr(onnx_export, "export_onnx", lambda *a, **kw: export(*a, **{**kw, "verify": False}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_folders")
    return {"root": root, "a": write_demo_model(root / "demo-a", size="tiny", seed=0),
            "b": write_demo_model(root / "demo-b", size="tiny", seed=1)}


def _manifest(onnx_dir):
    return json.loads((onnx_dir / "fp32" / "manifest.json").read_text())


@pytest.mark.timeout(PATIENT_TEST_S)
def test_the_export_is_made_again_for_another_folder_and_only_then(folders, capsys):
    root, a, b = folders["root"], folders["a"], folders["b"]
    onnx_dir, repo = root / "onnx-unit", root / "repo-unit"
    assert set(stale_graphs(a, onnx_dir / "fp32")) == set(GRAPHS)  # nothing exported yet
    prepare(a, onnx_dir=onnx_dir, repository=repo)
    assert stale_graphs(a, onnx_dir / "fp32") == {}
    why = stale_graphs(b, onnx_dir / "fp32")
    assert set(why) == set(GRAPHS) and all("exported from another" in w for w in why.values()), why
    capsys.readouterr()
    prepare(b, onnx_dir=onnx_dir, repository=repo)
    assert "exporting ONNX graphs of" in capsys.readouterr().out
    assert _manifest(onnx_dir)["source_model_dir"] == str(b.resolve())
    assert stale_graphs(b, onnx_dir / "fp32") == {} and set(stale_graphs(a, onnx_dir / "fp32")) == set(GRAPHS)
    prepare(b, onnx_dir=onnx_dir, repository=repo)  # the same folder again: nothing to export
    assert "exporting" not in capsys.readouterr().out
    # a graph edited after its export is stale too
    est = onnx_dir / "fp32" / "flow_estimator.onnx"
    est.write_bytes(est.read_bytes() + b"\0")
    assert stale_graphs(b, onnx_dir / "fp32") == {"flow_estimator": "changed since its export"}


def test_quantised_graphs_of_another_folder_are_refused(folders, tmp_path):
    onnx_dir = tmp_path / "onnx"
    (onnx_dir / "fp32").mkdir(parents=True)
    (onnx_dir / "int8_cpu").mkdir()
    (onnx_dir / "fp32" / "flow_encoder.onnx").write_bytes(b"this folder's graph")
    (onnx_dir / "int8_cpu" / "flow_encoder.onnx").write_bytes(b"quantised from another graph")
    (onnx_dir / "int8_cpu" / "manifest.json").write_text(json.dumps(
        {"graphs": {"flow_encoder": {"fp32_sha256": "0" * 64}}}))
    check_precision_sources(folders["a"], onnx_dir, "fp32")  # fp32 serves no quantised graph
    with pytest.raises(FileNotFoundError, match="made from another fp32 graph"):
        check_precision_sources(folders["a"], onnx_dir, "int8_cpu")


@pytest.mark.timeout(PATIENT_TEST_S)
def test_two_folders_served_in_turn_each_answer_with_their_own_weights(folders):
    from cosyvoice_triton.clients.client import VCClient
    from cosyvoice_triton.pipeline import CosyVoice2

    src, ssr, prm, psr = speech_pair(1.5, 1.0)
    root = folders["root"]
    answers = {}
    for name in ("a", "b"):
        repo = prepare(folders[name], onnx_dir=root / "onnx-served", repository=root / "repo-served")
        with served(repo) as server, VCClient(server.http_url, timeout=PATIENCE_S) as client:
            answers[name] = client.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=3).waveform
        ref = CosyVoice2.from_pretrained(folders[name]).convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=3)
        assert answers[name].shape == ref.shape
        assert rel_err(answers[name], ref) < 1e-3, f"folder {name}: the served answer is not its library output"
    assert not np.allclose(answers["a"], answers["b"])
