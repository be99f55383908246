"""perf_analyzer's runner without a server: a stand-in binary answers as perf_analyzer 2.51 does."""

import os
import stat

import pytest

from cosyvoice_triton.loadtest import perf

CSV = ("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
       "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
       "1,0.75,200,366355,2,2001,2365367,5262,4,2911976,3440424,3608385,3610730\n")


def stand_in(tmp_path, fail_times: int):
    """A perf_analyzer that ends ``fail_times`` runs with the statistics-lookup message and no CSV, then writes the
    CSV given with ``-f``; every command line it got is appended to ``calls``."""
    calls = tmp_path / "calls"
    script = tmp_path / "perf_analyzer"
    script.write_text(f"""#!/bin/sh
echo "$@" >> {calls}
n=$(wc -l < {calls})
if [ "$n" -le {fail_times} ]; then echo "Request concurrency: 1"; echo "{perf.VERSION_LOOKUP_FAILED}"; exit 99; fi
while [ $# -gt 0 ]; do if [ "$1" = "-f" ]; then printf '%s' '{CSV}' > "$2"; fi; shift; done
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, calls


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setattr(perf, "library_dir", lambda out: os.makedirs(out, exist_ok=True) or out)
    monkeypatch.setattr(perf, "ready_version", lambda url, protocol, model: "3")

    def run(fail_times: int, **kw):
        script, calls = stand_in(tmp_path, fail_times)
        monkeypatch.setattr(perf, "find_perf_analyzer", lambda: script)
        r = perf.run_perf_analyzer("localhost:1", "grpc", 1, tmp_path / "data.json", tmp_path / "work", **kw)
        return r, calls.read_text().splitlines()

    return run


def test_a_lookup_failure_is_tried_again(runner):
    r, calls = runner(fail_times=1)
    assert len(calls) == 2 and r["retried"] == 1
    assert r["throughput"] == 0.75 and r["p95_ms"] == pytest.approx(3608.385)


def test_the_ready_version_is_pinned(runner):
    _, calls = runner(fail_times=0)
    args = calls[0].split()
    assert args[args.index("-x") + 1] == "3"
    _, calls = runner(fail_times=0, model_version="7")
    assert calls[-1].split()[calls[-1].split().index("-x") + 1] == "7"


def test_attempts_are_bounded_and_the_reason_kept(runner):
    r, calls = runner(fail_times=5, attempts=2)
    assert len(calls) == 2
    assert "throughput" not in r and perf.VERSION_LOOKUP_FAILED in r["note"]
