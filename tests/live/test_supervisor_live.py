"""The supervisor against a live ``tritonserver`` with a one-model repository (a Python echo model, two instances):

* the shared-memory regions (``/dev/shm``) of a killed stub and of a killed server (SIGKILL to its whole process
  group: nothing of it is left to clean up) are removed once the supervisor has brought them back, while those of a
  second, unrelated server on the same machine stay, and that server keeps serving;
* a model loaded again through Triton's API (what a rollout does) is not taken for a dead stub;
* the restart budget of the CLI (``--max-restarts`` within ``--restart-window``): restarted while within it, exit
  code 1 once past it; readiness refused while the server restarts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import PATIENCE_S, PATIENT_TEST_S, PROBE_TIMEOUT_S, ROOT, wait_until

from cosyvoice_triton.serving.launch.server import (
    SHM_DIR,
    TritonNotInstalled,
    TritonServer,
    find_installation,
    free_ports,
)
from cosyvoice_triton.serving.launch.supervisor import Supervisor

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)

CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""
MODEL = """import triton_python_backend_utils as pb


class TritonPythonModel:
    def execute(self, requests):
        return [pb.InferenceResponse([pb.Tensor("y", pb.get_input_tensor_by_name(r, "x").as_numpy() * 2)])
                for r in requests]
"""


@pytest.fixture(scope="module", autouse=True)
def _installed():
    try:
        find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))


def _repo(root: Path) -> Path:
    (root / "repo" / "echo" / "1").mkdir(parents=True)
    (root / "repo" / "echo" / "config.pbtxt").write_text(CONFIG)
    (root / "repo" / "echo" / "1" / "model.py").write_text(MODEL)
    return root / "repo"


def _server(root: Path) -> TritonServer:
    # the work dir must not be named "triton": the test's folder would shadow the `triton` package in the stubs
    return TritonServer(_repo(root), work_dir=root / "work", model_control="explicit", load_models=["*"],
                        exit_timeout=5, probe_timeout=PROBE_TIMEOUT_S, restricted_apis=())


def _echo(server: TritonServer) -> bool:
    import tritonclient.http as http

    x = np.arange(5, dtype=np.float32)
    with http.InferenceServerClient(server.http_url, network_timeout=PATIENCE_S) as client:
        inp = http.InferInput("x", [5], "FP32")
        inp.set_data_from_numpy(x)
        y = client.infer("echo", [inp]).as_numpy("y")
    return bool(np.array_equal(y, 2 * x))


def _regions(server: TritonServer) -> set[Path]:
    stubs = [s for s in server.python_stubs() if s.alive]
    assert stubs and all(s.shm_region for s in stubs), stubs
    return {SHM_DIR / s.shm_region for s in stubs}


def _kinds(sup: Supervisor) -> list[str]:
    return [e.kind for e in sup.events]


def test_dead_stubs_and_a_dead_server_leave_no_shared_memory_and_another_servers_is_untouched(tmp_path):
    pytest.importorskip("tritonclient.http")
    other = _server(tmp_path / "other").start(timeout=PATIENCE_S)
    try:
        others = _regions(other)
        assert len(others) == 2 and all(p.exists() for p in others)
        sup = Supervisor(_server(tmp_path / "own"), interval=0.25, backoff=0.5, max_backoff=1.0, max_restarts=3,
                         start_timeout=PATIENCE_S, warmup=None)
        with sup:
            server = sup.server
            first = _regions(server)
            old = {s.pid for s in server.python_stubs()}
            assert not first & others
            victim = next(s for s in server.python_stubs() if s.alive)
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: "reloaded" in _kinds(sup), "the model of the killed stub reloaded")
            wait_until(lambda: not old & {s.pid for s in server.python_stubs()}, "the replaced stubs gone")
            wait_until(lambda: not any(p.exists() for p in first), "the regions of the replaced stubs removed")
            second = _regions(server)
            assert all(p.exists() for p in second) and not second & first and _echo(server)

            pgid = server.process.pid
            os.killpg(pgid, signal.SIGKILL)  # the server and every stub: nothing of it cleans up
            wait_until(lambda: not any(p.pid for p in psutil.process_iter() if _in_group(p, pgid)),
                       "the killed group gone")
            left = [p for p in second if p.exists()]
            assert left, "a killed group left no region: the test proves nothing"
            wait_until(lambda: "restarted" in _kinds(sup) and server.is_ready(), "the server restarted")
            wait_until(lambda: not any(p.exists() for p in second), "the regions of the killed server removed")
            removed = [e for e in sup.events if e.kind == "shm-removed"]
            assert all(p.name in " ".join(e.detail for e in removed) for p in left), removed
            assert _echo(server) and all(p.exists() for p in _regions(server))
        assert all(p.exists() for p in others), "the unrelated server's regions were touched"
        assert other.is_ready() and _echo(other) and _regions(other) == others
    finally:
        other.stop()


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


def test_a_model_loaded_again_through_the_api_is_not_taken_for_a_dead_stub(tmp_path):
    pytest.importorskip("tritonclient.http")
    with _server(tmp_path) as server:
        sup = Supervisor(server, interval=0.25, warmup=None)
        sup._remember_stubs()
        before = {s.pid for s in server.python_stubs() if s.alive}
        server.load_model("echo", timeout=PATIENCE_S)  # new instances replace the old ones (a rollout's reload)
        wait_until(lambda: not before & {s.pid for s in server.python_stubs()}, "the old stubs stopped by Triton")
        for _ in range(3):
            sup.check()
        assert "stub-died" not in _kinds(sup), sup.events
        after = {s.pid for s in server.python_stubs() if s.alive}
        assert set(sup._stubs) == after and len(after) == 2  # the new stubs are watched
        os.kill(next(iter(after)), signal.SIGKILL)  # and a death among them is seen
        wait_until(lambda: sup.check() or "reloaded" in _kinds(sup), "the killed new stub's model reloaded")
        # the regions of the replaced stubs may be removed at any check (once no process maps them): only the
        # kinds about stubs and models are ordered
        kinds = [k for k in _kinds(sup) if k != "shm-removed"]
        assert kinds[0] == "stub-died" and _echo(server), sup.events


def _tritonserver(cli: psutil.Process) -> psutil.Process | None:
    for child in cli.children():
        try:
            if child.name().startswith("tritonserver") and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.Error:
            continue
    return None


def test_the_cli_restarts_within_its_budget_then_gives_up_with_exit_code_1(tmp_path):
    repo = _repo(tmp_path)
    http, grpc, metrics = free_ports(3)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = subprocess.Popen(
        [sys.executable, "-m", "cosyvoice_triton.serving.launch.supervisor", "--model-repository", str(repo),
         "--work-dir", str(tmp_path / "work"), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics), "--interval", "0.25", "--max-restarts", "1", "--restart-window", "3600",
         "--no-warmup"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    probe = TritonServer(repo, work_dir=tmp_path / "probe", http_port=http, probe_timeout=PROBE_TIMEOUT_S)
    try:
        proc = psutil.Process(cli.pid)
        warm = tmp_path / "work" / "warm"
        wait_until(lambda: warm.exists() and probe.is_ready(), "the supervised server ready")
        first = _tritonserver(proc)
        assert first is not None and warm.read_text().startswith("no warm-up")
        first.kill()
        # the port refuses while the server restarts: readiness is never a stale 200 between exit and restart
        wait_until(lambda: not probe.is_ready(), "readiness false after the server died")
        second = wait_until(lambda: (s := _tritonserver(proc)) is not None and s.pid != first.pid and
                            probe.is_ready() and warm.exists() and s, "the server restarted (1 of 1 allowed)")
        assert cli.poll() is None
        second.kill()  # a second exit within the window: past the budget
        assert cli.wait(timeout=PATIENCE_S) == 1
        out = cli.stdout.read()
        assert "giving up" in out and "max_restarts=1" in out, out[-3000:]
        assert not probe.is_ready() and not warm.exists()
    finally:
        if cli.poll() is None:
            cli.send_signal(signal.SIGTERM)
            cli.wait(timeout=PATIENCE_S)
