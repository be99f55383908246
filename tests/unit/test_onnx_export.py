"""ONNX export of every graph (``cosyvoice_triton.export.onnx_export``, ``export/export_onnx.py``) on the tiny demo
model: I/O exactly as ``shapes.GRAPHS``, manifest, verification, per-item streaming, renamed shipped graphs,
batch-axis detection, CLI errors. Verification lengths are capped (``MAX_LENGTH``) to keep this file fast."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import ROOT, rel_err
from onnx import TensorProto, helper

from cosyvoice_triton.export.onnx_export import (
    ALL_GRAPHS,
    MANIFEST_NAME,
    Case,
    EstimatorGraph,
    export_onnx,
    load_source_models,
    prepare_shipped_graph,
    rename_io,
    sample_inputs,
    verification_cases,
    verify_onnx,
)
from cosyvoice_triton.models.demo import write_demo_model
from cosyvoice_triton.models.standins import campplus_standin, speech_tokenizer_standin
from cosyvoice_triton.shapes import GRAPHS

MAX_LENGTH = 72
CASE_LABELS = ("single", "padded", "long", "max-batch")


def _labels(name: str) -> set[str]:
    """Verification case labels; CAM++ has no length input, so its batches hold equal lengths."""
    return {"equal" if label == "padded" and name == "speaker_encoder" else label for label in CASE_LABELS}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "cosyvoice2-demo-tiny", size="tiny")


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "fp32"
    return export_onnx(model_dir, out, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def manifest(exported) -> dict:
    return json.loads(exported.manifest.read_text())


def _session(src) -> ort.InferenceSession:
    """A CPU session of a path or of serialized model bytes."""
    return ort.InferenceSession(src if isinstance(src, bytes) else str(src), providers=["CPUExecutionProvider"])


def _dims(value_info) -> list:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in value_info.type.tensor_type.shape.dim]


# ------------------------------------------------------------------------------------ graphs and I/O


@pytest.mark.parametrize("name", ALL_GRAPHS)
def test_io_names_dtypes_and_dims_are_the_spec(exported, manifest, name):
    spec = GRAPHS[name]
    model = onnx.load(str(exported.out_dir / f"{name}.onnx"))
    onnx.checker.check_model(model)
    dynamic = manifest["graphs"][name]["batch_dynamic"]
    for values, specs in ((model.graph.input, spec.inputs), (model.graph.output, spec.outputs)):
        assert [v.name for v in values] == [t.name for t in specs]
        for v, t in zip(values, specs, strict=True):
            assert helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) == np.dtype(t.dtype), t.name
            want = [1 if d == "batch" and not dynamic else d for d in t.dim_names()]
            assert _dims(v) == want, t.name
    sess = _session(exported.out_dir / f"{name}.onnx")  # onnxruntime reads the same signature
    assert [i.name for i in sess.get_inputs()] == [t.name for t in spec.inputs]
    assert [o.name for o in sess.get_outputs()] == [t.name for t in spec.outputs]


def test_neural_graphs_have_dynamic_batch_and_fp32_weights(exported):
    for name in ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder"):
        g = exported.graphs[name]
        assert g.batch_dynamic and g.opset == 17
        model = onnx.load(str(g.path))
        assert {i.data_type for i in model.graph.initializer} <= {TensorProto.FLOAT, TensorProto.INT64,
                                                                 TensorProto.DOUBLE, TensorProto.BOOL}
    # weight norm folded: no parametrization leftovers (original0/original1) in the decoder
    names = [i.name for i in onnx.load(str(exported.graphs["hift_decoder"].path)).graph.initializer]
    assert not [n for n in names if "original" in n or "parametrizations" in n]


def test_manifest(exported, manifest, model_dir):
    assert manifest["opset"] == 17 and manifest["precision"] == "fp32"
    assert manifest["source_model_dir"] == str(model_dir.resolve())
    assert list(manifest["graphs"]) == list(ALL_GRAPHS)
    for name, entry in manifest["graphs"].items():
        path = exported.out_dir / entry["file"]
        assert entry["file"] == f"{name}.onnx"
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert entry["bytes"] == path.stat().st_size
        assert entry["opset"] == 17 and entry["precision"] == "fp32"
        assert [i["name"] for i in entry["inputs"]] == [t.name for t in GRAPHS[name].inputs]
        assert [o["dtype"] for o in entry["outputs"]] == [t.dtype for t in GRAPHS[name].outputs]
        assert isinstance(entry["batch_dynamic"], bool)
        assert entry["source_model_dir"] == str(model_dir.resolve())
        src = model_dir / entry["source"]["file"]
        assert entry["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
        v = entry["verification"]
        assert v["passed"] is True and v["tolerance_rel"] == 1e-4 and v["max_length"] == MAX_LENGTH
        assert {r["case"].split()[0] for r in v["rows"]} == _labels(name)
        assert all(r["rel"] <= r["bar"] or not r["gate"] for r in v["rows"])
    tok = manifest["graphs"]["speech_tokenizer"]
    assert tok["renamed_io"] == {"feats": "whisper_mel", "feats_length": "whisper_mel_len", "indices": "speech_tokens"}
    assert manifest["graphs"]["speaker_encoder"]["renamed_io"] == {"input": "fbank", "output": "speaker_embedding"}


def test_verification_passes_with_a_row_per_graph_case_and_output(exported):
    assert exported.passed and exported.verified
    table = exported.table()
    for name in ALL_GRAPHS:
        rows = exported.graphs[name].rows
        assert {r.case.split()[0] for r in rows} == _labels(name), name
        outputs = {r.output for r in rows}
        assert {t.name for t in GRAPHS[name].outputs} <= {o.split()[0] for o in outputs}, name
        assert name in table
    # the long case reaches the (capped) maximum; batches and lengths differ from the export example
    for name in ALL_GRAPHS:
        long_case = next(c for c in verification_cases(name, max_length=MAX_LENGTH) if c.label == "long")
        axis_max = max(GRAPHS[name].axes[a].max for a in GRAPHS[name].axes if a != "batch")
        assert max(long_case.lengths) == min(MAX_LENGTH, axis_max) and long_case.batch == 2
    rows = {(r.case.split()[0], r.output): r for r in exported.graphs["hift_source"].rows}
    assert rows[("long", "f0 (internal)")].rel <= 1e-4 and rows[("long", "source | same f0")].rel <= 1e-4
    assert "voiced" in rows[("long", "f0 (internal)")].note


def test_verification_catches_a_wrong_graph(exported, model_dir):
    models = load_source_models(model_dir, hift=False)
    est = models.flow.decoder.estimator
    with torch.no_grad():
        est.final_proj.bias.add_(1e-2)
    rows = verify_onnx("flow_estimator", exported.graphs["flow_estimator"].path, EstimatorGraph(est),
                       cases=[Case("padded", 3, (70, 41, 9), (True, False, True))])
    assert rows and not any(r.passed for r in rows)


# --------------------------------------------------------------------------- per-item streaming flags


def _alone(feeds: dict, i: int, n: int, axis: dict) -> dict:
    """Item ``i`` as a batch of one, its time-axis inputs (``axis``: name -> axis) cut to ``n``."""
    return {k: np.ascontiguousarray(np.take(v[i : i + 1], np.arange(n), axis=axis[k]) if k in axis else v[i : i + 1])
            for k, v in feeds.items()}


def test_flow_encoder_mixed_streaming_batch_equals_separate_runs(exported):
    sess = _session(exported.graphs["flow_encoder"].path)
    case = Case("mixed", 3, (70, 52, 61), (True, False, True), (3, 0, 0))  # > 25 tokens: chunks matter
    feeds = sample_inputs("flow_encoder", case, seed=5)
    mu, mel_len, spks = sess.run(None, feeds)
    np.testing.assert_array_equal(mel_len, [134, 104, 122])
    for i, n in enumerate(case.lengths):
        one = _alone(feeds, i, n, {"speech_tokens": 1})
        mu1, len1, spks1 = sess.run(None, one)  # mu1 keeps 2n frames, zero past len1
        assert int(len1[0]) == mel_len[i] and not np.any(mu1[0, :, len1[0]:])
        assert rel_err(mu[i, :, : mel_len[i]], mu1[0, :, : mel_len[i]]) <= 1e-5
        assert not np.any(mu[i, :, mel_len[i]:])
        assert rel_err(spks[i], spks1[0]) <= 1e-6
    flipped = {**_alone(feeds, 0, 70, {"speech_tokens": 1}), "streaming": np.array([False])}
    other = sess.run(None, flipped)[0][0, :, : mel_len[0]]
    assert rel_err(other, mu[0, :, : mel_len[0]]) > 1e-3  # the flag is honoured


def test_flow_estimator_mixed_streaming_rows_equal_separate_runs(exported):
    sess = _session(exported.graphs["flow_estimator"].path)
    case = Case("mixed", 4, (130, 101, 130, 77), (True, False, False, True))  # > 50 frames: chunks matter
    feeds = sample_inputs("flow_estimator", case, seed=6)
    (v,) = sess.run(None, feeds)
    axis = {"x": 2, "mask": 2, "mu": 2, "cond": 2}
    for i, n in enumerate(case.lengths):
        (v1,) = sess.run(None, _alone(feeds, i, n, axis))
        assert rel_err(v[i, :, :n], v1[0]) <= 1e-5
        assert not np.any(v[i, :, n:])
    flipped = {**_alone(feeds, 0, 130, axis), "streaming": np.array([False])}
    assert rel_err(sess.run(None, flipped)[0][0], v[0]) > 1e-3


# ------------------------------------------------------------------------------------- shipped graphs


@pytest.mark.parametrize("name,original", [("speech_tokenizer", "speech_tokenizer_v2.onnx"),
                                           ("speaker_encoder", "campplus.onnx")])
def test_renamed_shipped_graph_runs_with_new_names_like_the_original(exported, model_dir, name, original):
    new, old = _session(exported.graphs[name].path), _session(model_dir / original)
    assert not {i.name for i in new.get_inputs()} & {i.name for i in old.get_inputs()}
    lengths = (157,) if name == "speech_tokenizer" else (131,)
    feeds = sample_inputs(name, Case("one", 1, lengths), seed=3)
    got = new.run(None, feeds)
    ref = old.run(None, {o.name: feeds[n.name] for o, n in zip(old.get_inputs(), new.get_inputs(), strict=True)})
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    # the graph itself is untouched: same nodes (op types, order), same weights
    m_new, m_old = onnx.load(str(exported.graphs[name].path)), onnx.load(str(model_dir / original))
    assert [n.op_type for n in m_new.graph.node] == [n.op_type for n in m_old.graph.node]
    assert [i.raw_data for i in m_new.graph.initializer] == [i.raw_data for i in m_old.graph.initializer]


def test_stand_ins_batch_axis_is_detected_dynamic(exported):
    assert exported.graphs["speech_tokenizer"].batch_dynamic  # written with a fixed batch of 1, but batchable
    assert exported.graphs["speaker_encoder"].batch_dynamic
    assert any("padded" in n for n in exported.graphs["speech_tokenizer"].notes)


def _baked_batch_campplus() -> onnx.ModelProto:
    """A campplus-signature graph whose Reshape bakes batch 1 (as a batch-1 export may)."""
    w = np.random.default_rng(0).normal(size=(80, 192)).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[1], keepdims=0),
             helper.make_node("Reshape", ["pooled", "shape"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["output"])]
    graph = helper.make_graph(
        nodes, "campplus", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        [onnx.numpy_helper.from_array(np.array([1, 80], dtype=np.int64), "shape"),
         onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_fixed_batch_graph_keeps_batch_one():
    model, probe, mapping, adaptations = prepare_shipped_graph(_baked_batch_campplus(), "speaker_encoder")
    assert not probe.dynamic and "does not run" in probe.note
    assert mapping == {"input": "fbank", "output": "speaker_embedding"} and not adaptations
    assert _dims(model.graph.input[0]) == [1, "fbank_frames", 80]
    assert _dims(model.graph.output[0]) == [1, 192]
    x = np.random.default_rng(1).normal(size=(1, 50, 80)).astype(np.float32)
    np.testing.assert_array_equal(_session(model.SerializeToString()).run(None, {"fbank": x})[0],
                                  _session(_baked_batch_campplus().SerializeToString()).run(None, {"input": x})[0])


def test_fixed_batch_shipped_graph_is_exported_and_verified_at_batch_one(model_dir, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    shutil.copy(model_dir / "cosyvoice2.yaml", src)
    onnx.save(_baked_batch_campplus(), str(src / "campplus.onnx"))
    report = export_onnx(src, tmp_path / "out", graphs="speaker_encoder", max_length=MAX_LENGTH)
    g = report.graphs["speaker_encoder"]
    assert g.passed and not g.batch_dynamic
    assert g.rows and {r.case.split()[1].split("x")[0] for r in g.rows} == {"1"}
    assert MAX_LENGTH in {int(r.case.split("x")[1]) for r in g.rows}  # the long case, at batch 1
    entry = json.loads(report.manifest.read_text())["graphs"]["speaker_encoder"]
    assert entry["batch_dynamic"] is False and entry["triton_max_batch_size"] == 0
    assert entry["inputs"][0]["shape"] == [1, "fbank_frames", 80]
    assert "does not run" in entry["notes"][0]


def _unmasked_tokenizer() -> onnx.ModelProto:
    """A tokenizer-signature graph that ignores ``feats_length``: it batches, but padding changes tokens."""
    rng = np.random.default_rng(4)
    w1, w2 = (rng.normal(size=s).astype(np.float32) for s in ((8, 128, 3), (8, 8, 3)))
    axes1 = onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "axes1")
    nodes = [helper.make_node("Conv", ["feats", "w1"], ["h1"], strides=[2], pads=[1, 1]),
             helper.make_node("Conv", ["h1", "w2"], ["h2"], strides=[2], pads=[1, 1]),
             helper.make_node("ReduceSum", ["h2", "axes1"], ["s"], keepdims=0),  # [B, T/4]
             helper.make_node("ReduceMean", ["s"], ["mean"], axes=[1], keepdims=1),  # over time, padding too
             helper.make_node("Sub", ["s", "mean"], ["centred"]),
             helper.make_node("Greater", ["centred", "zero"], ["positive"]),
             helper.make_node("Cast", ["positive"], ["indices"], to=TensorProto.INT32)]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_v2",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "T_tok"])],
        [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(w2, "w2"), axes1,
         onnx.numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_tokenizer_that_batches_equal_lengths_only_is_verified_that_way(model_dir, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    shutil.copy(model_dir / "cosyvoice2.yaml", src)
    onnx.save(_unmasked_tokenizer(), str(src / "speech_tokenizer_v2.onnx"))
    report = export_onnx(src, tmp_path / "out", graphs="speech_tokenizer", max_length=MAX_LENGTH)
    g = report.graphs["speech_tokenizer"]
    assert g.batch_dynamic and g.passed and "equal lengths only" in g.notes[0]
    assert {r.case.split()[0] for r in g.rows} == {"single", "equal", "long", "max-batch"}
    entry = json.loads(report.manifest.read_text())["graphs"]["speech_tokenizer"]
    assert entry["padded_batch_exact"] is False and entry["inputs"][0]["shape"] == ["batch", 128, "whisper_frames"]


def test_int64_token_output_gets_a_cast_to_the_spec_dtype():
    original = speech_tokenizer_standin()
    cast = next(n for n in original.graph.node if n.output[0] == "indices")
    cast.attribute[0].i = TensorProto.INT64
    original.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    model, probe, _, adaptations = prepare_shipped_graph(original, "speech_tokenizer")
    assert probe.dynamic and probe.padded_exact and len(adaptations) == 1
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.INT32
    feeds = sample_inputs("speech_tokenizer", Case("one", 1, (90,)), seed=2)
    got = _session(model.SerializeToString()).run(None, feeds)[0]
    ref = _session(original.SerializeToString()).run(None, {"feats": feeds["whisper_mel"],
                                                             "feats_length": feeds["whisper_mel_len"]})[0]
    assert got.dtype == np.int32 and np.array_equal(got, ref)


def test_rename_io_renames_every_reference_and_refuses_clashes():
    model = campplus_standin()
    renamed = rename_io(model, {"input": "fbank", "output": "speaker_embedding"})
    used = {n for node in renamed.graph.node for n in (*node.input, *node.output)}
    assert "fbank" in used and "speaker_embedding" in used and not {"input", "output"} & used
    assert model.graph.input[0].name == "input"  # the original is left alone
    with pytest.raises(ValueError, match="not inputs or outputs"):
        rename_io(model, {"nope": "x"})
    with pytest.raises(ValueError, match="already name"):
        rename_io(model, {"input": model.graph.node[0].output[0]})


# ---------------------------------------------------------------------------------- subsets and CLI


def test_subset_without_verification(model_dir, tmp_path):
    report = export_onnx(model_dir, tmp_path, graphs="speaker_encoder", verify=False)
    assert list(report.graphs) == ["speaker_encoder"] and not report.verified
    entry = json.loads((tmp_path / MANIFEST_NAME).read_text())["graphs"]
    assert list(entry) == ["speaker_encoder"] and entry["speaker_encoder"]["verification"] is None
    with pytest.raises(ValueError, match="unknown graph"):
        export_onnx(model_dir, tmp_path, graphs="flow_decoder")


def test_cli_missing_model_folder_fails_with_a_clear_message(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run([sys.executable, str(ROOT / "export" / "export_onnx.py"), "--model-dir", str(missing),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"--model-dir {missing}: model folder not found" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_incomplete_model_folder(tmp_path):
    (tmp_path / "cosyvoice2.yaml").write_text("sample_rate: 24000\n")
    proc = subprocess.run([sys.executable, str(ROOT / "export" / "export_onnx.py"), "--model-dir", str(tmp_path),
                           "--out", str(tmp_path / "out"), "--graphs", "hift_decoder"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing hift.pt" in proc.stderr
