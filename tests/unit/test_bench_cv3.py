"""bench-cv3 (CosyVoice3, the official code vs the library): the table logic on made-up figures, the draw injection
that gives both sides' LMs the same uniforms, and a real run on the CosyVoice3 demo folder (the library side; the
official side only with OFFICIAL=<checkout> and build/official-deps3). Speed is never asserted."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_triton.bench import cosyvoice3 as bench
from cosyvoice_triton.bench.official import injected_multinomial

ROOT = Path(__file__).resolve().parents[2]


def _run(seconds, estimator, *, first=None, samples=48000, tokens=None, calls=10) -> dict:
    return {"seconds": seconds, "first_chunk_s": first, "estimator_s": estimator, "hift_s": 0.5, "samples": samples,
            "tokens": tokens, "chunks": 1 if first is None else 3, "estimator_calls": calls, "estimator_frames": []}


def test_summary_medians_speedups_share_and_gflops():
    result = {"cases": ["token2wav", "tts_first_chunk"], "ceiling_gflops": [100.0, 80.0],
              "flops": {"token2wav": 400e9, "tts_first_chunk": 800e9},
              "parity": {"token2wav": 2e-6},
              "runs": {"token2wav": {"official": [_run(12.0, 8.0), _run(10.0, 6.0), _run(11.0, 7.0)],
                                     "library": [_run(5.0, 4.0), _run(6.0, 5.0), _run(7.0, 6.0)]},
                       "tts_first_chunk": {"official": [_run(20.0, 9.0, first=3.0, tokens=120)],
                                           "library": [_run(10.0, 8.0, first=1.5, tokens=120)]}}}
    s = bench.summarize(result)
    assert s["ceiling_gflops"] == 100.0  # the better of the two ceilings
    t2w = s["cases"]["token2wav"]
    assert t2w["official"]["seconds"] == 11.0 and t2w["library"]["seconds"] == 6.0
    assert t2w["speedup"] == pytest.approx(11.0 / 6.0)
    assert t2w["library"]["estimator_share"] == pytest.approx(5.0 / 6.0)
    assert t2w["library"]["estimator_gflops"] == pytest.approx(400e9 / 5.0 / 1e9)
    assert t2w["library"]["estimator_vs_ceiling"] == pytest.approx(0.8)
    assert t2w["library"]["rtf"] == pytest.approx(6.0 / 2.0)  # 48,000 samples at 24 kHz: 2 s
    assert t2w["waveform_rel_diff"] == 2e-6
    fc = s["cases"]["tts_first_chunk"]
    assert fc["first_chunk_speedup"] == pytest.approx(2.0) and fc["library"]["tokens"] == 120
    assert fc["waveform_rel_diff"] is None  # not compared: no figure rather than a made-up one
    table = bench.format_table(s, {"commit": "abc1234", "machine": "a CPU", "threads": 2, "rounds": 3})
    assert "abc1234" in table and "a CPU" in table
    assert "x1.83" in table and "first chunk x2.00" in table and "2.0e-06" in table


def test_a_side_without_runs_is_left_out():
    result = {"cases": ["tts"], "ceiling_gflops": [100.0], "flops": {}, "parity": {},
              "runs": {"tts": {"library": [_run(4.0, 2.0, tokens=50)]}}}
    row = bench.summarize(result)["cases"]["tts"]
    assert set(row) == {"library"}  # no official side: no speed-up
    assert row["library"]["estimator_gflops"] is None  # no FLOP count: no rate


def test_injected_multinomial_draws_by_the_inverse_cdf_and_restores_torch():
    probs = torch.tensor([0.1, 0.2, 0.7])
    method, fn = torch.Tensor.multinomial, torch.multinomial
    with injected_multinomial(iter([0.05, 0.25, 0.95])):
        assert int(probs.multinomial(1, replacement=True)) == 0
        assert int(torch.multinomial(probs, 1)) == 1
        assert int(probs.multinomial(1)) == 2
        with pytest.raises(RuntimeError, match="one sample"):
            probs.multinomial(2)
    assert torch.Tensor.multinomial is method and torch.multinomial is fn


def test_lm_draws_are_fixed_uniforms():
    a, b = bench.lm_draws(), bench.lm_draws()
    assert a == b and len(a) == bench.MAX_DRAWS and min(a) >= 0.0 and max(a) < 1.0


def test_tiny_run(cv3_demo_dir, tmp_path, capsys):
    """The real harness on the CosyVoice3 demo folder: worker processes, every case, the hooks on the DiT and the
    vocoder, FLOP counts, the table. The official side runs only with OFFICIAL=<checkout of FunAudioLLM/CosyVoice>
    and its CosyVoice3 dependencies in build/official-deps3 (`make bench-cv3 OFFICIAL=...` installs them); then
    every case's waveform must equal the official one and the LMs must decode the same tokens."""
    official = os.environ.get("OFFICIAL")
    deps = ROOT / "build" / "official-deps3"
    result = bench.run_bench(cv3_demo_dir, official=official, official_deps=deps, rounds=1, threads=1,
                             out_dir=tmp_path / "out")
    s = result["summary"]["cases"]
    for case in bench.CASES:
        lib = s[case]["library"]
        assert lib["seconds"] > 0 and lib["estimator_s"] > 0 and lib["hift_s"] > 0 and lib["audio_s"] > 0
        assert 0 < lib["estimator_share"] < 1
        assert lib["estimator_calls"] % 10 == 0  # 10 Euler steps per flow call (the CFG pair in one batch)
        assert lib["estimator_gflops"] > 0  # counted by torch at the frames the case ran
    assert s["token2wav"]["library"]["audio_s"] == pytest.approx(5.0, abs=0.05)  # the 5 s source
    assert s["vc_first_chunk"]["library"]["chunks"] > 1 and s["vc_first_chunk"]["library"]["first_chunk_s"] > 0
    assert s["tts"]["library"]["tokens"] > 0
    streamed = np.load(tmp_path / "out" / "library_vc_first_chunk.npy")
    whole = np.load(tmp_path / "out" / "library_token2wav.npy")
    assert len(streamed) == len(whole)
    out = capsys.readouterr().out
    assert "| token2wav | library |" in out
    assert (tmp_path / "out" / "report.md").is_file()
    if not official:
        assert "official side skipped" in " ".join(result["notes"])
        pytest.skip("official side not run: set OFFICIAL=<checkout of FunAudioLLM/CosyVoice> (make bench-cv3 "
                    "OFFICIAL=... installs its dependencies) to compare against it")
    for case in bench.CASES:
        assert s[case]["waveform_rel_diff"] <= 1e-3, case
        assert s[case]["official"]["tokens"] == s[case]["library"]["tokens"], case


def test_tiny_run_with_an_int8_flow(cv3_demo_dir, tmp_path, capsys):
    """``--flow-precision int8``: the library's flow in INT8, its token2wav mel compared with the fp32 flow's
    against the quality report's bar, the precision named in the table."""
    result = bench.run_bench(cv3_demo_dir, cases=("token2wav",), rounds=1, threads=1, out_dir=tmp_path / "out",
                             flow_precision="int8")
    q = result["quality"]
    assert 0 < q["mel_rel_rms"] <= 0.05 and q["mel_db"] <= 0.5 and q["frames"] > 0
    assert set(q["flow_s"]) == {"fp32", "int8"} and min(q["flow_s"].values()) > 0
    assert any("within the quality report's flow bar" in n for n in result["notes"])
    assert "flow int8" in capsys.readouterr().out
    fp32 = bench.run_bench(cv3_demo_dir, cases=("token2wav",), rounds=1, threads=1, out_dir=tmp_path / "fp32")
    assert "quality" not in fp32
    assert result["flops"]["token2wav"] == fp32["flops"]["token2wav"] > 0  # counted on an fp32 DiT


def test_the_live_bench_times_both_paths_per_chunk(cv3_demo_dir, tmp_path):
    """``bench-live-cv3`` on the tiny demo folder: every chunk of both paths timed, the same chunks and audio on
    both (25-token chunks of the same source), the report written."""
    from cosyvoice_triton.bench.live_vc3 import run_bench

    result = run_bench(cv3_demo_dir, seconds=4.0, threads=1, out_dir=tmp_path)
    live, recompute = result["paths"]["live"], result["paths"]["recompute"]
    assert live["chunks"] == len(live["times_s"]) >= 4 and recompute["chunks"] == len(recompute["times_s"])
    assert abs(live["audio_s"] - 4.0) < 1e-3 and abs(recompute["audio_s"] - 4.0) < 1e-3
    assert all(t > 0 for t in live["times_s"] + recompute["times_s"]) and live["rtf_total"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "| live |" in report and "| recompute |" in report and result["meta"]["load_end"]


def test_the_graph_bench_times_both_runtimes_on_padded_batches(cv3_demo_dir, cv3_onnx_dir, tmp_path):
    from cosyvoice_triton.bench.cv3_graphs import format_report, run_bench, step_inputs

    feeds, lengths = step_inputs(2, 60)
    assert lengths == [60, 53] and feeds["x"].shape == (4, 80, 60)
    assert feeds["mask"][1, 0, 53:].sum() == 0 and feeds["mask"][3, 0, :53].all()  # row 3: utterance 2, uncond
    assert not feeds["mu"][2:].any() and not feeds["spks"][2:].any()
    result = run_bench(cv3_demo_dir, onnx_dir=cv3_onnx_dir, frames=60, utterances=(1, 2), threads=1, rounds=1,
                       out_dir=tmp_path)
    assert [r["utterances"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["torch_s"] > 0 and r["ort_s"] > 0 and r["rel_diff"] < 1e-4
    report = (tmp_path / "report.md").read_text()
    assert report.strip() == format_report(result) and "| 2 (4) |" in report
