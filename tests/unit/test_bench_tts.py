"""``make bench-tts`` on a tiny demo folder: it runs, prints its table and writes every figure it promises."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from cosyvoice_triton.bench import tts as bench_tts
from cosyvoice_triton.models.demo import write_demo_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("bench_tts") / "tiny", size="tiny", seed=0)


def _run(demo_dir, tmp_path, *extra):
    out = tmp_path / "bench.json"
    rc = bench_tts.main(["--model-dir", str(demo_dir), "--decode-tokens", "6", "--batches", "1,3",
                         "--utterance-s", "0.4", "--repeats", "1", "--out-json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_tts_figures(demo_dir, tmp_path, capsys):
    r = _run(demo_dir, tmp_path)
    text = capsys.readouterr().out
    assert "decode tokens/s, batch 3" in text and "official: skipped" in text
    decode = r["project"]["decode"]
    # min_len = max_len = 6 tokens per request: the first comes with the prefill, 5 are timed per request
    assert {k: v["tokens"] for k, v in decode.items()} == {"1": 5, "3": 15}
    assert all(v["tokens_per_s"] > 0 for v in decode.values())
    assert r["project"]["prefill_s"] > 0 and r["project"]["ttft_s"] > 0
    assert r["rtf"]["tokens"] == 10 and r["rtf"]["audio_s"] == pytest.approx(0.4)
    assert r["rtf"]["rtf"] > 0 and r["official"] is None
    # the int8 LM's rows, its distance from fp32 and the targets, met or missed
    int8 = r["int8"]
    assert {k: v["tokens"] for k, v in int8["decode"].items()} == {"1": 5, "3": 15}
    q = int8["quality"]
    assert q["steps"] == 7 and 0 <= q["mean_tv"] <= q["max_tv"] <= 1 and 0 <= q["same_token"] <= 1
    assert isinstance(q["meets_bar"], bool)
    assert "int8 LM: decode tokens/s, batch 3" in text
    assert re.search(r"target int8 batch-1 decode >= 25 tokens/s within the bar: (met|missed)", text)
    assert re.search(r"target int8 batch 3 >= 3.0x batch 1: (met|missed)", text)
    assert re.search(r"target fp32 batch-1 decode >= 25 tokens/s: (met|missed)", text)
    # the first streamed chunks: a registered speaker's TTS (its state cached after the cold call) and VC
    fc = r["first_chunk"]
    for kind in ("tts", "vc"):
        best, cold = fc[kind]["best"], fc[kind]["cold"]
        assert best["first_chunk_s"] > 0 and best["samples"] > 0 and cold["first_chunk_s"] > 0
        assert sum(best["stages_s"].values()) <= best["first_chunk_s"] + 1e-3
    assert fc["tts"]["best"]["first_hop_tokens"] == 28  # the 3 s prompt's 75 tokens + 25 + 3 look-ahead
    assert "speaker_state" in fc["tts"]["cold"]["stages_s"] and fc["tts"]["best"]["prefill_s"] > 0
    for kind in ("streaming TTS", "streaming VC"):
        assert re.search(rf"target {kind} first chunk <= 1.5 s: (met|missed) \(\d+\.\d\d s\)", text)


def test_bench_tts_fp32_only(demo_dir, tmp_path, capsys):
    r = _run(demo_dir, tmp_path, "--lm-precisions", "fp32", "--utterance-s", "0", "--first-chunk-rounds", "0")
    assert r["int8"] is None and r["first_chunk"] is None
    out = capsys.readouterr().out
    assert "int8 LM" not in out and "first chunk" not in out


@pytest.mark.skipif(not os.environ.get("COSYVOICE_OFFICIAL"),
                    reason="set COSYVOICE_OFFICIAL to a checkout of the official CosyVoice code")
def test_bench_tts_next_to_official(demo_dir, tmp_path):
    r = _run(demo_dir, tmp_path, "--official", str(Path(os.environ["COSYVOICE_OFFICIAL"])))
    assert r["official"]["decode"]["1"]["tokens"] == 5
