"""The quality report (``cosyvoice_triton.export.quality``, ``export/quality_report.py``): metrics, the bar and the
speed rule, and the whole report on the tiny demo model (graphs built once by ``test_quantize``'s helpers)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
from conftest import require_speech
from test_quantize import export_cli, one_thread, tiny_quantized

from cosyvoice_triton.export.quality import BAR, Bar, ErrorRow, SpeedRow, decide, logmel_db
from cosyvoice_triton.export.quantize import rel_rms

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="session")
def report_run(tmp_path_factory):
    """``export/quality_report.py`` on the tiny model: (tiny, exit status, stdout, report json)."""
    require_speech()
    tiny, rc, _ = tiny_quantized(str(tmp_path_factory.getbasetemp() / "quant-tiny"))
    assert rc == 0
    out_dir = tmp_path_factory.mktemp("quality")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), one_thread():
        code = export_cli("quality_report").main([
            "--model-dir", str(tiny.model_dir), "--onnx-root", str(tiny.root), "--heldout", "1",
            "--timing-runs", "1", "--estimator-frames", "64", "--hift-frames", "40", "--encoder-tokens", "40",
            "--max-seconds", "4", "--threads", "1", "--out", str(out_dir), "-q"])
    data = json.loads((out_dir / "report.json").read_text()) if code == 0 else {}
    return tiny, code, buf.getvalue(), data, out_dir


# ============================================================================================== metrics


def test_logmel_distance_is_phase_insensitive_and_in_db():
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(24000).astype(np.float32) * 0.1
    assert logmel_db(noise, noise)[0] == 0.0
    d, n = logmel_db(2 * noise, noise)
    assert n > 0 and d == pytest.approx(20 * math.log10(2), abs=0.05)  # every bin 6.02 dB louder
    late = np.roll(noise, 3)  # the same sound 3 samples (0.1 ms) later: a linear phase change
    assert rel_rms(late, noise) > 1.0  # sample-wise "140% error"...
    assert logmel_db(late, noise)[0] < 0.1  # ...the same spectrum


def _row(p: str, s: str, mel_rms: float = 1e-3, mel_db: float = 0.01, logmel: float = 0.1) -> ErrorRow:
    return ErrorRow(p, s, 1, mel_rms, mel_rms, mel_db, 0.5, logmel)


def test_bar_checks_each_stage_on_its_own_output():
    assert BAR.check("flow_estimator", _row("int8", "flow_estimator"))[0]
    ok, why = BAR.check("flow_estimator", _row("int8", "flow_estimator", mel_rms=0.2))
    assert not ok and "mel rel RMS" in why
    ok, why = BAR.check("flow_encoder", _row("int8", "flow_encoder", mel_db=0.9))
    assert not ok and "dB" in why
    # a flow stage is not judged on the waveform (random-weight HiFT amplifies phase drift), HiFT is
    assert BAR.check("flow_estimator", _row("int8", "flow_estimator", logmel=3.0))[0]
    assert not BAR.check("hift_decoder", _row("int8", "hift_decoder", logmel=0.9))[0]
    assert not BAR.check("hift_decoder", _row("int8", "hift_decoder", logmel=float("nan")))[0]
    assert "0.5 dB" in Bar().describe()


def _speed(stage: str, p: str, speedup: float) -> SpeedRow:
    return SpeedRow(stage, p, "x", 1.0 / speedup, 1.0 / speedup, 3, speedup)


def test_decide_applies_the_speed_rule_and_the_bar():
    errors = [_row("int8_cpu", "flow_estimator"), _row("int8", "flow_estimator"),
              _row("int8_cpu", "hift_decoder", logmel=2.0), _row("int8", "hift_decoder"),
              _row("fp16", "flow_encoder")]
    speed = [_speed("flow_estimator", "fp32", 1.0), _speed("flow_estimator", "int8_cpu", 1.5),
             _speed("flow_estimator", "int8", 1.3), _speed("hift_decoder", "fp32", 1.0),
             _speed("hift_decoder", "int8_cpu", 1.8), _speed("hift_decoder", "int8", 1.1),
             _speed("flow_encoder", "fp32", 1.0), _speed("flow_encoder", "fp16", 1.24)]
    d = {x.stage: x for x in decide(errors, speed)}
    assert d["flow_estimator"].cpu_precision == "int8_cpu"  # the fastest one that passes
    assert d["flow_estimator"].candidates == ["int8_cpu", "int8"]
    assert d["hift_decoder"].cpu_precision == "fp32"  # fast but over the bar / within the bar but slow
    assert "log-mel 2.00 dB" in d["hift_decoder"].reason and "1.10x" in d["hift_decoder"].reason
    assert d["flow_encoder"].cpu_precision == "fp32"  # 1.24x < 1.25x
    assert "int8" in d["hift_decoder"].gpu_note and "fp16" in d["flow_encoder"].gpu_note


# =============================================================================================== report


def test_report_runs_on_the_tiny_model(report_run):
    _, code, out, data, out_dir = report_run
    assert code == 0, out
    assert (out_dir / "report.md").read_text().strip() == out.strip()
    precisions = data["meta"]["precisions"]
    assert precisions == ["fp32", "fp16", "int8", "int8_cpu"]
    rows = {(r["precision"], r["swapped"]): r for r in data["errors"]}
    for p in precisions:
        for s in ("flow_encoder", "flow_estimator", "hift_decoder", "all"):
            if s == "flow_encoder" and p != "fp32":
                continue  # the CLI run quantized the estimator and HiFT only
            assert (p, s) in rows, (p, s)
    assert rows[("int8", "all")]["note"] == "fp32 for flow_encoder"
    assert ("fp32 (PyTorch)", "HiFT noise seed") in rows
    # fp32 ONNX is the PyTorch pipeline (sanity): mel to ~1e-6, waveform to ~1e-4 (HiFT's phase)
    assert rows[("fp32", "all")]["mel_rel_rms"] < 1e-4
    assert rows[("fp32", "hift_decoder")]["wave_rel_rms"] < 1e-4
    for (p, s), r in rows.items():
        assert all(math.isfinite(r[k]) for k in ("mel_rel_max", "mel_rel_rms", "wave_rel_rms", "logmel_db")), (p, s)
        if s == "hift_decoder":
            assert r["mel_rel_rms"] == 0.0  # given the reference mel
        if p in ("int8", "int8_cpu") and s in ("flow_estimator", "hift_decoder"):
            assert r["mel_rel_rms"] + r["wave_rel_rms"] > 1e-5  # really swapped
        if s == "flow_estimator":  # the waveform distance split into HiFT's two input paths
            assert r["logmel_mel_only_db"] is not None and r["logmel_source_only_db"] is not None
    stages = {(s["stage"], s["precision"]) for s in data["speed"]}
    assert {("flow_estimator", p) for p in precisions} <= stages and ("hift_source", "fp32") in stages
    assert ("flow_encoder", "int8") not in stages
    decisions = {d["stage"]: d for d in data["decisions"]}
    assert set(decisions) == {"flow_encoder", "flow_estimator", "hift_decoder"}
    for d in decisions.values():
        assert d["cpu_precision"] in ("fp32", "fp16", "int8", "int8_cpu") and d["reason"]


def test_report_markdown_has_the_tables(report_run):
    _, code, out, _, _ = report_run
    assert code == 0
    for header in ("## Error against the fp32 PyTorch pipeline", "## Speed per stage", "## CPU precision per stage",
                   "## Layers kept in float", "## Calibration (int8 Q/DQ)", "## Held-out pairs", "**Bar**",
                   "**Rule**", "Random-weight demo models"):
        assert header in out, header
    assert ("| precision | swapped | pairs | mel rel max | mel rel RMS | mel MAE dB | wave rel RMS "
            "| log-mel dist dB | via mel only | via source only | within bar |") in out
    assert "| stage | CPU precision | why | GPU (TensorRT) |" in out
    for stage in ("flow_encoder", "flow_estimator", "hift_decoder", "hift_source"):
        assert any(line.startswith(f"| {stage} | **") for line in out.splitlines()), stage
    assert "| int8 | flow_estimator | 1 |" in out


@pytest.mark.parametrize("args, message", [
    (["--precisions", "int4"], "unknown int4"),
    (["--stages", "hift_source"], "unknown hift_source"),
    (["--heldout", "0"], "must be >= 1"),
    (["--hift-frames", "5000"], "beyond the shape spec"),
])
def test_cli_rejects_bad_arguments(tmp_path, capsys, args, message):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    root = tmp_path / "onnx" / "fp32"
    root.mkdir(parents=True)
    for g in ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder"):
        (root / f"{g}.onnx").write_bytes(b"")
    rc = export_cli("quality_report").main(["--model-dir", str(model_dir), "--onnx-root", str(tmp_path / "onnx"),
                                            *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_needs_the_fp32_graphs(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "onnx").mkdir()
    rc = export_cli("quality_report").main(["--model-dir", str(tmp_path / "model"), "--onnx-root",
                                            str(tmp_path / "onnx")])
    assert rc == 2 and "export_onnx.py" in capsys.readouterr().err
