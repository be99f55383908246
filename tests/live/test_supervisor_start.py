"""The supervisor's first start: a tritonserver that dies before it is ready is started again within the restart
budget, and the shared-memory regions its failed tries left behind are removed, in process with a stand-in server
(no tritonserver: the failure is one Triton 2.51 shows under memory pressure, a stub's lock_exception)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from cosyvoice_triton.serving.launch import supervisor as sup_mod
from cosyvoice_triton.serving.launch.server import ServerError
from cosyvoice_triton.serving.launch.supervisor import Supervisor


class _Server:
    """Dies ``failures`` times during its start, each time leaving a shared-memory region no process maps."""

    model_control = "explicit"

    def __init__(self, work_dir: Path, shm: Path, failures: int):
        self.work_dir, self.shm, self.failures = work_dir, shm, failures
        self.starts = self.stops = 0
        self.running = False
        self.left: list[Path] = []

    def start(self, timeout=None):
        self.starts += 1
        if self.starts <= self.failures:
            region = self.shm / f"triton_python_backend_shm_region_{uuid.uuid4().hex}"
            region.write_bytes(b"\0" * 64)
            self.left.append(region)
            raise ServerError("tritonserver exited with code -6 before it was ready (boost::interprocess::"
                              "lock_exception)")
        self.running = True
        return self

    def stop(self, grace=None):
        self.stops += 1
        self.running = False
        return 0

    def python_stubs(self):
        return []


@pytest.fixture
def shm(tmp_path, monkeypatch):
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(sup_mod, "SHM_DIR", d)
    (d / "triton_python_backend_shm_region_another_servers").write_bytes(b"x")  # there before: never touched
    return d


def _supervisor(server, max_restarts):
    return Supervisor(server, max_restarts=max_restarts, backoff=0.0, max_backoff=0.0, warmup=None)


def test_a_server_that_dies_while_starting_is_started_again_and_its_regions_removed(tmp_path, shm):
    server = _Server(tmp_path, shm, failures=2)
    sup = _supervisor(server, max_restarts=3)
    sup.first_start()
    assert server.running and server.starts == 3 and server.stops == 2
    assert [e.kind for e in sup.events] == ["shm-removed", "start-failed"] * 2
    assert not any(p.exists() for p in server.left)
    assert (shm / "triton_python_backend_shm_region_another_servers").exists()
    assert sup.failed is None


def test_the_first_start_gives_up_after_the_budget_and_still_cleans_up(tmp_path, shm):
    server = _Server(tmp_path, shm, failures=10)
    sup = _supervisor(server, max_restarts=2)
    with pytest.raises(ServerError, match="lock_exception"):
        sup.first_start()
    assert server.starts == 3 and not server.running
    assert sup.events[-1].kind == "gave-up" and "3 tries" in sup.failed
    assert not any(p.exists() for p in server.left)
