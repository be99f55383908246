"""bench-peer (official vs library vs served, side by side) and the bare-GPU benchmark: the table logic on made-up
figures, a real run on the tiny demo model (library side; the official side only with OFFICIAL=<checkout>), and
the GPU script's dry run on the CPU. Speed is never asserted (shared, loaded machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.bench import peer

ROOT = Path(__file__).resolve().parents[2]


def _figures(**over) -> dict:
    result = {
        "sides": {
            "official": {"seconds": [12.0, 10.0, 11.0], "peak_rss_mb": 1400.0},
            "library": {"seconds": [6.0, 5.0, 7.0], "peak_rss_mb": 1500.0,
                        "graph_seconds": {"flow_encoder": [0.5, 0.5, 0.5], "flow_estimator": [3.0, 3.0, 3.0],
                                          "hift": [2.0, 2.0, 2.0]}},
            "served": {"seconds": [9.0, 9.0, 9.0], "peak_rss_mb": 2500.0,
                       "graph_seconds": {"flow_encoder": [0.4] * 3, "flow_estimator": [6.0] * 3, "hift": [2.0] * 3}},
            "served_int8": {"skipped": "no build/onnx-full/int8_cpu"},
        },
        "flops": {"flow_encoder": 10e9, "flow_estimator": 150e9, "hift": 60e9},
        "ceiling_gflops": [90.0, 100.0],
        "parity": {"library_vs_official": 2e-6, "served_vs_library": 2e-4},
        "notes": ["load average 9"],
    }
    result.update(over)
    return result


def test_summary_medians_ratios_gflops_and_targets():
    s = peer.summarize(_figures())
    rows, t = s["rows"], s["targets"]
    assert s["ceiling_gflops"] == 100.0  # the best of the two measures
    assert rows["official"]["median_s"] == 11.0 and rows["library"]["median_s"] == 6.0
    assert rows["library"]["vs_official"] == pytest.approx(11 / 6)
    assert rows["served"]["vs_official"] == pytest.approx(11 / 9)
    est = rows["library"]["graphs"]["flow_estimator"]
    assert est["gflops_per_s"] == pytest.approx(50.0) and est["of_ceiling"] == pytest.approx(0.5)
    assert t["library_vs_official"]["met"] is True and t["library_vs_official"]["reason"] == "met"
    served = t["served_vs_official"]
    assert served["met"] is False and served["reason"].startswith("1.22 < 1.40")
    assert "flow_estimator 67% of the time" in served["reason"]  # where the served time goes
    assert t["served_int8_vs_official"]["met"] is None and "int8_cpu" in t["served_int8_vs_official"]["reason"]
    ceiling = t["estimator_vs_ceiling"]
    assert ceiling["met"] is False and ceiling["value"] == pytest.approx(0.5) and "library" in ceiling["reason"]
    table = peer.format_table(s)
    assert "MET" in table and "MISSED" in table and "served_int8  skipped: no build/onnx-full/int8_cpu" in table
    assert "load average 9" in table


def test_speed_without_parity_is_not_a_win():
    s = peer.summarize(_figures(parity={"library_vs_official": 0.2}))
    lib = s["targets"]["library_vs_official"]
    assert lib["met"] is False and "parity with the official output 2.0e-01" in lib["reason"]


def test_in_process_target_takes_the_faster_library_side_with_its_own_parity():
    fig = _figures()
    fig["sides"]["library_onnx"] = {"seconds": [4.0, 4.0, 5.0], "graph_seconds": {"flow_estimator": [2.0] * 3}}
    fig["parity"]["library_onnx_vs_official"] = 5e-4
    lib = peer.summarize(fig)["targets"]["library_vs_official"]
    assert lib["value"] == pytest.approx(11 / 4) and lib["met"] is True and lib["reason"] == "met"
    fig["parity"]["library_onnx_vs_official"] = 0.3  # faster but a different output: the side at parity counts
    lib = peer.summarize(fig)["targets"]["library_vs_official"]
    assert lib["value"] == pytest.approx(11 / 6) and lib["met"] is True
    fig["parity"]["library_vs_official"] = 0.2  # neither at parity: the fastest, reported with its parity
    lib = peer.summarize(fig)["targets"]["library_vs_official"]
    assert lib["met"] is False and "side library_onnx" in lib["reason"] and "3.0e-01" in lib["reason"]
    assert "library_onnx" in peer.format_table(peer.summarize(fig))


def test_no_official_side_leaves_the_speed_targets_unmeasured():
    fig = _figures(parity={})
    fig["sides"]["official"] = {"skipped": "no checkout given"}
    s = peer.summarize(fig)
    assert "vs_official" not in s["rows"]["library"]
    for key in ("library_vs_official", "served_vs_official"):
        assert s["targets"][key]["met"] is None and "official" in s["targets"][key]["reason"]
    assert s["targets"]["estimator_vs_ceiling"]["met"] is False  # measurable without the official code


def test_int8_needs_the_quality_bar():
    fig = _figures()
    fig["sides"]["served_int8"] = {"seconds": [5.0], "graph_seconds": {"flow_estimator": [2.0]}}
    fast_but_unchecked = peer.summarize(fig)["targets"]["served_int8_vs_official"]
    assert fast_but_unchecked["value"] == pytest.approx(2.2) and fast_but_unchecked["met"] is False
    assert "quality bar not checked" in fast_but_unchecked["reason"]
    assert peer.summarize({**fig, "int8_quality_ok": True})["targets"]["served_int8_vs_official"]["met"] is True


def test_rel_diff():
    a = np.array([1.0, -2.0, 0.5])
    assert peer.rel_diff(a, a) == 0.0
    assert peer.rel_diff(a + 0.02, a) == pytest.approx(0.01)
    assert peer.rel_diff(a[:2], a) == float("inf")  # different lengths never count as parity


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from cosyvoice_triton.models.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("peer") / "cosyvoice2-demo-tiny", size="tiny")


def _official_checkout() -> Path | None:
    path = os.environ.get("OFFICIAL")
    return Path(path) if path else None


def test_tiny_run_library_and_official(tiny_model, tmp_path, capsys):
    """The real harness on the tiny model: worker processes, interleaved rounds, FLOP counts, the table. The
    official side runs only with OFFICIAL=<checkout of FunAudioLLM/CosyVoice> (and its flow/HiFT dependencies in
    build/official-deps: `make bench-peer` installs them)."""
    official = _official_checkout()
    result = peer.run_peer_bench(tiny_model, official=official, rounds=1, threads=1, served=False,
                                 onnx_dir=tmp_path / "onnx", out_dir=tmp_path / "out")
    sides = result["sides"]
    onnx_side = sides["library_onnx"]  # the in-process onnxruntime path on the graphs exported for this model
    assert len(onnx_side["seconds"]) == 1 and set(onnx_side["graph_seconds"]) == set(peer.GRAPHS)
    assert result["parity"]["library_onnx_vs_library"] <= peer.PARITY_BAR
    assert len(sides["library"]["seconds"]) == 1 and sides["library"]["peak_rss_mb"] > 100
    assert sides["library"]["samples"] > 24000  # a 5 s source: several seconds of 24 kHz audio
    flops = result["flops"]
    assert all(flops[g] > 0 for g in peer.GRAPHS)  # counted by torch on the library's modules
    assert set(sides["library"]["graph_seconds"]) == set(peer.GRAPHS)
    assert sides["served"] == {"skipped": "--no-served"}
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["summary"]["targets"]["estimator_vs_ceiling"]["value"] > 0
    out = capsys.readouterr().out
    assert "targets:" in out and "library" in out
    if official is None:
        assert "skipped" in sides["official"]
        pytest.skip("official side not run: set OFFICIAL=<checkout of FunAudioLLM/CosyVoice> (make bench-peer "
                    "OFFICIAL=...) to compare against it")
    assert len(sides["official"]["seconds"]) == 1
    assert result["parity"]["library_vs_official"] <= peer.PARITY_BAR


def test_gpu_script_dry_run(tmp_path):
    """loadtest/gpu.sh DRY_RUN=1: the bare-GPU benchmark (voice conversion, then streaming TTS) at tiny dims on the
    CPU, one thread (never a GPU here)."""
    env = {**os.environ, "DRY_RUN": "1", "PY": sys.executable, "OUT_DIR": str(tmp_path / "gpu"),
           "OMP_NUM_THREADS": "1", "TIME_LIMIT_S": "1200"}
    proc = subprocess.run(["bash", str(ROOT / "loadtest" / "gpu.sh")], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu" / "result.json").read_text())
    rows = {(r["precision"], r["mode"]): r for r in result["rows"]}
    assert ("fp32", "sequential") in rows and ("fp32", "batched") in rows
    seq, bat = rows["fp32", "sequential"], rows["fp32", "batched"]
    assert seq["peak_gpu_mb"] is None  # CPU: no GPU figure is invented
    assert bat["mel_rel_rms_vs_fp32"] < 1e-4  # batching equal-length requests leaves the output as it was
    assert len(set([seq["max_latency_s"], seq["mean_latency_s"]])) == 2  # one at a time: later requests wait
    for (prec, _), r in rows.items():
        if prec != "fp32":
            assert 0 < r["mel_rel_rms_vs_fp32"] < 0.5  # reduced precision: a different, still close output
    report = (tmp_path / "gpu" / "report.md").read_text()
    assert "| fp32 | batched |" in report
    # streaming TTS: the LM, flow and HiFT at 1 and 2 requests at once, fp32 and bf16
    tts = result["tts"]
    assert "error" not in tts, tts.get("error")
    tts_rows = {(r["precision"], r["concurrency"]): r for r in tts["rows"]}
    assert set(tts_rows) == {("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)}, tts["skipped"]
    for (prec, n), r in tts_rows.items():
        assert r["lm_max_batch"] == n  # the requests were decoded together
        assert 0 < r["first_chunk_p50_s"] <= r["first_chunk_max_s"] <= r["total_max_s"]
        assert r["first_chunk_p50_s"] <= r["total_p50_s"]
        assert r["tokens"] == 2 * 25 and r["audio_s"] > 1.5  # --tts-seconds 2: 50 speech tokens, ~2 s of audio
        assert r["first_chunk_tokens"] < r["tokens"]  # the first chunk came before the last token
        parts = [r["prefill_p50_s"], r["first_hop_p50_s"], r["flow_p50_s"], r["hift_p50_s"]]
        assert all(x > 0 for x in parts) and sum(parts) <= r["first_chunk_max_s"] * 1.01 + 0.01
        assert r["rtf_p50"] > 0 and r["peak_gpu_mb"] is None
        assert f"| {prec} | {n} | {n} |" in report
    assert "## Streaming TTS" in report
