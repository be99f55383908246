"""A rollout under the production launcher (``python -m cosyvoice_triton.serving.launch.supervisor``, the
container's entry point): it starts a versioned repository (the live version's pipeline and the router, not every
model), the supervisor takes the rollout's reloads (the router with a new split, the stages with a new version
policy) for what they are rather than for dead stubs, and traffic shifts from v1 to v2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import PATIENCE_S, PATIENT_TEST_S, PROBE_TIMEOUT_S, ROOT, wait_until

from cosyvoice_triton.serving.launch.rollout import Rollout, VersionSpec, startup_models
from cosyvoice_triton.serving.launch.server import (
    TritonNotInstalled,
    TritonServer,
    admin_key,
    find_installation,
    free_ports,
)
from cosyvoice_triton.serving.launch.supervisor import models_to_load
from cosyvoice_triton.serving.repository import render_repository
from cosyvoice_triton.serving.samples import stage_warmup_samples

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)


@pytest.fixture(scope="module")
def two_versions(serving_assets, tmp_path_factory):
    good = (serving_assets["model_dir"], serving_assets["onnx_dir"])
    repo = tmp_path_factory.mktemp("supervised_rollout") / "model_repository"
    render_repository("local", repo, model_dir="unused", versions=[VersionSpec(1, *good), VersionSpec(2, *good)],
                      max_queue_delay_us=20000)
    return repo


def test_the_launcher_loads_a_versioned_repository_by_its_startup_list(two_versions, tmp_path):
    assert models_to_load(two_versions) == startup_models(two_versions)
    assert "cosyvoice_vc_v2" not in models_to_load(two_versions)
    assert models_to_load(tmp_path) == ["*"]  # not rendered by cosyvoice_triton / without versions


def test_a_rollout_shifts_traffic_to_v2_under_the_supervisor_cli(two_versions, tmp_path):
    pytest.importorskip("tritonclient.http")
    try:
        find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))
    from cosyvoice_triton.clients.client import VCClient
    from cosyvoice_triton.clients.retry import NO_RETRY

    http, grpc, metrics = free_ports(3)
    work = tmp_path / "work"
    key = admin_key()
    log = open(tmp_path / "supervisor.log", "w+")  # noqa: SIM115 (closed below)
    cli = subprocess.Popen(
        [sys.executable, "-m", "cosyvoice_triton.serving.launch.supervisor", "--model-repository", str(two_versions),
         "--work-dir", str(work), "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
         str(metrics), "--interval", "0.25", "--start-timeout", str(PATIENCE_S)],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COSYVOICE_TRITON_ADMIN_KEY": key})
    probe = TritonServer(two_versions, work_dir=tmp_path / "probe", http_port=http, probe_timeout=PROBE_TIMEOUT_S)
    s = stage_warmup_samples("preprocess", 1.0)
    try:
        wait_until(lambda: cli.poll() is None and (work / "warm").exists() and probe.is_ready(),
                   "the supervised versioned server ready and warm", timeout=2 * PATIENCE_S, interval=0.5)
        assert "cosyvoice_vc_v2" not in (work / "warm").read_text()  # only the live pipeline was loaded
        with Rollout(probe.http_url, two_versions, admin_key=key) as ro, \
                VCClient(probe.http_url, retry=NO_RETRY, timeout=PATIENCE_S) as client:
            assert ro.status().split == {1: 100.0}
            assert ro.stage(2)["passed"]
            ro.canary(100)
            before = ro.counts(2)[0]
            for _ in range(3):
                client.convert(s["source_audio"], s["prompt_audio"], source_sr=16000, prompt_sr=16000, seed=0)
            assert ro.counts(2)[0] - before == 3
            t = time.monotonic()
            wait_until(lambda: time.monotonic() - t > 10 * 0.25, "a few supervisor checks after the reloads")
            st = ro.status()
            assert st.split[2] == 100 and st.loaded["hift"] == [1, 2], st  # the rollout's state kept
        log.seek(0)
        out = log.read()
        assert "stub-died" not in out and "reload-failed" not in out, out[-3000:]
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=PATIENCE_S) == 0
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        log.close()
