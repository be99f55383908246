"""Rendering build/model_repository from model_repository/ (cosyvoice_triton.serving.repository), every flavor.

Structural: each config.pbtxt parses with Triton's own ModelConfig schema (tritonclient ships it), names / dims
/ max batch sizes come from the shape spec, parameters are what the adapters read, templates are strict.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from cosyvoice_triton.export.trt import EXCLUDED
from cosyvoice_triton.serving.repository import (
    MARKER,
    RenderError,
    graph_warmup_samples,
    render_repository,
    render_template,
)
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import ParameterError, read_parameters
from cosyvoice_triton.shapes import GRAPHS, STAGES, VC_INPUTS, VC_MODEL, VC_OUTPUTS

STAGE_NAMES = ("preprocess", "flow", "hift", "postprocess")


def _parse(path: Path):
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    text_format = pytest.importorskip("google.protobuf.text_format")
    return text_format.Parse(path.read_text(), pb2.ModelConfig())


def _config_dict(cfg) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(cfg, preserving_proto_field_name=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from cosyvoice_triton.models.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "cosyvoice2-demo-tiny", size="tiny")


@pytest.fixture(scope="module", params=["local", "onnx", "trt"])
def rendered(request, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model_repository"
    report = render_repository(request.param, out, model_dir=model_dir, onnx_dir=tmp_path_factory.mktemp("x"),
                               allow_missing=True)
    return request.param, out, report


def test_every_model_has_a_config_that_triton_parses(rendered):
    flavor, out, report = rendered
    expected = {*GRAPHS, *STAGE_NAMES, VC_MODEL, "speakers", "cosyvoice_vc_stream", "cosyvoice_vc_live",
                "cosyvoice_tts", "cosyvoice_tts_stream", "cosyvoice_tts_live", "speech_tokens", "speaker_embedding",
                "cosyvoice2"}
    assert set(report.models) == expected
    assert {p.name for p in out.iterdir() if p.is_dir()} == expected
    for name in expected:
        cfg = _parse(out / name / "config.pbtxt")
        assert cfg.name == name
        assert (out / name / "1").is_dir()
    assert json.loads((out / MARKER).read_text())["flavor"] == flavor


def test_graph_configs_follow_the_shape_spec(rendered):
    flavor, out, _ = rendered
    for name, spec in GRAPHS.items():
        cfg = _parse(out / name / "config.pbtxt")
        assert cfg.max_batch_size == spec.max_batch_size
        assert [i.name for i in cfg.input] == [t.name for t in spec.inputs]
        assert [o.name for o in cfg.output] == [t.name for t in spec.outputs]
        for t, i in zip(spec.inputs, cfg.input, strict=True):
            want = spec.triton_dims(t) or [1]
            assert list(i.dims) == want, (name, t.name)
            assert i.HasField("reshape") == (len(t.shape) == 1)
            assert i.allow_ragged_batch == (flavor == "local")
        assert cfg.dynamic_batching.default_queue_policy.max_queue_size > 0
        if flavor == "local":
            assert cfg.backend == "python" and (out / name / "1" / "model.py").is_file()
            params = {k: v.string_value for k, v in cfg.parameters.items()}
            assert params["graph"] == name and params["onnx_path"].endswith(f"fp32/{name}.onnx")
        elif flavor == "onnx" or name in EXCLUDED:
            assert cfg.backend == "onnxruntime" and (out / name / "1" / "model.onnx").exists()
        else:
            assert cfg.platform == "tensorrt_plan" and (out / name / "1" / "model.plan").exists()
        assert len(cfg.model_warmup) == 1 and cfg.model_warmup[0].batch_size == spec.axes["batch"].min
        for key, inp in cfg.model_warmup[0].inputs.items():
            data = (out / name / "warmup" / inp.input_data_file).read_bytes()
            n = 1
            for d in inp.dims:
                n *= d
            assert len(data) == n * (1 if spec.tensor(key).dtype == "bool" else 4)


def test_stage_configs_and_parameters_are_what_the_adapters_read(rendered):
    _, out, _ = rendered
    for name in STAGE_NAMES:
        cfg = _parse(out / name / "config.pbtxt")
        stage = STAGES[name]
        assert cfg.backend == "python" and cfg.max_batch_size == stage.max_batch_size
        assert [i.name for i in cfg.input] == [t.name for t in stage.inputs]
        assert all(i.allow_ragged_batch for i in cfg.input)
        assert {i.name for i in cfg.input if i.optional} == set(stage.optional)
        source = ROOT / "model_repository" / name / "model.py"
        assert (out / name / "1" / "model.py").read_text() == source.read_text()
        read_parameters(_config_dict(cfg), MODEL_PARAMS[name], model=name)  # every key known and typed
        assert bool(cfg.model_warmup) == (name in ("preprocess", "postprocess"))


def test_ensemble_wires_the_public_api(rendered):
    _, out, _ = rendered
    cfg = _parse(out / VC_MODEL / "config.pbtxt")
    assert cfg.platform == "ensemble" and cfg.max_batch_size == 1
    assert [i.name for i in cfg.input] == [t.name for t in VC_INPUTS] + ["seed", "source_audio_bytes",
                                                                         "prompt_audio_bytes"]
    assert all(i.optional for i in cfg.input)  # samples + rate or bytes: preprocess checks each request
    assert [o.name for o in cfg.output] == [t.name for t in VC_OUTPUTS]
    steps = [s.model_name for s in cfg.ensemble_scheduling.step]
    assert steps == ["preprocess", "speech_tokenizer", "speech_tokenizer", "speaker_encoder", "flow", "hift",
                     "postprocess"]
    produced = set(t.name for t in cfg.input)
    for s in cfg.ensemble_scheduling.step:  # every step reads what an earlier step (or the client) produced
        assert set(s.input_map.values()) <= produced, s.model_name
        produced |= set(s.output_map.values())
    assert {t.name for t in cfg.output} <= produced


def test_a_new_model_is_one_table_row_and_a_folder(model_dir, tmp_path, monkeypatch):
    """The convention of model_repository/README.md: a row of SERVED_MODELS + its folder, nothing else."""
    from cosyvoice_triton.serving.repository import render, served
    from cosyvoice_triton.shapes import TensorSpec

    src = tmp_path / "src"
    shutil.copytree(ROOT / "model_repository", src / "model_repository")
    shutil.copytree(ROOT / "ensemble", src / "ensemble")
    (src / "ensemble" / "echo_stream").mkdir()
    (src / "ensemble" / "echo_stream" / "model.py").write_text("# an orchestrator\n")
    row = served.ServedModel("echo_stream", "ensemble/echo_stream", (TensorSpec("text", "bytes", ("batch", 1)),),
                             (TensorSpec("chunk", "float32", ("batch", "n")),), decoupled=True, instances=3,
                             max_batch_size=4, doc="echoes")
    monkeypatch.setattr(render, "SERVED_MODELS", (*served.SERVED_MODELS, row))
    out = tmp_path / "repo"
    report = render_repository("local", out, model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True,
                               templates_dir=src / "model_repository")
    assert report.models["echo_stream"] == "python (decoupled)"
    cfg = _parse(out / "echo_stream" / "config.pbtxt")
    assert cfg.model_transaction_policy.decoupled and cfg.instance_group[0].count == 3 and cfg.max_batch_size == 4
    assert [i.name for i in cfg.input] == ["text"] and cfg.input[0].allow_ragged_batch
    assert (out / "echo_stream" / "1" / "model.py").read_text() == "# an orchestrator\n"
    assert "ensemble/echo_stream/model.py" in (out / "echo_stream" / "config.pbtxt").read_text()
    assert not _parse(out / "flow" / "config.pbtxt").model_transaction_policy.decoupled
    assert (out / VC_MODEL / "config.pbtxt").is_file()  # the ensemble, from ensemble/cosyvoice_vc


def test_tts_models_follow_the_public_api(rendered, model_dir, tmp_path):
    from cosyvoice_triton.shapes import TTS_INPUTS, TTS_OPTIONAL_INPUTS, TTS_STREAM_OUTPUTS, TTS_WHOLE_INPUTS

    _, out, _ = rendered
    stream = _parse(out / "cosyvoice_tts_stream" / "config.pbtxt")
    whole = _parse(out / "cosyvoice_tts" / "config.pbtxt")
    assert stream.model_transaction_policy.decoupled and not whole.model_transaction_policy.decoupled
    names = [t.name for t in (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS)]
    assert [i.name for i in whole.input] == names and [i.name for i in stream.input] == [*names, "stream"]
    assert [i.name for i in whole.input if not i.optional] == ["text"]
    assert [o.name for o in stream.output] == [t.name for t in TTS_STREAM_OUTPUTS]
    params = read_parameters(_config_dict(stream), MODEL_PARAMS["cosyvoice_tts_stream"])
    assert stream.parameters["max_active_requests"].string_value == "8"
    assert (params["max_text_digit_run"], params["max_text_digits"]) == (32, 256)  # the front end's bounds
    tuned = render_repository("local", tmp_path / "tuned", model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True,
                              max_text_digit_run=8, max_text_digits=40)
    assert "cosyvoice_tts_stream" in tuned.models
    tuned_params = read_parameters(_config_dict(_parse(tmp_path / "tuned" / "cosyvoice_tts_stream" / "config.pbtxt")),
                                   MODEL_PARAMS["cosyvoice_tts_stream"])
    assert (tuned_params["max_text_digit_run"], tuned_params["max_text_digits"]) == (8, 40)
    # a voice-conversion-only folder (no llm.pt) serves no TTS, unless asked
    vc_only = tmp_path / "vc_only"
    shutil.copytree(model_dir, vc_only, ignore=shutil.ignore_patterns("llm.pt"))
    report = render_repository("local", tmp_path / "r", model_dir=vc_only, onnx_dir=tmp_path, allow_missing=True)
    assert "cosyvoice_tts" not in report.models and "cosyvoice_vc" in report.models
    report = render_repository("local", tmp_path / "r", model_dir=vc_only, onnx_dir=tmp_path, allow_missing=True,
                               tts="on")
    assert "cosyvoice_tts_stream" in report.models


def test_gpu_flavor_lm_on_tensorrt_llm_renders_and_parses(model_dir, tmp_path):
    """Structural only (no GPU, no TensorRT-LLM here): the tensorrt_llm config parses with Triton's schema."""
    from cosyvoice_triton.shapes import TRTLLM_INPUTS

    out = tmp_path / "trt"
    report = render_repository("trt", out, model_dir=model_dir, onnx_dir=tmp_path, engine_dir=tmp_path / "engines",
                               allow_missing=True, lm_backend="tensorrtllm", max_active_requests=12)
    assert report.models["tensorrt_llm"] == "tensorrtllm"
    cfg = _parse(out / "tensorrt_llm" / "config.pbtxt")
    assert cfg.backend == "tensorrtllm" and cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 12
    assert [i.name for i in cfg.input] == [t.name for t in TRTLLM_INPUTS]
    assert [i.name for i in cfg.input if not i.optional] == ["input_ids", "input_lengths"]
    assert cfg.parameters["gpt_model_path"].string_value == str((tmp_path / "engines" / "llm").resolve())
    assert cfg.parameters["gpt_model_type"].string_value == "inflight_fused_batching"
    assert "tensorrt_llm" not in render_repository("trt", tmp_path / "plain", model_dir=model_dir, onnx_dir=tmp_path,
                                                   allow_missing=True).models
    with pytest.raises(RenderError, match="GPU flavor"):
        render_repository("local", tmp_path / "local", model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True,
                          lm_backend="tensorrtllm")


def test_tunables_reach_the_configs(model_dir, tmp_path):
    out = tmp_path / "repo"
    render_repository("local", out, model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True,
                      instances={"flow": 2, "flow_estimator": 3}, max_queue_delay_us=1234, max_queue_size=7,
                      queue_timeout_us=5_000_000, n_timesteps=4, output_format="wav", output_sample_rate=16000,
                      loudness_lufs=-23.0, warmup=False, runtime="torch", device="cpu")
    flow = _parse(out / "flow" / "config.pbtxt")
    assert flow.instance_group[0].count == 2 and flow.dynamic_batching.max_queue_delay_microseconds == 1234
    assert flow.dynamic_batching.default_queue_policy.max_queue_size == 7
    assert flow.dynamic_batching.default_queue_policy.default_timeout_microseconds == 5_000_000
    assert flow.parameters["n_timesteps"].string_value == "4"
    assert _parse(out / "flow_estimator" / "config.pbtxt").instance_group[0].count == 3
    est = _parse(out / "flow_estimator" / "config.pbtxt")
    assert est.parameters["runtime"].string_value == "torch" and est.parameters["model_dir"].string_value
    assert _parse(out / "speech_tokenizer" / "config.pbtxt").parameters["runtime"].string_value == "onnxruntime"
    post = _parse(out / "postprocess" / "config.pbtxt")
    assert post.parameters["output_format"].string_value == "wav"
    assert [o.name for o in post.output] == ["waveform", "sample_rate", "audio_bytes"]
    ens = _parse(out / VC_MODEL / "config.pbtxt")
    assert [o.name for o in ens.output][-1] == "audio_bytes"
    assert not any(_parse(out / m / "config.pbtxt").model_warmup for m in (*GRAPHS, *STAGE_NAMES))


@pytest.mark.parametrize("bad, words", [
    ({"no_such_tunable": 1}, "unknown tunable"),
    ({"instances": {"nope": 2}}, "unknown model"),
    ({"instances": {"flow": 0}}, ">= 1"),
    ({"output_format": "mp3"}, "output_format"),
    ({"runtime": "tensorflow"}, "runtime"),
    ({"max_queue_size": 0}, "max_queue_size"),
    ({"max_text_digits": 0}, "max_text_digits"),
])
def test_bad_tunables_are_refused(model_dir, tmp_path, bad, words):
    with pytest.raises(RenderError, match=words):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True, **bad)


def test_missing_files_and_bad_flavor_are_refused(model_dir, tmp_path):
    with pytest.raises(RenderError, match="make export"):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=tmp_path / "none")
    with pytest.raises(RenderError, match="make export / make engines"):
        render_repository("trt", tmp_path / "r2", model_dir=model_dir, onnx_dir=tmp_path / "none")
    with pytest.raises(RenderError, match="flavor"):
        render_repository("docker", tmp_path / "r3", model_dir=model_dir)


def test_never_deletes_a_folder_it_did_not_render(model_dir, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("x")
    with pytest.raises(RenderError, match="refusing"):
        render_repository("local", precious, model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True)
    assert (precious / "keep.txt").is_file()
    render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True)
    render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=tmp_path, allow_missing=True)  # again


def test_templates_are_strict():
    assert render_template("a ${x} b ${y}", {"x": 1, "y": "z"}) == "a 1 b z"
    with pytest.raises(RenderError, match="no value for placeholder"):
        render_template("${x} ${y}", {"x": 1})
    with pytest.raises(RenderError, match="no placeholder"):
        render_template("${x}", {"x": 1, "extra": 2})
    for bad in ("$x", "${X}", "${a-b}", "cost: 5$", "${x"):
        with pytest.raises(RenderError, match="placeholder"):
            render_template(bad + " ${x}", {"x": 1})


def test_every_template_placeholder_is_used_by_some_render():
    """No dead placeholders or stray '$' in the source templates (rendering every flavor reads all of them)."""
    for path in [*(ROOT / "model_repository").rglob("*.pbtxt.in"), *(ROOT / "ensemble").rglob("*.pbtxt.in")]:
        text = path.read_text()
        assert "$" not in text.replace("${", ""), path


def test_warmup_samples_are_in_range():
    for name, spec in GRAPHS.items():
        samples, batch = graph_warmup_samples(name)
        assert batch == spec.axes["batch"].min
        assert set(samples) == {t.name for t in spec.inputs}


def test_read_parameters_is_typed_and_strict():
    params = MODEL_PARAMS["postprocess"]
    cfg = {"parameters": {"output_sample_rate": {"string_value": "16000"}, "loudness_lufs": {"string_value": "-20"}}}
    got = read_parameters(cfg, params)
    assert got["output_sample_rate"] == 16000 and got["loudness_lufs"] == -20.0 and got["output_format"] == ""
    with pytest.raises(ParameterError, match="unknown parameter"):
        read_parameters({"parameters": {"typo": {"string_value": "1"}}}, params)
    with pytest.raises(ParameterError, match="not a int"):
        read_parameters({"parameters": {"output_sample_rate": {"string_value": "fast"}}}, params)
    with pytest.raises(ParameterError, match="not one of"):
        read_parameters({"parameters": {"output_format": {"string_value": "mp3"}}}, params)
    with pytest.raises(ParameterError, match="required"):
        read_parameters(json.dumps({"parameters": {}}), MODEL_PARAMS["flow"])


def test_render_script(model_dir, tmp_path):
    out = tmp_path / "repo"
    proc = subprocess.run([sys.executable, str(ROOT / "model_repository" / "render.py"), "--flavor", "onnx",
                           "--out", str(out), "--model-dir", str(model_dir), "--onnx-dir", str(tmp_path),
                           "--allow-missing", "--set", "instances=flow:2", "--set", "max_queue_size=9"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "onnxruntime" in proc.stdout
    assert _parse(out / "flow" / "config.pbtxt").instance_group[0].count == 2
    proc = subprocess.run([sys.executable, str(ROOT / "model_repository" / "render.py"), "--out", str(out),
                           "--model-dir", str(model_dir), "--onnx-dir", str(tmp_path / "none")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "make export" in proc.stderr


def test_container_start_renders_and_serves():
    start = (ROOT / "export" / "container_start.sh").read_text()
    assert 'model_repository/render.py --flavor "$SERVE_FLAVOR"' in start
    assert 'exec "$PYTHON" -m cosyvoice_triton.serving.launch.supervisor' in start  # tritonserver under the supervisor
    docker = (ROOT / "Dockerfile.triton").read_text()
    assert "COPY model_repository/ model_repository/" in docker and "EXPOSE 8000 8001 8002" in docker
    assert "COPY ensemble/ ensemble/" in docker  # the pipelines' sources, beside the templates


def test_onnx_files_must_keep_the_spec_io_types(model_dir, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    fp16 = tmp_path / "onnx" / "fp16"
    fp16.mkdir(parents=True)
    graph = helper.make_graph([helper.make_node("Identity", ["fbank"], ["speaker_embedding"])], "g",
                              [helper.make_tensor_value_info("fbank", TensorProto.FLOAT16, ["b", "t", 80])],
                              [helper.make_tensor_value_info("speaker_embedding", TensorProto.FLOAT16, ["b", 192])])
    onnx.save(helper.make_model(graph), fp16 / "speaker_encoder.onnx")
    with pytest.raises(RenderError, match="keep_io_types"):
        render_repository("onnx", tmp_path / "r", model_dir=model_dir, onnx_dir=tmp_path / "onnx", precision="fp16",
                          allow_missing=True)


# ============================================================================= precision per graph

QUANTIZED = ("flow_encoder", "flow_estimator", "hift_decoder")
_ONNX_TYPES = {"float32": 1, "int32": 6, "int64": 7, "bool": 9}


def _stub_graph(path: Path, graph: str) -> None:
    """An ONNX file with the spec's inputs and outputs (what rendering reads of it; never run)."""
    import onnx
    from onnx import helper

    spec = GRAPHS[graph]
    vi = [[helper.make_tensor_value_info(t.name, _ONNX_TYPES[t.dtype], [str(d) for d in t.shape]) for t in ts]
          for ts in (spec.inputs, spec.outputs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(helper.make_graph([], graph, *vi)), path)


@pytest.fixture(scope="module")
def onnx_tree(tmp_path_factory) -> Path:
    """fp32 files of every graph, int8_cpu and int8 of the three converted graphs, fp16 of none."""
    root = tmp_path_factory.mktemp("onnx-precisions")
    for g in GRAPHS:
        _stub_graph(root / "fp32" / f"{g}.onnx", g)
    for p in ("int8_cpu", "int8"):
        for g in QUANTIZED:
            _stub_graph(root / p / f"{g}.onnx", g)
    return root


def _served(out: Path) -> dict[str, str]:
    """graph -> the precision folder of the ONNX file its config points at (local flavor)."""
    return {g: Path(_parse(out / g / "config.pbtxt").parameters["onnx_path"].string_value).parent.name
            for g in GRAPHS}


def _marker(out: Path) -> dict:
    return json.loads((out / MARKER).read_text())


def test_int8_cpu_for_every_graph_serves_the_cpu_int8_files(model_dir, onnx_tree, tmp_path):
    out = tmp_path / "r"
    report = render_repository("local", out, model_dir=model_dir, onnx_dir=onnx_tree, precision="int8_cpu")
    want = {g: "int8_cpu" if g in QUANTIZED else "fp32" for g in GRAPHS}
    assert _served(out) == want == _marker(out)["graph_precisions"]
    assert _marker(out)["precision"] == "int8_cpu" and "hift_source fp32 only" in _marker(out)["precision_source"]
    assert report.models["flow_estimator"] == "python (onnxruntime, int8_cpu)"
    note = (out / "flow_estimator" / "config.pbtxt").read_text().splitlines()[2]
    assert note.startswith("# flavor local:") and "precision int8_cpu of " in note and "int8_cpu/flow_estimator" in note


def test_one_precision_falls_back_per_graph_and_records_it(model_dir, onnx_tree, tmp_path):
    """A graph without a file of the precision asked for every graph gets the next one (int8_cpu -> fp32, not fp16)."""
    root = tmp_path / "onnx"
    shutil.copytree(onnx_tree, root)
    (root / "int8_cpu" / "hift_decoder.onnx").unlink()
    _stub_graph(root / "fp16" / "hift_decoder.onnx", "hift_decoder")
    render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=root, precision="int8_cpu")
    assert _served(tmp_path / "r")["hift_decoder"] == "fp32" == _marker(tmp_path / "r")["graph_precisions"][
        "hift_decoder"]
    render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=root, precision="fp16")
    assert _served(tmp_path / "r") == {g: "fp16" if g == "hift_decoder" else "fp32" for g in GRAPHS}


@pytest.mark.parametrize("precision", ["flow_encoder=int8_cpu,flow_estimator=fp32",
                                       {"flow_encoder": "int8_cpu", "flow_estimator": "fp32"}])
def test_explicit_precision_per_graph(model_dir, onnx_tree, tmp_path, precision):
    out = tmp_path / "r"
    render_repository("local", out, model_dir=model_dir, onnx_dir=onnx_tree, precision=precision)
    assert _served(out) == {g: "int8_cpu" if g == "flow_encoder" else "fp32" for g in GRAPHS}
    marker = _marker(out)
    assert marker["precision"] == precision and marker["precision_source"] == "per graph"
    assert "asked: int8_cpu (per graph)" in (out / "flow_encoder" / "config.pbtxt").read_text()


def _quality_report(path: Path, choice: dict[str, str]) -> Path:
    decisions = [{"stage": g, "cpu_precision": p, "reason": "test", "candidates": [], "gpu_note": ""}
                 for g, p in choice.items()]
    path.write_text(json.dumps({"model_dir": "m", "decisions": decisions}))
    return path


def test_cpu_choice_reads_the_quality_report(model_dir, onnx_tree, tmp_path):
    report = _quality_report(tmp_path / "report.json", {"flow_encoder": "int8_cpu", "flow_estimator": "fp32",
                                                        "hift_decoder": "int8_cpu"})
    out = tmp_path / "r"
    render_repository("local", out, model_dir=model_dir, onnx_dir=onnx_tree, precision="cpu-choice",
                      quality_report=report)
    want = {g: "int8_cpu" if g in ("flow_encoder", "hift_decoder") else "fp32" for g in GRAPHS}
    assert _served(out) == want == _marker(out)["graph_precisions"]
    assert _marker(out)["precision_source"] == f"cpu-choice of {report}"
    assert f"cpu-choice of {report}" in (out / "hift_decoder" / "config.pbtxt").read_text()


def test_cpu_choice_warns_when_the_report_judged_another_model(model_dir, onnx_tree, tmp_path, caplog):
    report = _quality_report(tmp_path / "report.json", {"flow_encoder": "int8_cpu"})
    with caplog.at_level("WARNING", logger="cosyvoice_triton.serving.repository"):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree, precision="cpu-choice",
                          quality_report=report)
    assert "was measured with model_dir m" in caplog.text
    doc = json.loads(report.read_text())
    report.write_text(json.dumps({**doc, "model_dir": str(model_dir), "onnx_root": str(onnx_tree)}))
    caplog.clear()
    with caplog.at_level("WARNING", logger="cosyvoice_triton.serving.repository"):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree, precision="cpu-choice",
                          quality_report=report)
    assert "was measured with" not in caplog.text


@pytest.mark.parametrize("flavor, precision, words", [
    ("trt", "int8_cpu", "local flavor only"),
    ("onnx", "flow_estimator=int8_cpu", "local flavor only"),
    ("onnx", "cpu-choice", "flavor onnx runs the graphs on the GPU"),
    ("local", "int4", "precision must be one of"),
    ("local", "flow_encoder", "precision must be one of"),
    ("local", "flow_encoder=", "GRAPH=PRECISION"),
    ("local", "flow_encoder=int8_cpu,flow_encoder=fp32", "given twice"),
    ("local", "vocoder=int8_cpu", "unknown graph"),
    ("local", "flow_encoder=int4", "not one of"),
    ("local", "hift_source=int8_cpu", "fp32 only"),
    ("local", "speech_tokenizer=fp16", "fp32 only"),
    ("local", "hift_decoder=fp16", "make quantize"),  # a per-graph choice needs its file: no fallback
])
def test_bad_precisions_are_refused(model_dir, onnx_tree, tmp_path, flavor, precision, words):
    with pytest.raises(RenderError, match=words):
        render_repository(flavor, tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree, precision=precision)


def test_cpu_choice_needs_a_report_with_decisions(model_dir, onnx_tree, tmp_path):
    with pytest.raises(RenderError, match="not found.*make quality"):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree, precision="cpu-choice",
                          quality_report=tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"errors": []}')
    with pytest.raises(RenderError, match="not a quality report"):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree, precision="cpu-choice",
                          quality_report=tmp_path / "bad.json")
    report = _quality_report(tmp_path / "report.json", {"flow_encoder": "fp16"})  # no fp16 file in the tree
    with pytest.raises(RenderError, match="fp16/flow_encoder.onnx not found"):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree, precision="cpu-choice",
                          quality_report=report)


def test_torch_runtime_refuses_reduced_precision(model_dir, onnx_tree, tmp_path):
    with pytest.raises(RenderError, match="runtime=torch"):
        render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree,
                          precision="flow_estimator=int8_cpu", runtime="torch")
    render_repository("local", tmp_path / "r", model_dir=model_dir, onnx_dir=onnx_tree, runtime="torch")
    assert _marker(tmp_path / "r")["graph_precisions"]["flow_estimator"] == "fp32 (torch)"


def test_trt_engines_per_graph(model_dir, onnx_tree, tmp_path):
    out = tmp_path / "r"
    render_repository("trt", out, model_dir=model_dir, onnx_dir=onnx_tree, engine_dir=tmp_path / "engines",
                      precision="flow_estimator=int8,flow_encoder=fp16", allow_missing=True)
    assert _marker(out)["graph_precisions"] == {**{g: "fp32" for g in GRAPHS}, "flow_estimator": "int8",
                                               "flow_encoder": "fp16"}
    assert f"TensorRT engine {tmp_path / 'engines' / 'int8' / 'flow_estimator.plan'}" in (
        out / "flow_estimator" / "config.pbtxt").read_text()


def test_render_script_precision_options(model_dir, onnx_tree, tmp_path):
    report = _quality_report(tmp_path / "report.json", {"flow_encoder": "int8_cpu", "hift_decoder": "fp32"})
    script = [sys.executable, str(ROOT / "model_repository" / "render.py"), "--model-dir", str(model_dir),
              "--onnx-dir", str(onnx_tree)]
    proc = subprocess.run([*script, "--out", str(tmp_path / "a"), "--precision", "cpu-choice", "--quality-report",
                           str(report)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "flow_encoder       python (onnxruntime, int8_cpu)" in proc.stdout
    proc = subprocess.run([*script, "--out", str(tmp_path / "b"), "--precision", "hift_decoder=int8_cpu"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert _marker(tmp_path / "b")["graph_precisions"]["hift_decoder"] == "int8_cpu"
    proc = subprocess.run([*script, "--out", str(tmp_path / "c"), "--flavor", "trt", "--precision", "int8_cpu",
                           "--allow-missing"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "local flavor only" in proc.stderr


def test_parse_tunable_types_each_field_and_names_the_known_ones():
    from cosyvoice_triton.serving.repository import parse_tunable

    assert parse_tunable("instances=flow:2,flow_estimator:3") == ("instances", {"flow": 2, "flow_estimator": 3})
    assert parse_tunable("warmup=false") == ("warmup", False)
    assert parse_tunable("max_queue_delay_us=5000") == ("max_queue_delay_us", 5000)
    assert parse_tunable("runtime=torch") == ("runtime", "torch")
    with pytest.raises(RenderError, match="NAME one of .*max_queue_delay_us"):
        parse_tunable("bogus=1")
    with pytest.raises(RenderError, match="not a valid"):
        parse_tunable("instances=flow:two")
