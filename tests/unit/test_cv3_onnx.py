"""CosyVoice3's graphs (``cosyvoice_triton.export.onnx_export3``, ``export/export_onnx.py`` on a cosyvoice3 folder)
on the tiny demo model: I/O as ``shapes.GRAPHS3`` and the official estimator export's names, verification against
PyTorch in onnxruntime (batch > 1, several lengths, both attention variants, both vocoder finalize modes), the
official file layout, the vocoder's stream through the graphs, the CLI. Verification lengths are capped
(``MAX_LENGTH``, above the DiT's 50-frame attention chunk) to keep this file fast."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import ROOT, rel_err

from cosyvoice_triton.export.onnx_export import HIFT_SOURCE_END_TO_END_BAR, MANIFEST_NAME, REL_TOL_FP32, Case
from cosyvoice_triton.export.onnx_export3 import (
    ALL_GRAPHS3,
    ESTIMATOR_GRAPHS,
    OFFICIAL_BATCH,
    OFFICIAL_ESTIMATOR_FILES,
    export_onnx3,
    load_source_models3,
    sample_inputs3,
    verify_onnx3,
    vocode,
)
from cosyvoice_triton.models.cosyvoice3.demo import write_demo_model3
from cosyvoice_triton.shapes import GRAPHS3, SAMPLES_PER_MEL_FRAME

MAX_LENGTH = 64
#: the official export's estimator signature (cosyvoice/bin/export_onnx.py)
OFFICIAL_INPUTS, OFFICIAL_OUTPUTS = ["x", "mask", "mu", "t", "spks", "cond"], ["estimator_out"]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model3(tmp_path_factory.mktemp("demo3") / "cosyvoice3-demo-tiny", size="tiny")


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    return export_onnx3(model_dir, tmp_path_factory.mktemp("onnx3") / "fp32", max_length=MAX_LENGTH,
                        official_estimator_files=True, threads=1)


@pytest.fixture(scope="module")
def models(model_dir):
    return load_source_models3(model_dir)


def _session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def _dims(v) -> list:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in v.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", ALL_GRAPHS3)
def test_io_is_the_spec(exported, name):
    spec = GRAPHS3[name]
    model = onnx.load(str(exported.out_dir / f"{name}.onnx"))
    onnx.checker.check_model(model)
    for values, specs in ((model.graph.input, spec.inputs), (model.graph.output, spec.outputs)):
        assert [v.name for v in values] == [t.name for t in specs]
        for v, t in zip(values, specs, strict=True):
            assert _dims(v) == t.dim_names(), t.name
            assert _dims(v)[0] == "batch"
    if name in ESTIMATOR_GRAPHS:  # the official names, its time axis name, dim 2
        assert [i.name for i in model.graph.input] == OFFICIAL_INPUTS
        assert [o.name for o in model.graph.output] == OFFICIAL_OUTPUTS
        assert {_dims(v)[2] for v in (*model.graph.input, *model.graph.output) if len(_dims(v)) == 3} == {"seq_len"}


def test_verification_passes_in_every_case_and_mode(exported):
    assert exported.verified and exported.passed, exported.table()
    manifest = json.loads(exported.manifest.read_text())
    assert list(manifest["graphs"]) == list(ALL_GRAPHS3)
    for name in ALL_GRAPHS3:
        rows = exported.graphs[name].rows
        gating = [r for r in rows if r.gate]
        assert gating and all(r.rel <= r.bar == REL_TOL_FP32 for r in gating), name
        shapes = {r.case.split()[-1] for r in rows}
        batches = {int(s.split("x")[0]) for s in shapes}
        lengths = {int(s.split("x")[1]) for s in shapes}
        assert max(batches) > 1 and len(lengths) >= 2 and max(lengths) == MAX_LENGTH, (name, shapes)
        assert manifest["graphs"][name]["verification"]["passed"] is True
    outputs = {r.output for r in exported.graphs["hift3_source"].rows}
    assert {"f0 (internal)", "source | same f0", "f0 held", "source held | same f0"} <= outputs
    outputs = {r.output for r in exported.graphs["hift3_decoder"].rows}
    assert {"waveform", "waveform held", "speech finalize=True", "speech finalize=False"} <= outputs
    chain = [r for r in exported.graphs["hift3_decoder"].rows if r.output.startswith("speech")]
    assert chain and all(not r.gate and r.rel <= HIFT_SOURCE_END_TO_END_BAR for r in chain)


def test_each_estimator_graph_is_its_attention_variant(exported, models):
    case = Case("chunks", 3, (MAX_LENGTH, 57, 33))  # longer than the 50-frame chunk: the variants differ
    feeds = sample_inputs3("flow3_estimator", case, seed=9)
    est = models.flow.decoder.estimator
    for name, streaming in ESTIMATOR_GRAPHS.items():
        (out,) = _session(exported.graphs[name].path).run(None, feeds)
        with torch.inference_mode():
            own = est(*(torch.from_numpy(feeds[k]) for k in OFFICIAL_INPUTS), streaming=streaming).numpy()
            other = est(*(torch.from_numpy(feeds[k]) for k in OFFICIAL_INPUTS), streaming=not streaming).numpy()
        n = case.lengths[0]
        assert rel_err(out[0, :, :n], own[0, :, :n]) <= REL_TOL_FP32, name
        assert rel_err(out[0, :, :n], other[0, :, :n]) > 1e-3, name


def test_verification_catches_the_wrong_variant(exported, models):
    rows = verify_onnx3("flow3_estimator", exported.graphs["flow3_estimator_streaming"].path, models,
                        cases=[Case("padded", 3, (MAX_LENGTH, 51, 20))])
    assert rows and not all(r.passed for r in rows)


def test_official_estimator_files_fix_batch_two_for_the_official_trt_profile(exported):
    manifest = json.loads(exported.manifest.read_text())
    for name, file in OFFICIAL_ESTIMATOR_FILES.items():
        model = onnx.load(str(exported.out_dir / file))
        assert [i.name for i in model.graph.input] == OFFICIAL_INPUTS
        assert [o.name for o in model.graph.output] == OFFICIAL_OUTPUTS
        assert all(_dims(v)[0] == OFFICIAL_BATCH for v in (*model.graph.input, *model.graph.output))
        # the official get_trt_kwargs profiles x, mask, mu, cond only: every other input must be static
        dynamic = {v.name for v in model.graph.input if any(isinstance(d, str) for d in _dims(v))}
        assert dynamic == {"x", "mask", "mu", "cond"}
        entry = manifest["graphs"][name]["official_file"]
        assert entry["file"] == file and entry["batch"] == OFFICIAL_BATCH
        rows = [r for r in exported.graphs[name].rows if file in r.case]
        assert rows and all(r.passed for r in rows)


def test_vocoder_stream_through_the_graphs_equals_one_shot(exported, models):
    """The official stream's vocoder calls (the whole mel so far, finalize=False, keep the new samples; the last
    finalized) through :func:`vocode` give the one-shot PyTorch waveform."""
    src, dec = _session(exported.graphs["hift3_source"].path), _session(exported.graphs["hift3_decoder"].path)
    run_source = lambda mel, noise: src.run(None, {"mel": mel, "nsf_noise": noise})[0]
    run_decoder = lambda mel, source: dec.run(None, {"mel": mel, "source": source})[0]
    feeds = sample_inputs3("hift3_source", Case("stream", 2, (MAX_LENGTH, MAX_LENGTH)), seed=4)
    mel, noise = feeds["mel"], feeds["nsf_noise"]
    held = models.hift.dims.held_frames
    pieces, have = [], 0
    for end, final in ((24, False), (45, False), (MAX_LENGTH, True)):
        wave = vocode(run_source, run_decoder, np.ascontiguousarray(mel[:, :, :end]), noise, finalize=final,
                      held_frames=held)
        assert wave.shape[1] == SAMPLES_PER_MEL_FRAME * (end if final else end - held)
        pieces.append(wave[:, have:])
        have = wave.shape[1]
    stream = np.concatenate(pieces, axis=1)
    one_shot, _ = models.hift.inference(torch.from_numpy(mel), finalize=True, noise=torch.from_numpy(noise))
    assert stream.shape == tuple(one_shot.shape)
    assert rel_err(stream, one_shot.numpy()) <= HIFT_SOURCE_END_TO_END_BAR


def _cli():
    spec = importlib.util.spec_from_file_location("export_onnx_cli", ROOT / "export" / "export_onnx.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_exports_a_cosyvoice3_folder_by_its_family(model_dir, tmp_path, capsys):
    cli = _cli()
    out = tmp_path / "onnx"
    assert cli.main(["--model-dir", str(model_dir), "--out", str(out), "--graphs", "flow3_estimator_streaming",
                     "--no-verify", "-q"]) == 0
    graphs = json.loads((out / MANIFEST_NAME).read_text())["graphs"]
    assert list(graphs) == ["flow3_estimator_streaming"]
    assert graphs["flow3_estimator_streaming"]["family"] == "cosyvoice3"
    assert cli.main(["--model-dir", str(model_dir), "--out", str(out), "--graphs", "flow_estimator"]) == 2
    err = capsys.readouterr().err
    assert "unknown cosyvoice3 graph(s) flow_estimator" in err and "flow3_estimator" in err
