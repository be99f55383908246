"""The load test's profile of the slowest stage (``cosyvoice_triton.loadtest.profile``): profile-trace parsing and
aggregation on a synthetic onnxruntime trace, FLOP counting from recorded shapes, the generated conclusion, the
served-file lookup, the report section; then short real runs on a small graph built here and, when the tiny demo's
export is present, on its ``flow_estimator``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cosyvoice_triton.export.quantize import kernel_events, profile_trace
from cosyvoice_triton.loadtest.profile import (
    conclusion,
    gemm_ceiling,
    gemm_dims,
    graph_length,
    kernel_flops,
    measured_batch,
    profile_markdown,
    profile_stage,
    served_onnx,
    slowest_graph,
    summarize_kernels,
    time_per_row,
)
from cosyvoice_triton.loadtest.report import render_markdown
from cosyvoice_triton.loadtest.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
TINY_ESTIMATOR = ROOT / "build" / "onnx" / "fp32" / "flow_estimator.onnx"


def _node(name, op, ts, dur, inputs=(), outputs=()):
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "ph": "X",
            "args": {"op_name": op, "input_type_shape": [{"float": list(s)} for s in inputs],
                     "output_type_shape": [{"float": list(s)} for s in outputs], "provider": "CPUExecutionProvider"}}


def _run(t0):
    """One run's events from ``t0``: a MatMul whose pre-packed weight is not listed (K from A), a transposed
    FusedMatMul, a Conv with its weight, a Conv without (uncounted), a Softplus, and non-kernel node events."""
    return [
        {"cat": "Session", "name": "model_run", "ts": t0, "dur": 1000, "ph": "X", "args": {}},
        _node("mm", "MatMul", t0 + 1, 100, [(2, 400, 64)], [(2, 400, 32)]),
        _node("fmm", "FusedMatMul", t0 + 110, 50, [(2, 512, 400)], [(2, 400, 512)]),
        _node("conv", "Conv", t0 + 200, 300, [(2, 320, 402), (64, 320, 3), (64,)], [(2, 64, 400)]),
        _node("conv_packed", "Conv", t0 + 510, 50, [(2, 64, 402)], [(2, 64, 400)]),
        _node("sp", "Softplus", t0 + 600, 500, [(2, 64, 400)], [(2, 64, 400)]),
        {"cat": "Node", "name": "sp_fence_before", "ts": t0 + 599, "dur": 0, "ph": "X",
         "args": {"op_name": "Softplus"}},
    ]


TRACE = [{"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 50, "ph": "X", "args": {}}]
TRACE += [{**e, "dur": e["dur"] * 10} if e["cat"] == "Node" else e for e in _run(100)]  # slow warm-up
TRACE += _run(20_000) + _run(40_000)


def test_kernel_events_skip_the_warm_up_and_keep_shapes():
    all_events = kernel_events(TRACE)
    assert len(all_events) == 15  # 5 kernels x 3 runs; fences and session events left out
    events = kernel_events(TRACE, skip_runs=1)
    assert len(events) == 10 and {e.name for e in events} == {"mm", "fmm", "conv", "conv_packed", "sp"}
    mm = next(e for e in events if e.name == "mm")
    assert mm.op_type == "MatMul" and mm.dur_us == 100 and mm.inputs == (("float", (2, 400, 64)),)
    assert mm.outputs == (("float", (2, 400, 32)),)
    assert len(kernel_events(TRACE, skip_runs=5)) == 15  # more runs skipped than recorded: nothing skipped


def test_gemm_dims_and_flops_from_recorded_shapes():
    f = lambda *s: [("float", x) for x in s]
    assert gemm_dims("MatMul", f((2, 400, 64)), f((2, 400, 32))) == (800, 64, 32)
    assert gemm_dims("FusedMatMul", f((2, 512, 400)), f((2, 400, 512))) == (800, 512, 512)  # transposed A
    assert gemm_dims("MatMul", f((2, 2, 200, 256), (1, 2, 256, 399)), f((2, 2, 200, 399))) == (800, 256, 399)
    assert gemm_dims("Gemm", f((320, 9)), f((9, 256))) == (9, 320, 256)  # transA
    assert gemm_dims("Conv", f((2, 320, 402), (64, 320, 3)), f((2, 64, 400))) == (800, 960, 64)
    assert gemm_dims("Conv", f((2, 64, 402)), f((2, 64, 400))) is None  # weight not listed
    assert gemm_dims("QLinearConv", f((1, 8, 10), (), (), (4, 8, 3)), f((1, 4, 8))) == (8, 24, 4)
    assert gemm_dims("ConvTranspose", f((1, 16, 10), (16, 8, 4)), f((1, 8, 40))) == (10, 16, 32)
    assert gemm_dims("Softplus", f((2, 3)), f((2, 3))) is None
    assert kernel_flops("Conv", f((2, 320, 402), (64, 320, 3)), f((2, 64, 400))) == 2.0 * 2 * 64 * 400 * 960


def test_summarize_kernels_shares_top_nodes_and_gflops():
    k = summarize_kernels(kernel_events(TRACE, skip_runs=1), runs=2)
    assert k["runs"] == 2 and k["kernel_ms_per_run"] == pytest.approx(1.0)  # 1000 us of kernels per run
    ops = {o["op_type"]: o for o in k["by_op"]}
    assert [o["op_type"] for o in k["by_op"]] == ["Softplus", "Conv", "MatMul", "FusedMatMul"]
    assert ops["Softplus"]["share"] == pytest.approx(0.5) and ops["Conv"]["share"] == pytest.approx(0.35)
    assert ops["Conv"]["nodes"] == 2 and math.isnan(ops["Softplus"]["gflops"])
    conv_flops = 2.0 * 800 * 960 * 64
    assert ops["Conv"]["gflops"] == pytest.approx(conv_flops / 300 / 1e3)  # the counted conv only
    assert sum(o["share"] for o in k["by_op"]) == pytest.approx(1.0)
    assert [n["node"] for n in k["top_nodes"]] == ["sp", "conv", "mm", "fmm", "conv_packed"]  # ties: first seen
    assert k["top_nodes"][0]["ms_per_run"] == pytest.approx(0.5)
    g = k["gemm"]
    flops = conv_flops + 2.0 * 800 * 64 * 32 + 2.0 * 800 * 512 * 512
    assert g["share"] == pytest.approx(0.5) and g["uncounted_ms_per_run"] == pytest.approx(0.05)
    assert g["gflop_per_run"] == pytest.approx(flops / 1e9)
    assert g["gflops"] == pytest.approx(flops / 450 / 1e3)  # counted time only: 100 + 50 + 300 us
    assert g["heaviest"] == {"node": "conv", "op_type": "Conv", "m": 800, "k": 960, "n": 64}
    empty = summarize_kernels([], runs=3)
    assert empty["by_op"] == [] and empty["gemm"]["heaviest"] is None and math.isnan(empty["gemm"]["gflops"])


REPORT = {
    "users": 10, "columns": ["plain", "integrated"], "composite_models": ["cosyvoice_vc", "flow", "hift"],
    "rendered": {"plain": {"models": {"flow_estimator": "python (torch, fp32 (torch))"}},
                 "integrated": {"models": {"flow_estimator": "python (onnxruntime, fp32)"}}},
    "runs": [
        {"column": "integrated", "protocol": "http", "users": 10, "requests": 210, "req_per_s": 1.6, "stages": {
            "cosyvoice_vc": {"requests": 210, "executions": 210, "avg_batch": 1.0, "compute_ms": 4000.0},
            "flow": {"requests": 210, "executions": 45, "avg_batch": 4.67, "compute_ms": 3000.0},
            "flow_estimator": {"requests": 450, "executions": 450, "avg_batch": 9.33, "compute_ms": 195.5},
            "hift_decoder": {"requests": 191, "executions": 191, "avg_batch": 1.1, "compute_ms": 174.6},
            "preprocess": {"requests": 210, "executions": 82, "avg_batch": 2.56, "compute_ms": 150.0}}},
        {"column": "integrated", "protocol": "grpc", "users": 10, "requests": 211, "req_per_s": 1.3, "stages": {
            "cosyvoice_vc": {"requests": 211, "executions": 211, "avg_batch": 1.0, "compute_ms": 5000.0},
            "flow_estimator": {"requests": 460, "executions": 460, "avg_batch": 9.17, "compute_ms": 221.8}}},
        {"column": "integrated", "protocol": "grpc", "users": 1, "requests": 13, "stages": {
            "flow_estimator": {"requests": 20, "executions": 20, "avg_batch": 2.0, "compute_ms": 40.0}}},
        {"column": "plain", "protocol": "http", "users": 10, "requests": 210, "req_per_s": 1.5, "stages": {
            "flow_estimator": {"requests": 2100, "executions": 2100, "avg_batch": 2.0, "compute_ms": 38.8}}},
    ],
}


def test_measured_batch_slowest_graph_and_lengths():
    assert measured_batch(REPORT, "flow_estimator") == pytest.approx((450 * 9.33 + 460 * 9.17) / 910)
    assert measured_batch(REPORT, "flow_estimator", column="plain") == pytest.approx(2.0)
    assert math.isnan(measured_batch(REPORT, "flow_encoder"))
    assert slowest_graph(REPORT) == ("flow_estimator", "flow_estimator")
    assert slowest_graph(REPORT, candidates=("hift_decoder", "flow_encoder")) == ("hift_decoder", "flow_estimator")
    assert graph_length("flow_estimator", 5.01, 3.0) == 400  # 50 mel frames per second at 24 kHz, hop 480
    assert graph_length("flow_encoder", 5.01, 3.0) == 200  # 25 tokens per second
    assert graph_length("hift_decoder", 5.0, 3.0) == 250  # the source only
    with pytest.raises(ValueError):
        graph_length("speech_tokenizer", 5.0, 3.0)


def _profile(ms_per_row, gflops=60.0, share=0.33):
    sweep = [{"rows": b, "runs": 5, "ms_per_call": t * b, "ms_per_row": t, "min_ms_per_call": t * b}
             for b, t in zip((2, 4, 8, 16), ms_per_row, strict=True)]
    by_op = [{"op_type": "Softplus", "share": 0.25, "ms_per_run": 45.0, "nodes": 10, "gflops": math.nan},
             {"op_type": "MatMul", "share": share, "ms_per_run": 30.0, "nodes": 32, "gflops": gflops},
             {"op_type": "Add", "share": 0.09, "ms_per_run": 17.0, "nodes": 29, "gflops": math.nan}]
    return {"graph": "flow_estimator", "onnx": "x.onnx", "precision": "fp32", "threads": 1, "rows": 9,
            "measured_avg_batch": 9.25, "length": 400, "length_axis": "mel_frames", "input_shapes": {"x": [9, 80, 400]},
            "source_s": 5.01, "prompt_s": 3.0, "rows_sweep": sweep, "load_average": 1.5, "duration_s": 8.0,
            "kernels": {"runs": 3, "kernel_ms_per_run": 180.0, "by_op": by_op, "top_nodes": [
                {"node": "/estimator/Softplus", "op_type": "Softplus", "share": 0.03, "ms_per_run": 5.0}],
                "gemm": {"share": share, "ms_per_run": 60.0, "gflop_per_run": 3.6, "gflops": gflops,
                         "uncounted_ms_per_run": 0.0, "heaviest": {"node": "c", "op_type": "Conv", "m": 3600,
                                                                   "k": 960, "n": 64}}},
            "ceiling": {"m": 3600, "k": 960, "n": 64, "threads": 1, "onnxruntime_gflops": 95.0,
                        "numpy_gflops": 14.0, "gflops": 95.0},
            "peak": {"m": 1024, "k": 1024, "n": 1024, "threads": 1, "onnxruntime_gflops": 100.0,
                     "numpy_gflops": 50.0, "gflops": 100.0},
            "server": [{"column": "integrated", "protocol": "http", "runtime": "onnxruntime", "avg_batch": 9.33,
                        "compute_ms": 195.5, "ms_per_row": 20.95, "rows_per_conversion": 20.0, "req_per_s": 1.6}],
            "capacity": {"rows_per_conversion": 20.0, "core_s_per_conversion": 0.36, "cores": 2,
                         "max_conversions_per_s": 5.6, "measured_req_per_s": 1.45}, "notes": ["a note"]}


def test_conclusion_follows_the_numbers():
    flat = conclusion(_profile((15.6, 16.3, 18.0, 19.4)))
    assert "rises from 2 to 16 rows (15.6 -> 19.4 ms per row, x1.24): batching amortises nothing" in flat
    assert "60% of the 1-thread GEMM peak measured here (100.0 GFLOP/s; 95.0 at the heaviest node's size)" in flat
    assert "take only 33% of its kernel time" in flat
    assert "Softplus 25%, Add 9%" in flat and "(a GPU)" in flat and "2 cores convert at most 5.6 per second" in flat
    assert "is flat" in conclusion(_profile((16.0, 16.0, 16.5, 16.2)))
    falls = conclusion(_profile((20.0, 15.0, 11.0, 10.0), gflops=80.0, share=0.8))
    assert "falls from 20.0 to 10.0 ms (-50%)" in falls and "compute-bound" in falls and "GPU" not in falls
    low = conclusion(_profile((16.0, 16.0, 16.0, 16.0), gflops=20.0))
    assert "run at only 20.0 GFLOP/s, 20% of" in low
    no_peak = {**_profile((16.0, 16.0, 16.0, 16.0)), "peak": {}}
    assert "63% of the 1-thread GEMM peak measured here (95.0 GFLOP/s)" in conclusion(no_peak)


def test_profile_markdown_and_report_section():
    lines = "\n".join(profile_markdown(_profile((15.6, 16.3, 18.0, 19.4))))
    assert "## Profile of the slowest stage: `flow_estimator`" in lines
    assert "| 16 | 310.4 | 19.40 | 5 |" in lines and "| Softplus | 25.0% | 45.00 | 10 | n/a |" in lines
    assert "integrated http (onnxruntime) 195.5 ms at 9.33 rows (20.95 ms per row)" in lines
    assert "heaviest node's size: [3600 x 960] x [960 x 64], 1 thread(s): onnxruntime MatMul 95.0 GFLOP/s, numpy " \
           "14.0 GFLOP/s" in lines and "the peak: [1024 x 1024] x [1024 x 1024]" in lines
    assert "Conclusion: Per-row time" in lines
    assert "- a note" in lines
    assert profile_markdown({}) == []
    assert "Not profiled: boom" in "\n".join(profile_markdown({"error": "boom"}))
    md = render_markdown({"config_name": "t", "profile": {"error": "no integrated column"}})
    assert "## Profile of the slowest stage" in md and "Not profiled: no integrated column" in md


def _repo(tmp_path: Path, graphs: dict[str, str | None], threads: int = 1) -> Path:
    """A rendered-looking repository: the marker, and per graph a config whose onnx_path is the given file."""
    repo = tmp_path / "model_repository"
    repo.mkdir()
    (repo / "cosyvoice_repository.json").write_text(json.dumps(
        {"precision": "cpu-choice", "graph_precisions": {g: "fp32" for g in graphs},
         "tunables": {"intra_op_threads": threads}}))
    for g, path in graphs.items():
        (repo / g).mkdir()
        (repo / g / "config.pbtxt").write_text(
            f'name: "{g}"\nparameters {{ key: "onnx_path" value: {{ string_value: "{path or ""}" }} }}\n'
            f'parameters {{ key: "intra_op_threads" value: {{ string_value: "{threads}" }} }}\n')
    return repo


def test_served_onnx_reads_the_config_then_model_onnx(tmp_path):
    f = tmp_path / "est.onnx"
    f.write_bytes(b"x")
    repo = _repo(tmp_path, {"flow_estimator": str(f), "hift_decoder": None, "flow_encoder": None}, threads=2)
    assert served_onnx(repo, "flow_estimator") == (f, "fp32", 2)
    (repo / "hift_decoder" / "1").mkdir()
    (repo / "hift_decoder" / "1" / "model.onnx").write_bytes(b"x")
    assert served_onnx(repo, "hift_decoder")[0] == repo / "hift_decoder" / "1" / "model.onnx"
    with pytest.raises(FileNotFoundError, match="not served from an ONNX file"):
        served_onnx(repo, "flow_encoder")


def _small_graph(path: Path) -> Path:
    """[B, T, 16] x [16, 32] MatMul, Softplus, Conv1d over T: a few kernels of known shapes."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w")
    k = numpy_helper.from_array(rng.standard_normal((8, 32, 3)).astype(np.float32), "k")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Softplus", ["h"], ["s"], name="sp"),
             helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1], name="tr"),
             helper.make_node("Conv", ["t", "k"], ["y"], pads=[1, 1], name="conv")]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 8, "T"])], [w, k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_real_profile_of_a_small_graph(tmp_path):
    path = _small_graph(tmp_path / "small.onnx")
    feeds = lambda b: {"x": np.random.default_rng(b).standard_normal((b, 64, 16)).astype(np.float32)}
    sweep = time_per_row(path, feeds, (1, 4), threads=1, repeats=3)
    assert [s["rows"] for s in sweep] == [1, 4] and all(s["ms_per_row"] > 0 and s["runs"] == 3 for s in sweep)
    events = kernel_events(profile_trace(path, [feeds(2)], threads=1, runs=2, warmup=1), skip_runs=1)
    k = summarize_kernels(events, runs=2)
    assert {o["op_type"] for o in k["by_op"]} >= {"MatMul", "Softplus"}
    assert sum(o["share"] for o in k["by_op"]) == pytest.approx(1.0)
    mm = next(e for e in events if e.op_type == "MatMul")
    assert gemm_dims(mm.op_type, mm.inputs, mm.outputs) == (128, 16, 32)  # weight omitted or listed: same answer
    assert k["gemm"]["gflops"] > 0 and k["gemm"]["heaviest"] is not None
    c = gemm_ceiling(64, 32, 32, min_time_s=0.02)
    assert c["onnxruntime_gflops"] > 0 and c["gflops"] >= c["onnxruntime_gflops"] and (c["m"], c["k"]) == (64, 32)
    assert gemm_ceiling(10**6, 100, 100, min_time_s=0.0, max_flops=2e6)["m"] == 100  # shrunk to the FLOP cap


@pytest.mark.skipif(not TINY_ESTIMATOR.is_file(), reason="tiny demo export missing (make export)")
def test_profile_stage_on_the_tiny_flow_estimator(tmp_path):
    repo = _repo(tmp_path, {"flow_estimator": str(TINY_ESTIMATOR)})
    p = profile_stage(repo, REPORT, source_s=0.5, prompt_s=0.5, rows=(2, 4), profile_runs=1, ceiling_s=0.02,
                      progress=lambda s: None)
    assert p["graph"] == "flow_estimator" and p["rows"] == 9 and p["length"] == 50 and p["threads"] == 1
    assert p["input_shapes"]["x"] == [9, 80, 50] and [s["rows"] for s in p["rows_sweep"]] == [2, 4, 9]
    assert p["kernels"]["gemm"]["gflops"] > 0 and p["ceiling"]["gflops"] > 0 and p["peak"]["m"] == 1024
    assert p["notes"] == []  # flow_estimator is the slowest leaf model in REPORT
    assert p["capacity"]["rows_per_conversion"] == pytest.approx((450 * 9.33 / 210 + 460 * 9.17 / 211) / 2)
    assert p["conclusion"].startswith("Per-row time of `flow_estimator`")
    json.dumps(p)  # the report's JSON section
    assert "## Profile of the slowest stage" in "\n".join(profile_markdown(p))


def test_runner_profile_options_and_profile_only_without_integrated(tmp_path):
    from cosyvoice_triton.loadtest.runner import options_from_args, parser, profile_only

    opts = options_from_args(parser().parse_args(["--config", "tiny", "--no-profile"]))
    assert opts.profile is False and opts.profile_only is False
    opts = options_from_args(parser().parse_args(["--profile-only", "--out-dir", str(tmp_path),
                                                  "--profile-graph", "hift_decoder"]))
    assert opts.profile and opts.profile_only and opts.profile_graph == "hift_decoder"
    Workload((np.zeros(16000, np.float32),), (16000,), np.zeros(24000, np.float32), 24000).save(
        tmp_path / "workload.npz")
    (tmp_path / "report.json").write_text(json.dumps({"config_name": "t", "columns": ["plain"], "runs": []}))
    report = profile_only(opts)
    assert report["profile"] == {"error": "no integrated column in this report"}
    assert "Not profiled: no integrated column" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["profile"]["error"]
