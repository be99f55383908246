"""``cosyvoice-triton bench-server-overhead`` at its smallest settings: it starts its own tritonserver on the tiny
model, runs the four streaming models in process and served, and reports what the server adds. Checked: the report's
fields, that every served chunk equals the in-process one within the bar, and that the server is gone afterwards.
No timing is asserted (figures come from a quiet machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PATIENT_TEST_S, ROOT

from cosyvoice_triton.bench.server_overhead import CHUNK_BAR, MODELS, TTS_STREAM


@pytest.mark.timeout(PATIENT_TEST_S)
def test_the_bench_reports_every_model_and_equal_outputs(serving_assets, tmp_path):
    out, work = tmp_path / "report.json", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "cosyvoice_triton", "bench-server-overhead",
                           "--model-dir", str(serving_assets["model_dir"]),
                           "--onnx-dir", str(serving_assets["onnx_dir"]), "--work-dir", str(work), "--rounds", "1",
                           "--source-seconds", "2.5",
                           "--text", "Hello there, how are you?", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=PATIENT_TEST_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    left = subprocess.run(["pgrep", "-af", str(work)], capture_output=True, text=True)  # the server, its stubs
    assert left.returncode == 1 and not left.stdout.strip(), f"the bench left processes running: {left.stdout}"

    report = json.loads(out.read_text())
    assert report["commit"] and report["cpu"] and report["cores"] >= 1
    assert len(report["load_start"]) == len(report["load_end"]) == 3
    assert report["rounds"] == 1 and set(report["torch_threads"]) == set(MODELS)
    assert list(report["models"]) == list(MODELS)
    for model, m in report["models"].items():
        for side in ("in_process", "served"):
            s = m[side]
            assert len(s["first_chunk_s"]) == 1 and s["first_chunk_p50_s"] > 0, (model, side)
            assert s["chunks"] >= 1
        assert m["in_process"]["chunks"] == m["served"]["chunks"]
        assert isinstance(m["added_first_chunk_s"], float) and isinstance(m["target_met"], bool)
        assert m["target_s"] == 0.05 and m["bar"] == CHUNK_BAR
        assert m["equal"] is True and m["max_rel_err"] <= CHUNK_BAR, (model, m["max_rel_err"])
    assert report["equal"] is True
    tts = report["tts_first_chunk"]
    assert tts["target_s"] == 4.0 and isinstance(tts["target_met"], bool)
    assert set(tts["breakdown_p50"]) == {"to_first_token_s", "first_hop_tokens", "first_hop_decode_s", "flow_s",
                                         "hift_s", "transport_s"}
    assert tts["breakdown_p50"] == report["models"][TTS_STREAM]["breakdown_p50"]
    for model in MODELS:  # the printed report names each model's target, met or missed
        assert f"{model}: " in proc.stdout
    assert proc.stdout.count("at most 50 ms to the library for the same chunk: ") == len(MODELS)
    assert "load average" in proc.stdout and "equal within the bar for every model" in proc.stdout
