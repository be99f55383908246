"""The load test's TTS column (``loadtest/run.py --mode tts``): first-chunk figures, the chunk cross-check and
perf_analyzer's profile export on synthetic inputs; then one short live run against a real ``tritonserver`` (tiny
model) whose figures must come from the responses: the clients' request and chunk counts equal Triton's success
counters, the first chunk comes before the last, and the RTF and audio length follow from the raw records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, require_live_loadtest

from cosyvoice_triton.loadtest.callers import Outcome, make_converter, outcome
from cosyvoice_triton.loadtest.metrics import Sample, Snapshot
from cosyvoice_triton.loadtest.perf import parse_profile_export
from cosyvoice_triton.loadtest.recording import RequestRecord, RunConfig, RunResult
from cosyvoice_triton.loadtest.report import RunSummary, render_markdown, summarize_run, tts_table
from cosyvoice_triton.loadtest.workload import TTS_TEXTS, Workload, load_workload


def _snap(t, **success):
    return Snapshot(t, [Sample("nv_inference_request_success", {"model": m, "version": "1"}, float(v))
                        for m, v in success.items()])


def _stream_run(records, *, chunk_delta, column="tts_stream", model="cosyvoice_tts_stream"):
    cfg = RunConfig(column=column, protocol="grpc", url="u", http_url="h", metrics_url="m", workload="w", out="o",
                    check_model=model, chunk_model="hift_decoder")
    ok = sum(r.ok for r in records)
    return RunResult(cfg, records, _snap(100.0, **{model: 5, "hift_decoder": 40}),
                     _snap(120.0, **{model: 5 + ok, "hift_decoder": 40 + chunk_delta}), locust_requests=len(records),
                     locust_failures=len(records) - ok, target_reached=True)


def test_summary_first_chunk_percentiles_rtf_and_chunk_check():
    recs = [RequestRecord(100.0 + i, 2.0 + i, 4.0, True, "", 0.5 + 0.1 * i, 3) for i in range(5)]
    recs.append(RequestRecord(106.0, 1.0, 0.0, False, "boom", None, 0))
    s = summarize_run(_stream_run(recs, chunk_delta=15))
    assert s.first_p50_ms == pytest.approx(700.0) and s.first_mean_ms == pytest.approx(700.0)
    assert s.first_p95_ms == pytest.approx(np.percentile([500, 600, 700, 800, 900], 95))
    assert s.rtf == pytest.approx(np.mean([(2.0 + i) / 4.0 for i in range(5)]))
    assert s.chunks_per_request == 3.0 and s.failures == 1
    assert s.chunk_check == {"model": "hift_decoder", "chunks_received": 15, "triton_delta": 15.0, "passed": True}
    assert s.check["passed"]
    # one chunk the server produced but no client received: a mismatch
    assert not summarize_run(_stream_run(recs, chunk_delta=16)).chunk_check["passed"]


def test_offline_runs_have_no_first_chunk_and_no_chunk_check():
    cfg = RunConfig(column="tts", protocol="grpc", url="u", http_url="h", metrics_url="m", workload="w", out="o",
                    users=1, check_model="cosyvoice_tts")
    run = RunResult(cfg, [RequestRecord(1.0, 2.0, 3.0, True, "", None, 1)], _snap(0.0, cosyvoice_tts=0),
                    _snap(5.0, cosyvoice_tts=1), locust_requests=1, target_reached=True)
    s = summarize_run(run)
    assert math.isnan(s.first_p50_ms) and s.chunk_check == {} and s.check["passed"]
    table = tts_table([s])
    assert "offline TTS (cosyvoice_tts) | 1 | 1 (0) | - | 2,000 / 2,000 / 2,000 | 0.67 | 3.00 | 1.0 | 0.333 | n/a |" \
        in table


def test_records_round_trip_with_first_chunk_and_old_rows(tmp_path):
    run = _stream_run([RequestRecord(1.0, 2.0, 3.0, True, "", 0.25, 4),
                       RequestRecord(2.0, 1.0, 0.0, False, "x", None, 0)], chunk_delta=4)
    back = RunResult.load(run.save(tmp_path / "r.json"))
    assert back.records == run.records and back.config.chunk_model == "hift_decoder"
    assert back.records[1].first_chunk_s is None and back.records[1].chunks == 0
    old = run.to_json()
    old["records"] = [[1.0, 2.0, 3.0, True, ""]]  # written before the TTS column
    rec = RunResult.from_json(old).records[0]
    assert rec.first_chunk_s is None and rec.chunks == 0


def test_outcome_of_a_plain_float_and_unknown_columns():
    assert outcome(2.5) == Outcome(2.5) and outcome(2.5).first_chunk_s is None
    with pytest.raises(ValueError, match="column"):
        make_converter("nope", "grpc", "x:1")
    with pytest.raises(ValueError, match="gRPC"):
        make_converter("tts_stream", "http", "x:1")


def test_profile_export_first_response_inside_the_windows():
    s = 10**9
    doc = {"experiments": [{"window_boundaries": [10 * s, 20 * s, 30 * s], "requests": [
        {"timestamp": 5 * s, "response_timestamps": [6 * s]},  # before the windows: left out
        {"timestamp": 11 * s, "response_timestamps": [12 * s, 13 * s, 15 * s]},
        {"timestamp": 21 * s, "response_timestamps": [int(24.5 * s), 27 * s]},
        {"timestamp": 25 * s, "response_timestamps": []},  # no answer: left out
    ]}]}
    r = parse_profile_export(doc)
    assert r["requests"] == 2 and r["responses_per_request"] == 2.5
    assert r["first_mean_ms"] == pytest.approx(2250.0) and r["mean_ms"] == pytest.approx(5000.0)
    with pytest.raises(ValueError):
        parse_profile_export({"experiments": [{"requests": []}]})


def test_workload_texts_round_trip_and_old_files(tmp_path):
    wav = np.zeros(1600, np.float32)
    wl = Workload((wav,), (16000,), wav, 16000, texts=("one", "two"), prompt_text="p")
    back = load_workload(wl.save(tmp_path / "w.npz"))
    assert back.texts == ("one", "two") and back.item(3).text == "two" and back.item(0).prompt_text == "p"
    np.savez(tmp_path / "old.npz", source_rates=np.array([16000]), prompt=wav, prompt_sr=np.array(16000),
             descriptions=np.array(["d"]), source_0=wav)
    assert load_workload(tmp_path / "old.npz").texts == TTS_TEXTS


# --------------------------------------------------------------------------------------------- live run


@pytest.mark.timeout(1800)  # a server start and 9 short Locust runs: minutes, many more on a shared loaded machine
def test_live_tts_column_figures_come_from_the_responses(serving_assets, tmp_path):
    """Streaming TTS, offline TTS and streaming VC at concurrency 1 and 2 (1 and 2 measured requests), and
    perf_analyzer's streaming mode at concurrency 1: every figure is checked against the server's counters or the
    raw records."""
    require_live_loadtest()
    from cosyvoice_triton.loadtest.perf import find_perf_analyzer
    from cosyvoice_triton.loadtest.runner import Options, run

    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    out = tmp_path / "loadtest"
    texts = ("Hello there, this is a test.", "A second and slightly longer sentence to speak.")
    Workload((src[: int(2.5 * ssr)],), (ssr,), prm[: int(1.5 * psr)], psr, texts=texts,
             prompt_text="the prompt says hello").save(out / "workload.npz")
    opts = Options(name="smoke-tts", mode="tts", model_dir=str(serving_assets["model_dir"]),
                   onnx_dir=str(serving_assets["onnx_dir"]), out_dir=str(out), tts_concurrency=(1, 2),
                   tts_requests=1, perf_concurrency=(1,), precision="fp32", max_run_s=2 * PATIENCE_S,
                   integrated_tunables={"max_queue_delay_us": 5000})
    report = run(opts)
    runs = {(r["column"], r["users"]): r for r in report["runs"]}
    assert set(runs) == {(c, u) for c in ("tts_stream", "tts", "vc_stream") for u in (1, 2)}
    for (column, users), r in runs.items():
        assert r["failures"] == 0, r["errors"]
        assert r["requests"] >= users
        # every successful request is one request of the public model in Triton's counters
        assert r["check"]["passed"] and r["check"]["triton_delta"] == r["requests"], r["check"]
        raw = RunResult.load(out / "tts" / f"result_{column}_u{users}.json")
        ok = [x for x in raw.records if x.ok]
        assert len(ok) == r["requests"]
        # the RTF and the audio length follow from the raw records
        assert r["rtf"] == pytest.approx(np.mean([x.latency_s / x.audio_s for x in ok]))
        assert r["mean_audio_s"] == pytest.approx(np.mean([x.audio_s for x in ok]))
        # the audio is whole 24 kHz samples, a few seconds of it
        assert all(0.2 < x.audio_s < 30 and abs(x.audio_s * 24000 - round(x.audio_s * 24000)) < 1e-6 for x in ok)
        if column == "tts":
            assert all(x.chunks == 1 and x.first_chunk_s is None for x in ok)
            continue
        # streams: the first chunk arrived before the last one, and the chunks the clients counted are exactly the
        # hift_decoder calls the server made in the window (one per chunk)
        assert all(0 < x.first_chunk_s < x.latency_s for x in ok)
        assert all(x.chunks >= 2 for x in ok), [x.chunks for x in ok]
        assert r["chunk_check"]["passed"], r["chunk_check"]
        assert r["chunk_check"]["chunks_received"] == sum(x.chunks for x in ok)
        assert r["first_p50_ms"] == pytest.approx(np.percentile([x.first_chunk_s for x in ok], 50) * 1000)
        assert r["first_p50_ms"] < r["p50_ms"]
    # the same text gives the same audio length whether streamed or not (same seed, same LM tokens)
    stream = RunResult.load(out / "tts" / "result_tts_stream_u1.json").records
    offline = RunResult.load(out / "tts" / "result_tts_u1.json").records
    assert {round(x.audio_s, 4) for x in stream} & {round(x.audio_s, 4) for x in offline}
    md = (out / "report.md").read_text()
    assert "## Streaming and offline latency (gRPC)" in md and "MISMATCH" not in md
    assert (out / "first_chunk.png").is_file()
    perf = report["perf_analyzer"]
    assert [p["concurrency"] for p in perf] == [1]
    if find_perf_analyzer() is not None:
        for p in perf:
            assert p["first_p50_ms"] > 0 and p["first_mean_ms"] <= p["mean_ms"], p
            assert p["responses_per_request"] >= 2 and p["throughput"] > 0, p
    assert json.loads((out / "report.json").read_text())["mode"] == "tts"


def test_tts_mode_options_from_the_command_line():
    from cosyvoice_triton.loadtest.runner import options_from_args, parser

    opts = options_from_args(parser().parse_args(["--mode", "tts", "--tts-concurrency", "1,4",
                                                  "--tts-columns", "tts_stream,vc_stream"]))
    assert opts.mode == "tts" and opts.tts_concurrency == (1, 4) and opts.out_dir == "build/loadtest/tiny-tts"
    assert opts.tts_columns == ("tts_stream", "vc_stream")
    with pytest.raises(SystemExit):
        parser().parse_args(["--tts-columns", "tts_stream,nope"])
    summary = RunSummary("tts_stream", "grpc", 1, 1, 0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
                         first_p50_ms=0.5)
    md = render_markdown({"mode": "tts", "runs": [summary.to_json()]})
    assert md.startswith("# Load test: the TTS column") and "streaming TTS (cosyvoice_tts_stream) | 1 |" in md
