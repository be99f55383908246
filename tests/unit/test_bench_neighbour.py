"""``cosyvoice-triton bench-neighbour`` at its smallest: it runs, reports every field it promises, and stops its busy
neighbours on every way out. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from cosyvoice_triton.bench import neighbour
from cosyvoice_triton.models.demo import write_demo_model


def test_a_short_run_reports_each_setting(tmp_path, capsys):
    d = write_demo_model(tmp_path / "tiny", size="tiny", seed=0)
    out = tmp_path / "r.json"
    rc = neighbour.main(["--model-dir", str(d), "--neighbours", "1", "--rounds", "2", "--settle-s", "0",
                         "--settings", "library,torch-default-nospin", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert r["neighbours"] == 1 and r["rounds"] == 2 and r["commit"] and r["cpu"] and r["cpus"] >= 1
    assert 1 <= r["cpus_allowed"] <= r["cpus"]
    for key in ("load_before", "load_settled", "load_end"):
        assert len(r[key]) == 3 and all(x >= 0 for x in r[key])
    assert list(r["settings"]) == ["library", "torch-default-nospin"]
    for s in r["settings"].values():
        assert s["threads"] >= 1 and isinstance(s["spinning"], bool) and s["reason"]
        assert len(s["rounds_s"]) == 2 and s["cold_s"] > 0 and s["min_s"] <= s["median_s"]
    nospin = r["settings"]["torch-default-nospin"]
    assert not nospin["spinning"] and "OMP_WAIT_POLICY=PASSIVE" in nospin["openmp_idle"]
    lib = r["settings"]["library"]
    assert lib["openmp_idle"].startswith("spin" if lib["spinning"] else "sleep")
    assert "auto: one per free core" in lib["reason"]
    assert "first streamed TTS chunk beside 1 busy neighbour(s)" in text and r["commit"] in text
    assert "torch-default-nospin" in text and r["cpu"] in text


class _FailingWorker:
    def __init__(self, name, model_dir):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def read(self, timeout_s):
        raise RuntimeError("the worker exited before reporting")


def test_the_neighbours_and_workers_stop_when_a_worker_fails(monkeypatch, tmp_path):
    started = []
    real = subprocess.Popen

    def popen(*args, **kw):
        started.append(real(*args, **kw))
        return started[-1]

    monkeypatch.setattr(neighbour.subprocess, "Popen", popen)
    monkeypatch.setattr(neighbour, "_Worker", _FailingWorker)
    with pytest.raises(RuntimeError, match="before reporting"):
        neighbour.run(tmp_path, neighbours=2, rounds=1, settings=("library",), settle_s=0)
    assert len(started) >= 3  # two neighbours and the worker (and git, for the commit)
    assert all(p.poll() is not None for p in started)


def test_a_neighbour_leaves_when_the_bench_is_killed():
    """A bench killed outright (SIGKILL: no finally runs) leaves no busy process behind."""
    code = ("import os, subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', {neighbour.NEIGHBOUR!r}, str(os.getpid())], "
            "stdout=subprocess.DEVNULL)\n"
            "print(p.pid, flush=True)\n")
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             check=True).stdout)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
