"""``bench-served-cv3`` on the tiny demo folders: a real ``tritonserver`` with only the two measured CosyVoice3 models
loaded, the same requests served and in process, each chunk equal both ways, the report's figures and table."""

from __future__ import annotations

import json

from conftest import PATIENCE_S

from cosyvoice_triton.bench.served_cv3 import TTS_MODEL, VC_MODEL, build_parser, main, report_lines, run_bench


def test_the_bench_measures_cosyvoice3_through_the_server(serving_assets, cv3_demo_dir, tmp_path):
    args = build_parser().parse_args([
        "--model-dir", str(cv3_demo_dir), "--cv2-dir", str(serving_assets["model_dir"]),
        "--onnx-dir", str(serving_assets["onnx_dir"]), "--work-dir", str(tmp_path / "work"), "--rounds", "2",
        "--start-timeout", str(PATIENCE_S), "--timeout", str(PATIENCE_S)])
    said = []
    report = run_bench(args, log=said.append)
    tts, vc = report["models"][TTS_MODEL], report["models"][VC_MODEL]
    for m in (tts, vc):
        assert m["equal"] and m["max_chunk_error"] <= 1e-3, m
        for side in ("in_process", "served"):
            assert m[side]["cold_first_s"] > 0 and m[side]["first_p50_s"] > 0
    assert tts["in_process"]["chunks"] == tts["served"]["chunks"] >= 2  # streamed: a first chunk, then more
    assert tts["served"]["later_p50_s"] > 0
    assert vc["served"]["chunks"] == 1 and vc["served"]["later_p50_s"] is None
    # only the two measured models were loaded, of a repository rendered with all of them
    assert (tmp_path / "work" / "model_repository" / "cosyvoice3_tts_live").is_dir()
    assert report["loaded_models"] == sorted([TTS_MODEL, VC_MODEL])
    text = "\n".join(report_lines(report))
    assert f"| {TTS_MODEL} | served |" in text and "chunks equal" in text
    assert any("round 2/2" in line for line in said)
    json.dumps(report)  # the --json form


def test_the_bench_refuses_no_rounds(capsys):
    assert main(["--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
