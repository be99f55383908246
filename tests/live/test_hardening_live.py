"""Operating faults against a live, supervised ``tritonserver`` (local flavor, tiny demo model, 127.0.0.1):

* warm-up: after the supervisor's start every loaded model has executed (the ensembles, the BLS stages, the
  streams and the LM included), and ``<work dir>/warm`` says so;
* a stage's Python process killed under load (while it computes a request): readiness goes false, the stage
  comes back (reloaded; or, where Triton 2.51 leaves the unload waiting on a request the dead stub held, the server
  restarted), no request hangs, and clients that retry (the default) see no failure at all while clients that do
  not see only the transient errors;
* SIGTERM to the supervisor CLI (the container's entry point) with requests in flight: every one of them is
  answered, the server stops taking new ones, and the process exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, PROBE_TIMEOUT_S, ROOT, wait_until

from cosyvoice_triton.clients.client import VCClient, VCError
from cosyvoice_triton.clients.retry import NO_RETRY, is_retryable
from cosyvoice_triton.serving.launch.server import TritonNotInstalled, TritonServer, find_installation, free_ports
from cosyvoice_triton.serving.launch.supervisor import Supervisor

pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http,grpc]==2.51.0'")
pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[http,grpc]==2.51.0'")

HANG_S = PATIENCE_S  # no request may take longer than this, whatever happens to the server (a busy machine's)
pytestmark = pytest.mark.timeout(PATIENT_TEST_S)
FIGURES: dict = {}


def _installed():
    try:
        find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def speech():
    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: int(1.5 * ssr)], ssr, prm[: int(1.5 * psr)], psr


def _render(serving_assets, out: Path, **tunables) -> Path:
    from cosyvoice_triton.serving.repository import render_repository

    render_repository("local", out, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      max_queue_delay_us=2000, **tunables)
    return out


@pytest.fixture(scope="module")
def supervised(serving_assets, tmp_path_factory):
    _installed()
    root = tmp_path_factory.mktemp("hardening")
    repo = _render(serving_assets, root / "model_repository")
    server = TritonServer(repo, work_dir=root / "triton", exit_timeout=10, model_control="explicit",
                          load_models=["*"], probe_timeout=PROBE_TIMEOUT_S)
    # the unload ceiling stays the supervisor's own (60 s): past it, the server is restarted (see _recovery)
    sup = Supervisor(server, interval=0.25, backoff=0.5, max_backoff=2.0, max_restarts=3, start_timeout=PATIENCE_S)
    with sup:
        yield sup
    print("\nhardening figures:", json.dumps(FIGURES, indent=1, default=str))


class Users:
    """``n`` threads converting back to back until stopped; each outcome recorded with its latency."""

    def __init__(self, server: TritonServer, speech, protocols: list[str], retry):
        self.server, self.speech, self.retry = server, speech, retry
        self.outcomes: list[tuple[str, float, str]] = []  # (protocol, seconds, "ok" | error)
        self.retries = 0
        self.ends = [0.0] * len(protocols)  # per thread: when its last request came back
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(p, i), daemon=True) for i, p in enumerate(protocols)]

    def _run(self, protocol: str, index: int) -> None:
        src, ssr, prm, psr = self.speech
        url = self.server.http_url if protocol == "http" else self.server.grpc_url
        kw = {} if self.retry is None else {"retry": self.retry}
        with VCClient(url, protocol=protocol, timeout=HANG_S, **kw) as client:
            counted = 0
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    client.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=1)
                    what = "ok"
                except VCError as exc:
                    what = f"{exc.status}: {exc.message[:300]}|retryable={is_retryable(exc)}"
                with self._lock:
                    self.outcomes.append((protocol, time.monotonic() - t0, what))
                    self.retries += client.retries - counted  # live, so the test sees when a kill reached a request
                    self.ends[index] = time.monotonic()
                counted = client.retries
                if what != "ok" and self.retry is not None:
                    time.sleep(0.05)

    def __enter__(self) -> Users:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=HANG_S + 30)
        assert not any(t.is_alive() for t in self.threads), "a client thread hangs"

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def all_back_since(self, t: float) -> bool:
        """Whether every thread has had a request come back after ``t`` (the one it had in flight then included)."""
        with self._lock:
            return all(end > t for end in self.ends)


def _model_stats(server: TritonServer) -> list[dict]:
    status, body = server.request("GET", "/v2/models/stats", admin=True, timeout=PROBE_TIMEOUT_S)
    assert status == 200, body
    return json.loads(body)["model_stats"]


def _statistics(server: TritonServer) -> dict[str, int]:
    return {m["name"]: int(m.get("execution_count", 0)) for m in _model_stats(server)}


def _successes(server: TritonServer) -> dict[str, int]:
    """Requests each model has answered successfully."""
    return {m["name"]: int(m["inference_stats"]["success"]["count"]) for m in _model_stats(server)}


# ------------------------------------------------------------------------------------------------ warm-up
def test_every_model_is_warm_once_the_supervisor_has_started(supervised):
    server = supervised.server
    warm = [e for e in supervised.events if e.kind == "warmed-up"]
    assert warm, f"no warm-up ran: {supervised.events}"
    assert "failed" not in warm[0].detail, warm[0].detail
    done = json.loads(supervised.warm_file.read_text())
    assert {"cosyvoice_vc", "cosyvoice_vc_stream", "speakers"} <= set(done), done
    if (server.model_repository / "cosyvoice_tts").is_dir():
        assert {"cosyvoice_tts", "cosyvoice_tts_stream"} <= set(done), done
    assert all(isinstance(v, float) for v in done.values()), done
    executed = _statistics(server)
    # a live model (sequence batcher) takes sequences only and is not warmed itself; its callees are
    from cosyvoice_triton.serving.launch.warmup import loaded_models

    live = {m["name"] for m in loaded_models(server) if m["sequence"]}
    cold = sorted(name for name, n in executed.items() if n < 1 and name not in live)
    assert not cold, f"models never executed after the warm-up: {cold}"
    FIGURES["warm-up seconds per pipeline"] = done
    FIGURES["warm-up total (s)"] = round(warm[0].seconds, 2)


def test_the_autoscaler_metrics_exist_on_the_live_server(supervised):
    """The Prometheus adapter's rules (deploy/k8s) read Triton metrics by name: the server must expose them."""
    from test_k8s import adapter_metric_names

    from cosyvoice_triton.loadtest.metrics import scrape

    exposed = {s.name for s in scrape(supervised.server.metrics_url, timeout=30)}
    missing = adapter_metric_names() - exposed
    assert not missing, f"the HPA's adapter rules read metrics this Triton does not expose: {missing}"


# ------------------------------------------------------------------------------- a stage killed under load
def _pending(server: TritonServer, model: str) -> float:
    """Requests waiting in ``model``'s queue now (Triton's ``nv_inference_pending_request_count``)."""
    from cosyvoice_triton.loadtest.metrics import counter_total, scrape

    return counter_total(scrape(server.metrics_url, timeout=30), "nv_inference_pending_request_count", model=model)


def _recovery(events, victim: str) -> str | None:
    """How the supervisor brought ``victim`` back, from its events since the kill: ``reloaded``, or ``restarted``
    (Triton 2.51 can leave a request that was in the dead stub hanging, and the unload waiting on it: past the
    unload ceiling the supervisor restarts the server); None while neither has happened."""
    kinds = [(e.kind, e.detail) for e in events]
    if ("reloaded", victim) in kinds:
        return "reloaded"
    failed = next((i for i, (k, d) in enumerate(kinds) if k == "reload-failed" and d.startswith(f"{victim}:")), None)
    if failed is not None and any(k == "restarted" for k, _ in kinds[failed:]):
        return "restarted"
    return None


@pytest.mark.parametrize("victim", ["flow", "hift_decoder"])
def test_a_stage_killed_under_load_comes_back_and_no_request_hangs_or_fails(supervised, speech, victim):
    server = supervised.server
    recoveries: list[str] = []
    retrying = Users(server, speech, ["http", "grpc", "http", "grpc"], retry=None)  # the clients' default policy
    bare = Users(server, speech, ["grpc"], retry=NO_RETRY)
    unready: list[float] = []
    with retrying, bare:
        wait_until(lambda: retrying.count() >= 4, "4 requests answered: the load is on", interval=0.2)
        # A stage killed while idle may be reloaded before any request needs it: the stub is frozen (SIGSTOP) until
        # a client's request waits in the stage's queue (Triton's pending count: with one instance, the request
        # before it is then inside the frozen stub), then killed; at most 3 kills until one has reached a request.
        # The supervisor's warm-up after each reload (and after the previous test's) runs through the stage too:
        # each kill waits for it to end, so that the requests met are the clients'.
        kills = 0
        while kills < 3:
            assert supervised.wait_warm(PATIENCE_S), f"the supervisor's warm-up still running after {PATIENCE_S} s"
            stub = next(s for s in server.python_stubs() if s.model == victim and s.alive)
            os.kill(stub.pid, signal.SIGSTOP)
            wait_until(lambda: _pending(server, victim) > 0, f"a request waiting for the frozen {victim} stub",
                       interval=0.05)
            t_kill = time.monotonic()
            os.kill(stub.pid, signal.SIGKILL)
            kills += 1
            events_before_kill = len(supervised.events)
            seen_unready = False
            while True:  # readiness goes false, then the stage is back (reloaded, or restarted) and ready again
                if time.monotonic() - t_kill > PATIENCE_S:
                    pytest.fail(f"{victim} not back {PATIENCE_S:.0f} s after kill {kills} (unready seen: "
                                f"{seen_unready}); supervisor events: {supervised.events}")
                if not server.is_ready():
                    seen_unready = True
                    if kills == 1:
                        unready.append(time.monotonic() - t_kill)
                elif seen_unready and (how := _recovery(supervised.events[events_before_kill:], victim)):
                    recoveries.append(how)
                    break
                time.sleep(0.05)
            if kills == 1:
                back = time.monotonic() - t_kill
            # the requests that met the dead stage come back (retried) or fail (bare): every client's request in
            # flight at the kill is back
            wait_until(lambda t=t_kill: retrying.all_back_since(t) and bare.all_back_since(t),
                       "every client's request in flight at the kill answered", interval=0.2)
            if retrying.retries > 0 or any(o[2] != "ok" for o in bare.outcomes):
                break
        served_before = retrying.count()
        wait_until(lambda: retrying.count() >= served_before + 4, "4 more requests answered: serving again",
                   interval=0.2)
    assert unready, "readiness never went false while the stage was dead"
    outcomes = retrying.outcomes
    failed = [o for o in outcomes if o[2] != "ok"]
    slowest = max(o[1] for o in outcomes + bare.outcomes)
    raw_errors = sorted({o[2] for o in bare.outcomes if o[2] != "ok"})
    FIGURES[f"kill {victim}"] = {"kills": kills,
                                 "not ready after (s)": round(unready[0], 2), "ready again after (s)": round(back, 2),
                                 "requests (retrying clients)": len(outcomes), "failed": len(failed),
                                 "retries": retrying.retries, "slowest request (s)": round(slowest, 2),
                                 "recovered by": recoveries,
                                 "errors seen without retries": raw_errors}
    assert slowest < HANG_S, f"a request took {slowest:.0f} s"
    assert not failed, f"requests failed although the client retries: {failed[:5]}"
    assert retrying.retries > 0 or raw_errors, "the kill reached no request: the test proved nothing"
    assert all("retryable=True" in e for e in raw_errors), f"an error a client would not retry: {raw_errors}"
    assert server.is_ready() and len(recoveries) == kills, recoveries


# ------------------------------------------------------------------------------------------ SIGTERM
def test_sigterm_finishes_the_requests_in_flight_then_exits(serving_assets, tmp_path, speech):
    _installed()
    repo = _render(serving_assets, tmp_path / "model_repository", tts="off")
    http_port, grpc_port, metrics_port = free_ports(3)
    cmd = [sys.executable, "-m", "cosyvoice_triton.serving.launch.supervisor", "--model-repository", str(repo),
           "--work-dir", str(tmp_path / "triton"), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--metrics-port", str(metrics_port), "--exit-timeout", "60", "--no-warmup"]
    log = open(tmp_path / "supervisor.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    probe = TritonServer(repo, work_dir=tmp_path / "probe", http_port=http_port, probe_timeout=PROBE_TIMEOUT_S)

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "supervisor.log").read_text()[-3000:]
        return probe.is_ready()

    try:
        wait_until(ready, "the supervised server ready", interval=0.5)
        # the statistics API needs the admin key the CLI's server wrote
        probe = TritonServer(repo, work_dir=tmp_path / "probe", http_port=http_port, probe_timeout=PROBE_TIMEOUT_S,
                             admin_key=(tmp_path / "triton" / "admin_key").read_text().strip())
        before = _successes(probe)
        src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
        src = np.tile(src, 3)  # 15 s: each conversion takes seconds even on a fast, idle machine
        _, _, prm, psr = speech
        done: list[tuple[str, float, str]] = []

        def one(protocol: str) -> None:
            url = f"127.0.0.1:{http_port if protocol == 'http' else grpc_port}"
            with VCClient(url, protocol=protocol, timeout=HANG_S, retry=NO_RETRY) as client:
                try:
                    res = client.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=1)
                    what = "ok" if res.seconds > 0 else "empty"
                except VCError as exc:
                    what = f"{exc.status}: {exc.message[:200]}"
            done.append((protocol, time.monotonic(), what))

        threads = [threading.Thread(target=one, args=(p,)) for p in ["http", "grpc"] * 3]
        for t in threads:
            t.start()

        def received() -> dict[str, int]:
            # all six received (each has passed the first stage): SIGTERM now must not refuse any of them, and the
            # ones not answered yet (in_flight below: at least one) are in flight
            now = {k: v - before.get(k, 0) for k, v in _successes(probe).items()}
            return now if now.get("preprocess", 0) >= 6 else {}

        at_term = wait_until(received, "the six requests received by the server", interval=0.05)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=HANG_S)
        code = proc.wait(timeout=PATIENCE_S)
        exited = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    text = (tmp_path / "supervisor.log").read_text(errors="replace")
    in_flight = [d for d in done if d[1] > t_term]
    FIGURES["SIGTERM"] = {"requests": len(done), "answered after SIGTERM": len(in_flight), "stages done": at_term,
                          "exit after (s)": round(exited, 2), "exit code": code}
    assert len(done) == 6, f"{6 - len(done)} request(s) never answered"
    assert all(d[2] == "ok" for d in done), f"requests in flight failed at SIGTERM: {done}\n{text[-3000:]}"
    assert in_flight, "every request had finished before SIGTERM: nothing was in flight (the test proved nothing)"
    assert code == 0, f"exit code {code}\n{text[-3000:]}"
    assert "tritonserver stopped" in text
    assert not Path(tmp_path / "triton" / "warm").exists()


# ------------------------------------------------------------------------------------------ no server needed
def test_warm_up_plan_picks_the_public_pipelines_only():
    from cosyvoice_triton.serving.launch.warmup import plan

    models = [
        {"name": "preprocess", "inputs": {"source_audio", "prompt_audio", "source_sample_rate"},
         "outputs": {"source_whisper_mel"}, "decoupled": False},
        {"name": "cosyvoice_vc", "inputs": {"source_audio", "prompt_audio", "seed"}, "outputs": {"waveform"},
         "decoupled": False},
        {"name": "cosyvoice_vc_v2", "inputs": {"source_audio", "prompt_audio"}, "outputs": {"waveform"},
         "decoupled": False},
        {"name": "cosyvoice_vc_stream", "inputs": {"source_audio", "prompt_audio", "speaker_id"},
         "outputs": {"waveform", "chunk_index"}, "decoupled": True},
        {"name": "cosyvoice_tts", "inputs": {"text", "prompt_audio"}, "outputs": {"waveform"}, "decoupled": False},
        {"name": "cosyvoice_tts_stream", "inputs": {"text"}, "outputs": {"waveform"}, "decoupled": True},
        {"name": "speakers", "inputs": {"action", "speaker_id", "prompt_audio"}, "outputs": {"ids"},
         "decoupled": False},
        {"name": "hift", "inputs": {"mel"}, "outputs": {"waveform"}, "decoupled": False},
        {"name": "flow_estimator", "inputs": {"x", "mask"}, "outputs": {"velocity"}, "decoupled": False},
    ]
    assert plan(models) == [("cosyvoice_vc", "vc"), ("cosyvoice_vc_v2", "vc"), ("cosyvoice_vc_stream", "vc_stream"),
                            ("cosyvoice_tts", "tts"), ("cosyvoice_tts_stream", "tts_stream"),
                            ("speakers", "speakers")]
