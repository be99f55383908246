"""cosyvoice_triton.serving.launch.server: the wheel's tritonserver started without Docker, on a one-model
repository."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from conftest import PATIENCE_S, PROBE_TIMEOUT_S

from cosyvoice_triton.serving.launch.server import (
    ServerError,
    TritonNotInstalled,
    TritonServer,
    _group_members,
    find_installation,
    free_ports,
)

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
ECHO_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x")
                .as_numpy() * 2)]) for r in requests]
"""


@pytest.fixture(scope="module")
def installation():
    try:
        return find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))


def _repo(root, model_py=ECHO_MODEL):
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "echo" / "1" / "model.py").write_text(textwrap.dedent(model_py))
    return root


def test_free_ports_are_distinct():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def test_missing_stub_version_says_how_to_install(installation):
    with pytest.raises(TritonNotInstalled, match="pip install --no-deps nvidia-pytriton"):
        find_installation(python_version="2.7")


def test_missing_repository_is_refused(tmp_path):
    with pytest.raises(ServerError, match="render it first"):
        TritonServer(tmp_path / "nope")


def test_start_serve_stop_leaves_no_process(installation, tmp_path):
    import numpy as np
    import tritonclient.http as th

    server = TritonServer(_repo(tmp_path / "repo"), work_dir=tmp_path / "work", exit_timeout=5,
                          start_timeout=PATIENCE_S, probe_timeout=PROBE_TIMEOUT_S)
    with server:
        assert server.is_ready() and server.is_model_ready("echo")
        pgid = server.process.pid
        assert len(_group_members(pgid)) >= 2  # the server and the echo stub
        c = th.InferenceServerClient(server.http_url)
        x = th.InferInput("x", [1, 3], "FP32")
        x.set_data_from_numpy(np.array([[1, 2, 3]], np.float32))
        assert c.infer("echo", [x]).as_numpy("y").tolist() == [[2, 4, 6]]
        c.close()
        assert server.ports["http"] != server.ports["grpc"]
    assert not server.running
    assert _group_members(pgid) == []  # no orphan stub
    assert "successfully loaded 'echo'" in server.log_text()


def test_a_model_that_fails_to_load_fails_the_start_with_the_log(installation, tmp_path):
    server = TritonServer(_repo(tmp_path / "repo", "raise ImportError('broken on purpose')\n"),
                          work_dir=tmp_path / "work")
    with pytest.raises(ServerError, match="broken on purpose") as info:
        server.start(timeout=PATIENCE_S)
    # it fails as soon as the server exits (--exit-on-error), not when the readiness wait runs out
    assert "exited with code" in str(info.value) and "not ready after" not in str(info.value)
    assert not server.running


def test_the_readiness_ceilings_are_settings(tmp_path):
    (tmp_path / "repo").mkdir()
    for bad in ({"start_timeout": 0}, {"probe_timeout": -1}):
        with pytest.raises(ValueError, match="must be > 0"):
            TritonServer(tmp_path / "repo", **bad)
    server = TritonServer(tmp_path / "repo", start_timeout=1.0, probe_timeout=0.1)
    server.ports["http"] = free_ports(1)[0]  # nothing listens there: never ready
    server.process = subprocess.Popen(["sleep", "60"])  # a process that lives but never serves
    try:
        with pytest.raises(ServerError, match="not ready after 1 s"):  # the default ceiling is start_timeout
            server.wait_ready()
        assert not server.is_ready()
    finally:
        server.process.kill()
        server.process.wait()
        server.process = None
