"""CosyVoice3's vocoder graph in onnxruntime's CPU INT8 (``export/quantize3.py``, ``quantize`` on a cosyvoice3
folder) on the tiny demo model: the calls it calibrates on are the pipeline's own vocoder calls, the graph is static
QLinearConv with the head and the source STFT kept float, close to fp32, its manifest ties it to the fp32 graph and
records the verdict; the render serves it only where that verdict allows, on the local flavor, and refuses a file it
cannot trace."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from conftest import ROOT, int8_vocoder_marked, require_speech

from cosyvoice_triton.export.quantize3 import INT8_CPU_DIR, VOCODER3, capture_vocoder_feeds
from cosyvoice_triton.export.quantize_calibration import session
from cosyvoice_triton.hashing import file_sha256
from cosyvoice_triton.serving.marker import MARKER
from cosyvoice_triton.serving.repository import render_repository
from cosyvoice_triton.serving.repository.templates import RenderError
from cosyvoice_triton.serving.stages.graphs import GraphRunner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_the_captured_feeds_are_the_vocoders_calls_in_a_conversion(cv3_demo_dir):
    from cosyvoice_triton.export.quantize_calibration import speech_pairs
    from cosyvoice_triton.models.cosyvoice3.pipeline import CosyVoice3

    require_speech()
    model = CosyVoice3.from_pretrained(cv3_demo_dir, tts=False, prompt_cache=False)
    (pair,) = speech_pairs(1, split="heldout", max_seconds=4.0)
    src, prompt = pair
    want = model.vc(src.wave, prompt.wave, source_sr=src.sample_rate, prompt_sr=prompt.sample_rate)
    feeds = capture_vocoder_feeds(model, [pair])
    assert model.hift.decode_fn is None  # given back
    (feed,) = feeds  # one whole conversion: one vocoder call
    mel, source = feed["mel"], feed["source"]
    assert mel.shape[:2] == (1, 80) and source.shape == (1, 1, 480 * mel.shape[2])
    assert want.shape == (480 * mel.shape[2],)  # the call's frames are the answer's
    with torch.inference_mode():
        again = model.hift.generate(torch.from_numpy(mel), torch.from_numpy(source), True)[0].numpy()
    np.testing.assert_allclose(again, want, atol=1e-6, rtol=0)  # the recorded inputs reproduce the answer

    def fail(*_, **__):
        raise RuntimeError("boom")

    model.vc = fail
    with pytest.raises(RuntimeError, match="boom"):
        capture_vocoder_feeds(model, [pair])
    assert model.hift.decode_fn is None  # given back on an error too


def test_the_int8_graph_is_static_qlinearconv_close_to_fp32(cv3_int8_vocoder, cv3_onnx_dir):
    folder, report = cv3_int8_vocoder
    path = folder / INT8_CPU_DIR / f"{VOCODER3}.onnx"
    assert report.path == path
    model = onnx.load(str(path))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QLinearConv") == report.reduced_layers > 30
    assert {"/stft/Conv", "/conv_post/Conv", "/istft/ConvTranspose", "/istft/ConvTranspose_1", "/ups.2/Conv",
            "/source_downs.1/Conv", "/source_downs.2/Conv"} <= set(report.kept_float)
    assert not any(k.startswith(("/ups.0/", "/ups.1/", "/resblocks.0/", "/resblocks.5/")) for k in report.kept_float)
    names = {n.name for n in model.graph.node}
    assert set(report.kept_float) <= names  # still plain float convolutions
    (call,) = report.heldout
    # int8's error, not a broken graph (about 1.7e-2 on a VNNI CPU; a CPU without VNNI gets 7-bit weights, whose
    # error CosyVoice2's tiny vocoder put under 0.15): the quality verdict is the manifest's, not this test's
    assert 0 < call.waveform_rel_rms < 0.25 and np.isfinite(call.logmel_db)
    assert report.cpu and report.fp32_ms and report.int8_ms and report.speed_frames == 250
    # the graph answers what fp32 answers, within int8's error, on another input than it was calibrated on
    rng = np.random.default_rng(5)
    mel = rng.standard_normal((1, 80, 40)).astype(np.float32) - 4.0
    source = (0.1 * np.sin(np.arange(480 * 40) * 2 * np.pi * 200 / 24000)).astype(np.float32)[None, None]
    fp32 = session(cv3_onnx_dir / f"{VOCODER3}.onnx").run(None, {"mel": mel, "source": source})[0]
    int8 = session(path).run(None, {"mel": mel, "source": source})[0]
    assert np.linalg.norm(int8 - fp32) / np.linalg.norm(fp32) < 0.25
    assert not np.array_equal(int8, fp32)


def test_the_manifest_ties_the_int8_graph_to_its_sources(cv3_int8_vocoder, cv3_demo_dir):
    folder, report = cv3_int8_vocoder
    doc = json.loads((folder / INT8_CPU_DIR / "manifest.json").read_text())
    assert doc["precision"] == "int8_cpu" and doc["family"] == "cosyvoice3"
    assert doc["source"]["sha256"] == file_sha256(cv3_demo_dir / "hift.pt")
    entry = doc["graphs"][VOCODER3]
    assert entry["sha256"] == file_sha256(folder / INT8_CPU_DIR / f"{VOCODER3}.onnx")
    assert entry["fp32_sha256"] == file_sha256(folder / f"{VOCODER3}.onnx")
    assert entry["serve"] is report.serve and entry["verdict"] == report.verdict()
    assert entry["calibration"]["samples"] == 2 and len(entry["quality"]["calls"]) == 1
    assert entry["speed"]["speedup"] == pytest.approx(report.speedup)


def test_quantize_refuses_an_export_of_another_vocoder(cv3_demo_dir, cv3_onnx_dir, tmp_path):
    from cosyvoice_triton.export.quantize3 import quantize_vocoder3

    other = tmp_path / "onnx3"
    shutil.copytree(cv3_onnx_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["graphs"][VOCODER3]["source"]["sha256"] = "2" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="exported from another hift.pt"):
        quantize_vocoder3(cv3_demo_dir, other, calibration_pairs=1, heldout_pairs=1)
    with pytest.raises(FileNotFoundError, match="export-onnx"):
        quantize_vocoder3(cv3_demo_dir, tmp_path / "none")


def test_the_quantize_script_takes_a_cosyvoice3_folder(cv3_demo_dir, tmp_path, capsys):
    import runpy

    main = runpy.run_path(str(ROOT / "export" / "quantize.py"), run_name="quantize")["main"]
    assert main(["--model-dir", str(cv3_demo_dir), "--onnx-root", str(tmp_path / "none")]) == 2
    assert "no hift3_decoder.onnx; export first" in capsys.readouterr().err
    assert main(["--model-dir", str(cv3_demo_dir), "--onnx-root", str(tmp_path), "--precisions", "fp16"]) == 2
    assert "int8_cpu only" in capsys.readouterr().err
    assert main(["--model-dir", str(cv3_demo_dir), "--onnx-root", str(tmp_path), "--graphs", "flow_estimator"]) == 2
    assert "hift3_decoder only" in capsys.readouterr().err
    assert main(["--model-dir", str(cv3_demo_dir), "--onnx-root", str(tmp_path), "--sensitivity",
                 "--calibration-method", "entropy"]) == 2
    assert "--calibration-method, --sensitivity: CosyVoice2's graphs only" in capsys.readouterr().err
    (tmp_path / "hift3_decoder.onnx").write_bytes(b"")
    assert main(["--model-dir", str(cv3_demo_dir), "--onnx-root", str(tmp_path), "--max-seconds", "0.5"]) == 2
    assert "--max-seconds 0.5: must be between 1 and 30" in capsys.readouterr().err


def _render(serving_assets, repo, flavor="local", **tunables):
    return render_repository(flavor, repo, model_dir=serving_assets["model_dir"],
                             onnx_dir=serving_assets["onnx_dir"], **tunables)


def test_the_render_serves_the_int8_vocoder_where_its_verdict_allows(serving_assets, cv3_demo_dir, cv3_int8_vocoder,
                                                                     tmp_path):
    folder, _ = cv3_int8_vocoder
    fit = int8_vocoder_marked(folder, tmp_path / "fit", True)
    report = _render(serving_assets, tmp_path / "r", cosyvoice3_dir=str(cv3_demo_dir), cosyvoice3_onnx_dir=str(fit),
                     cosyvoice3_vocoder_precision="int8_cpu")
    assert report.models[VOCODER3] == "python (onnxruntime, int8_cpu)"
    record = json.loads((tmp_path / "r" / MARKER).read_text())
    assert record["precision"] == "fp32"  # CosyVoice2's graphs, as asked
    assert record["cosyvoice3_graph_precisions"] == {"flow3_estimator": "fp32", "flow3_estimator_streaming": "fp32",
                                                     VOCODER3: "int8_cpu"}
    # a render allowed to miss files still points the vocoder at the INT8 file
    _render(serving_assets, tmp_path / "m", cosyvoice3_dir=str(cv3_demo_dir),
            cosyvoice3_onnx_dir=str(tmp_path / "absent"), cosyvoice3_vocoder_precision="int8_cpu", allow_missing=True)
    assert f'string_value: "{tmp_path / "absent" / INT8_CPU_DIR / VOCODER3}.onnx"' in (
        tmp_path / "m" / VOCODER3 / "config.pbtxt").read_text()
    assert report.models["flow3_estimator"] == "python (onnxruntime, fp32)"
    text = (tmp_path / "r" / VOCODER3 / "config.pbtxt").read_text()
    assert f'string_value: "{fit / INT8_CPU_DIR / VOCODER3}.onnx"' in text
    # its fallback is the export's fp32 graph
    runner = GraphRunner(VOCODER3, onnx_path=fit / INT8_CPU_DIR / f"{VOCODER3}.onnx", fallback="auto")
    assert runner.fallback_path == fit / f"{VOCODER3}.onnx"


def test_the_render_refuses_an_int8_vocoder_it_cannot_trust(serving_assets, cv3_demo_dir, cv3_onnx_dir,
                                                            cv3_int8_vocoder, tmp_path):
    folder, _ = cv3_int8_vocoder
    kw = {"cosyvoice3_dir": str(cv3_demo_dir), "cosyvoice3_vocoder_precision": "int8_cpu"}
    with pytest.raises(RenderError, match="needs cosyvoice3_onnx_dir"):
        _render(serving_assets, tmp_path / "a", **kw)
    with pytest.raises(RenderError, match="must be fp32 or int8_cpu"):
        _render(serving_assets, tmp_path / "a", cosyvoice3_dir=str(cv3_demo_dir),
                cosyvoice3_onnx_dir=str(cv3_onnx_dir), cosyvoice3_vocoder_precision="int8")
    with pytest.raises(RenderError, match="int8_cpu/hift3_decoder.onnx not found"):
        _render(serving_assets, tmp_path / "b", cosyvoice3_onnx_dir=str(cv3_onnx_dir), **kw)
    with pytest.raises(RenderError, match="not fit to serve: marked not served by the test"):
        _render(serving_assets, tmp_path / "c",
                cosyvoice3_onnx_dir=str(int8_vocoder_marked(folder, tmp_path / "unfit", False)), **kw)
    fit = int8_vocoder_marked(folder, tmp_path / "fit", True)
    with pytest.raises(RenderError, match="served by the local flavor on the CPU only"):
        _render(serving_assets, tmp_path / "d", "onnx", cosyvoice3_onnx_dir=str(fit), **kw)
    with pytest.raises(RenderError, match="served by the local flavor on the CPU only"):
        _render(serving_assets, tmp_path / "d", cosyvoice3_onnx_dir=str(fit), device="cuda", **kw)
    doc = json.loads((fit / INT8_CPU_DIR / "manifest.json").read_text())
    doc["graphs"][VOCODER3]["fp32_sha256"] = "3" * 64
    (fit / INT8_CPU_DIR / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(RenderError, match="was not quantized from"):
        _render(serving_assets, tmp_path / "e", cosyvoice3_onnx_dir=str(fit), **kw)
    (fit / INT8_CPU_DIR / "manifest.json").write_text("{}")
    with pytest.raises(RenderError, match="is not a quantization manifest"):
        _render(serving_assets, tmp_path / "f", cosyvoice3_onnx_dir=str(fit), **kw)
    for name in "abcdef":
        assert not (tmp_path / name).exists()  # refused before anything is written
