"""``bench-preprocess`` (cosyvoice_triton.bench.vc.run_preprocess_bench): runs, reports every variant and the trim."""

from __future__ import annotations

import json

import pytest

from cosyvoice_triton.__main__ import main
from cosyvoice_triton.bench.vc import PREPROCESS_VARIANTS, run_preprocess_bench


def test_bench_preprocess_reports_each_variant_and_the_trim(tmp_path, capsys):
    pytest.importorskip("silero_vad")
    out = run_preprocess_bench(repeats=1, warmup=0, out_json=tmp_path / "b.json")
    assert set(out["variants"]) == set(PREPROCESS_VARIANTS)
    assert all(v["median_ms"] > 0 for v in out["variants"].values())
    for name in ("source", "prompt"):
        t = out["vad_trimmed"][name]
        assert min(t["lead"], t["tail"]) >= 0 and t["lead"] + t["tail"] < t["samples"]
    assert json.loads((tmp_path / "b.json").read_text())["vad_trimmed"] == out["vad_trimmed"]
    assert "+vad+denoise" in capsys.readouterr().out
    with pytest.raises(ValueError, match="repeats"):
        run_preprocess_bench(repeats=0, out_json=None)


def test_cli_has_bench_preprocess(capsys):
    with pytest.raises(SystemExit):
        main(["bench-preprocess", "--help"])
    assert "--repeats" in capsys.readouterr().out
