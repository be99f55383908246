"""Shared fixtures. The flow / HiFT oracle is tests/fixtures/flow_oracle (made by tests/oracle/make_flow_oracle.py):
its ``hift.pt`` is committed, its ``flow.pt`` regenerated here from the project's seeded draws, both checked by
digest, so no parity test skips.
An external reference folder (``$COSYVOICE_REFERENCE_DIR``) is an optional cross-check; its tests skip without it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# tests/unit: no server; tests/live: a real tritonserver, gateway or Locust. Shared helpers (pb_standin, this file)
# stay here; a test module may import another's helpers from either folder (``make test-unit`` collects unit only).
for _folder in ("unit", "live"):
    if str(FIXTURES.parent / _folder) not in sys.path:
        sys.path.append(str(FIXTURES.parent / _folder))
FLOW_ORACLE = FIXTURES / "flow_oracle"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name, "").strip()
    return Path(value) if value else None


#: Optional folders outside the repository, only ever from the environment (no default reaches beside the clone):
#: an external reference folder (``cosyvoice2-tiny/`` with official-format weights and official outputs made on
#: another machine), used only for cross-checks, ``$COSYVOICE_REFERENCE_DIR``; a git folder of FunAudioLLM/CosyVoice
#: for the tests that run the official clients unchanged, ``$COSYVOICE_OFFICIAL_GIT``. Their tests skip without.
REFERENCE_DIR = _env_path("COSYVOICE_REFERENCE_DIR")
OFFICIAL_GIT = _env_path("COSYVOICE_OFFICIAL_GIT")


def require_speech() -> None:
    """Skip the calling test (or fixture) where no speech can be synthesised for the corpus."""
    from cosyvoice_triton.export.speech_corpus import espeak_available

    if not espeak_available():
        pytest.skip("no speech synthesiser: neither the espeakng-loader wheel (a dependency, `make install`) nor an "
                    "espeak-ng command is installed")


def require_live_loadtest() -> None:
    """Skip the calling test where a live load test cannot run: Locust (checked without importing it: it
    gevent-patches the whole process), matplotlib or tritonserver missing."""
    import importlib.util

    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust is not installed (pip install -e '.[loadtest]')")
    pytest.importorskip("matplotlib")
    from cosyvoice_triton.serving.launch.server import TritonNotInstalled, find_installation

    try:
        find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))


# Bars of the flow / HiFT oracle (tests/oracle/README.md has the measured figures). FEAT_BAR: the flow's mel and
# HiFT's input mel against the official code (relative: max abs err / max |ref|).
FEAT_BAR = 1e-5
#: End-to-end waveforms go through HiFT's phase accumulation, which turns float32 rounding of the mel into ~1e-3 of
#: the waveform. Their bar is this multiple of the largest waveform spread the oracle measured when it perturbed the
#: official HiFT input by noise at the scale of FEAT_BAR (``waveform_spread`` in the oracle meta).
WAVE_SPREAD_MULTIPLE = 4.0
WAVE_SPREAD_KEY = "rel_1e-6"


def waveform_bar(spread: dict) -> float:
    """The end-to-end waveform bar from a case's measured ``waveform_spread`` (see WAVE_SPREAD_MULTIPLE)."""
    return WAVE_SPREAD_MULTIPLE * max(spread[WAVE_SPREAD_KEY])


def oracle_script(name: str):
    """tests/oracle/<name>.py as a module (its seeded weights, digests and constants), imported once."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "oracle" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def flow_oracle_script():
    """tests/oracle/make_flow_oracle.py as a module."""
    return oracle_script("make_flow_oracle")


@pytest.fixture(scope="session")
def flow_oracle_meta() -> dict:
    return oracle_meta(FLOW_ORACLE)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, flow_oracle_meta) -> Path:
    """The oracle's tiny ``flow.pt`` (regenerated from the seeded draws) and ``hift.pt`` (committed: regenerating it
    runs a forward pass, whose last bits depend on the CPU) with ``cosyvoice2.yaml``, checked against the digests
    the official code loaded."""
    import shutil

    d = tmp_path_factory.mktemp("flow_oracle_weights")
    digests = flow_oracle_script().write_weights(d, seed=flow_oracle_meta["seeds"]["weights"])
    want = flow_oracle_meta["weights"]["state_sha256"]
    assert digests["hift.pt"] == want["hift.pt"], "tests/fixtures/flow_oracle/hift.pt is not the oracle's HiFT"
    assert digests["flow.pt"] == want["flow.pt"], (
        "flow.pt regenerated from the seeded draws differs from the oracle's: torch's normal draws follow another "
        "kernel here (they agree on AVX2 and AVX-512 x86-64; ATEN_CPU_CAPABILITY=default changes them)")
    shutil.copy(FLOW_ORACLE / "cosyvoice2_dims.json", d / "cosyvoice2_dims.json")
    return d


def npz_loader(folder: Path):
    """``load(name)`` -> the arrays of ``folder/name.npz`` as a dict, read once."""
    cache: dict[str, dict[str, np.ndarray]] = {}

    def load(name: str) -> dict[str, np.ndarray]:
        if name not in cache:
            with np.load(folder / f"{name}.npz", allow_pickle=False) as z:
                cache[name] = {k: z[k] for k in z.files}
        return cache[name]

    return load


def oracle_meta(folder: Path) -> dict:
    """``folder/oracle_meta.json``."""
    return json.loads((folder / "oracle_meta.json").read_text())


def oracle_fixtures(folder: Path):
    """The module fixtures of one oracle folder, ``meta, ref = oracle_fixtures(ORACLE)``: its :func:`oracle_meta`
    and its :func:`npz_loader` (pytest names each fixture after the module attribute it is bound to)."""

    @pytest.fixture(scope="module")
    def meta() -> dict:
        return oracle_meta(folder)

    @pytest.fixture(scope="module")
    def ref():
        return npz_loader(folder)

    return meta, ref


@pytest.fixture(scope="session")
def ref_npz():
    """``ref_npz("flow_nonstream")`` -> dict of numpy arrays of the official outputs in tests/fixtures/flow_oracle."""
    return npz_loader(FLOW_ORACLE)


@pytest.fixture(scope="session")
def external_tiny_dir() -> Path:
    """The external reference folder's ``cosyvoice2-tiny`` (optional cross-check)."""
    if REFERENCE_DIR is None:
        pytest.skip("no external reference folder: set COSYVOICE_REFERENCE_DIR to cross-check")
    tiny = REFERENCE_DIR / "cosyvoice2-tiny"
    if not (tiny / "flow.pt").is_file():
        pytest.skip(f"no cosyvoice2-tiny/flow.pt in COSYVOICE_REFERENCE_DIR={REFERENCE_DIR}")
    return tiny


@pytest.fixture(scope="session")
def external_npz(external_tiny_dir: Path):
    """Like ``ref_npz``, on the external reference folder."""
    return npz_loader(external_tiny_dir)


def speech_pair(source_s: float, prompt_s: float) -> tuple[np.ndarray, int, np.ndarray, int]:
    """The bundled source and prompt recordings cut to ``source_s`` / ``prompt_s`` seconds:
    ``(source, its rate, prompt, its rate)``, float32."""
    import soundfile as sf

    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return src[: int(source_s * ssr)], ssr, prm[: int(prompt_s * psr)], psr


@pytest.fixture(scope="session")
def cv3_demo_dir(tmp_path_factory) -> Path:
    """``cosyvoice-triton demo-model --family cosyvoice3 --seed 3``: the CosyVoice3 demo folder, once a session
    (read only)."""
    from cosyvoice_triton.__main__ import main

    out = tmp_path_factory.mktemp("cv3demo") / "Fun-CosyVoice3-demo"
    assert main(["demo-model", "--family", "cosyvoice3", "--out", str(out), "--seed", "3"]) == 0
    return out


@pytest.fixture(scope="session")
def cv3_onnx_dir(cv3_demo_dir, tmp_path_factory) -> Path:
    """The served graphs of :func:`cv3_demo_dir` (the DiT estimator's two, the vocoder's generator; fp32 ONNX, no
    verification: test_cv3_onnx checks the export), once a session."""
    from cosyvoice_triton.export.onnx_export3 import ESTIMATOR_GRAPHS, export_onnx3

    out = tmp_path_factory.mktemp("cv3onnx") / "fp32"
    export_onnx3(cv3_demo_dir, out, graphs=[*ESTIMATOR_GRAPHS, "hift3_decoder"], verify=False, threads=1)
    return out


@pytest.fixture(scope="session")
def cv3_int8_vocoder(cv3_demo_dir, cv3_onnx_dir, tmp_path_factory):
    """A copy of :func:`cv3_onnx_dir` with its vocoder graph quantized (``int8_cpu/hift3_decoder.onnx``: 2
    calibration pairs, 1 held-out, once a session): ``(folder, report)``. Skips without a speech synthesiser."""
    import shutil

    from cosyvoice_triton.export.quantize3 import quantize_vocoder3

    require_speech()
    out = tmp_path_factory.mktemp("cv3int8") / "onnx3"
    shutil.copytree(cv3_onnx_dir, out)
    report = quantize_vocoder3(cv3_demo_dir, out, calibration_pairs=2, heldout_pairs=1, max_seconds=4.0, threads=1,
                               speed_runs=2)
    return out, report


def int8_vocoder_marked(folder: Path, out: Path, serve: bool) -> Path:
    """A copy at ``out`` of a quantized CosyVoice3 export whose INT8 manifest records ``serve`` (the tiny demo graph's
    own verdict is "not served": at tiny dims INT8 is slower than fp32), for the tests of the serving path."""
    import shutil

    shutil.copytree(folder, out)
    path = out / "int8_cpu" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["graphs"]["hift3_decoder"]["serve"] = serve
    doc["graphs"]["hift3_decoder"]["verdict"] = f"marked {'served' if serve else 'not served'} by the test"
    path.write_text(json.dumps(doc))
    return out


@pytest.fixture(scope="session")
def en_speech() -> tuple[np.ndarray, int, np.ndarray, int]:
    """The bundled English prompt (3 s, 22.05 kHz) and source (5 s, 24 kHz) as read: (prompt, rate, source, rate)."""
    import soundfile as sf

    p, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    s, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    return p, psr, s, ssr


def rel_err(actual, expected) -> float:
    """max|a - e| / max|e|, the oracle README's relative error."""
    a, e = (np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float64)
            for x in (actual, expected))
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


# ------------------------------------------------------------------------------------ patience (busy machines)
#: The ceiling, in seconds, of one wait on an event (a server start or recovery, a counter moving, a request
#: answered). The CI machine is shared: tests wait on events, never on the clock, and give up only after this.
#: ``$COSYVOICE_TEST_PATIENCE`` sets it.
PATIENCE_S = float(os.environ.get("COSYVOICE_TEST_PATIENCE", "300"))
#: The pytest-timeout of a test that waits on several such events one after the other (a live server's start, a
#: fault, its recovery, the load after it).
PATIENT_TEST_S = int(6 * PATIENCE_S)
#: How long a test's readiness probe waits for the answer: a busy server answers late, which is not "not ready".
PROBE_TIMEOUT_S = 30.0


def wait_until(condition, what: str, *, timeout: float = PATIENCE_S, interval: float = 0.1):
    """Poll ``condition()`` until it returns something truthy and return that; an ``OSError`` counts as not yet.
    Fails the test naming ``what`` (and the last value or error) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = condition()
            if last:
                return last
        except OSError as exc:
            last = exc
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f} s (COSYVOICE_TEST_PATIENCE): {what} (last: {last!r})")
        time.sleep(interval)


# ------------------------------------------------------------------------------------ serving (Triton)
@pytest.fixture(scope="session")
def serving_assets(tmp_path_factory):
    """A tiny demo model and its fp32 ONNX export (no verification: test_onnx_export checks the export)."""
    from cosyvoice_triton.export.onnx_export import export_onnx
    from cosyvoice_triton.models.demo import write_demo_model

    root = tmp_path_factory.mktemp("serving")
    model_dir = write_demo_model(root / "cosyvoice2-demo-tiny", size="tiny")
    export_onnx(model_dir, root / "onnx" / "fp32", verify=False)
    return {"root": root, "model_dir": Path(model_dir), "onnx_dir": root / "onnx"}


@pytest.fixture(scope="session")
def local_pipeline(serving_assets):
    """The served graphs in process: ``LocalPipeline`` on the tiny model's fp32 ONNX export."""
    from cosyvoice_triton.serving.stages.local import LocalPipeline

    return LocalPipeline(serving_assets["model_dir"], serving_assets["onnx_dir"] / "fp32")


@pytest.fixture(scope="session")
def serving_library(serving_assets):
    """``CosyVoice2`` (torch) on the tiny served model folder."""
    from cosyvoice_triton.pipeline import CosyVoice2

    return CosyVoice2.from_pretrained(serving_assets["model_dir"])


def vc_request(src, ssr, prm, psr, seed: int) -> dict[str, np.ndarray]:
    """A conversion request's tensors (batch 1): source and prompt with their rates, and the seed."""
    return {"source_audio": src[None], "source_sample_rate": np.array([[ssr]], np.int32),
            "prompt_audio": prm[None], "prompt_sample_rate": np.array([[psr]], np.int32),
            "seed": np.array([[seed]], np.int64)}


@contextlib.contextmanager
def served(repo: Path, **server_kw):
    """A real tritonserver (nvidia-pytriton wheel) on ``repo`` with free ports, stopped on exit; skips the test
    with the reason where tritonclient or the server is not installed."""
    try:
        import tritonclient.grpc
        import tritonclient.http  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"tritonclient is not installed ({exc}): pip install 'tritonclient[http,grpc]==2.51.0'")
    from cosyvoice_triton.serving.launch.server import TritonNotInstalled, TritonServer, find_installation

    try:
        find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))
    server = TritonServer(repo, exit_timeout=5, **{"probe_timeout": PROBE_TIMEOUT_S, **server_kw})
    server.start(timeout=PATIENCE_S)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def live_models_served(serving_assets, folder: Path, **render_kw):
    """The local flavor rendered into ``folder`` with both live models (``cosyvoice_vc_live``,
    ``cosyvoice_tts_live``; ``render_kw``: more of the render's settings), served until the end."""
    from cosyvoice_triton.serving.repository import render_repository

    repo = folder / "model_repository"
    report = render_repository("local", repo, model_dir=serving_assets["model_dir"],
                               onnx_dir=serving_assets["onnx_dir"], max_queue_delay_us=5000, **render_kw)
    assert {"cosyvoice_vc_live", "cosyvoice_tts_live"} <= set(report.models), report.models
    with served(repo) as server:
        yield server


@pytest.fixture(scope="session")
def triton_server(serving_assets):
    """The local-flavor repository served by the nvidia-pytriton wheel's tritonserver, once per session."""
    from cosyvoice_triton.serving.repository import render_repository

    repo = serving_assets["root"] / "model_repository"
    render_repository("local", repo, model_dir=serving_assets["model_dir"], onnx_dir=serving_assets["onnx_dir"],
                      max_queue_delay_us=20000)
    with served(repo) as server:
        yield server


def _model_on(weights: Path, d: Path):
    """``CosyVoice2`` on the official-format flow.pt / hift.pt of ``weights`` (stand-in tokenizer / CAM++ models)."""
    import shutil

    from cosyvoice_triton.config import ModelConfig, write_yaml
    from cosyvoice_triton.models.standins import write_campplus_standin, write_speech_tokenizer_standin
    from cosyvoice_triton.pipeline import CosyVoice2

    for name in ("flow.pt", "hift.pt"):
        shutil.copy(weights / name, d / name)
    write_yaml(ModelConfig.tiny(), d / "cosyvoice2.yaml")
    write_speech_tokenizer_standin(d / "speech_tokenizer_v2.onnx")
    write_campplus_standin(d / "campplus.onnx")
    return CosyVoice2.from_pretrained(d)


@pytest.fixture(scope="session")
def oracle_model(tiny_dir, tmp_path_factory):
    """``CosyVoice2`` on the oracle's flow.pt / hift.pt."""
    return _model_on(tiny_dir, tmp_path_factory.mktemp("oracle"))


@pytest.fixture(scope="session")
def external_oracle_model(external_tiny_dir, tmp_path_factory):
    """``CosyVoice2`` on the external reference folder's flow.pt / hift.pt."""
    return _model_on(external_tiny_dir, tmp_path_factory.mktemp("external_oracle"))


def http_post(address: str, path: str, body: bytes, headers: dict | None = None,
              timeout: float = PATIENCE_S) -> tuple[int, bytes]:
    """``(status, body)`` of one POST to ``address`` (host:port) over a connection of its own, with the bytes as
    given (no client library between: hostile bodies stay what they are)."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@dataclass(frozen=True)
class GatewayUrls:
    http: str  # host:port of the HTTP side (OpenAI's API, CosyVoice's, /v2)
    grpc: str  # host:port of the KServe gRPC side

    @property
    def base(self) -> str:
        return f"http://{self.http}"


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a process a test started: SIGTERM, SIGKILL after ``timeout`` s, reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def gateway_running(argv: list[str], log: Path, http: str):
    """A gateway process (``argv`` after the interpreter, output into ``log``) until ``http``'s (host:port)
    ``/health`` answers 200; stopped at the end."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).resolve().parents[1])

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited ({proc.returncode}): {log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            return urllib.request.urlopen(f"http://{http}/health", timeout=30).status == 200

    try:
        wait_until(healthy, "the gateway's /health")
        yield proc
    finally:
        stop_process(proc)


@contextlib.contextmanager
def gateway_process(triton_server, log: Path, *args: str, tenants: dict[str, str] | None = None):
    """``python -m cosyvoice_triton.gateway`` in front of ``triton_server`` (both its ports), on free ports, until
    its ``/health`` answers 200; stopped at the end. ``tenants``: tenant -> key, written to a keys file beside
    ``log`` (``--api-key-file``)."""
    from cosyvoice_triton.serving.launch.server import free_ports

    if tenants:
        keys = log.parent / "keys"
        keys.write_text("".join(f"{tenant}:{key}\n" for tenant, key in tenants.items()))
        args = ("--api-key-file", str(keys), *args)
    port, grpc_port = free_ports(2)
    urls = GatewayUrls(f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}")
    with gateway_running(["-m", "cosyvoice_triton.gateway", "--triton-grpc", triton_server.grpc_url, "--triton-http",
                          triton_server.http_url, "--port", str(port), "--grpc-port", str(grpc_port), *args],
                         log, urls.http):
        yield urls


#: the official runtime's files the tests run or read, at the commit the official-interface tests pin
OFFICIAL_COMMIT = "ace7c47"
OFFICIAL_RUNTIME = "runtime/triton_trtllm"


@pytest.fixture(scope="session")
def official_runtime(tmp_path_factory) -> Path:
    """The official runtime folder at ``OFFICIAL_COMMIT`` (client_grpc.py, client_http.py, the cosyvoice2
    config), from ``$COSYVOICE_OFFICIAL_GIT``; skips without it."""
    official = official_git()
    out = tmp_path_factory.mktemp("official")
    files = [f"{OFFICIAL_RUNTIME}/{f}"
             for f in ("client_grpc.py", "client_http.py", "model_repo/cosyvoice2/config.pbtxt")]
    archive = subprocess.run(["git", "-C", str(official), "archive", OFFICIAL_COMMIT, *files],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.skip(f"{official} has no commit {OFFICIAL_COMMIT} with the runtime: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out / OFFICIAL_RUNTIME


def run_official_client(script: Path, *args: str, cwd: Path) -> str:
    """Run one of the official runtime's clients unchanged; its output, after checking that it reported no error."""
    proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=PATIENCE_S, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not any(w in out for w in ("error occurred", "Traceback", "Error processing", "failed.")), out[-3000:]
    return out


def official_git() -> Path:
    """``$COSYVOICE_OFFICIAL_GIT`` (a git folder of FunAudioLLM/CosyVoice), or skip the calling test."""
    if OFFICIAL_GIT is None or (not (OFFICIAL_GIT / "HEAD").exists() and not (OFFICIAL_GIT / ".git").exists()):
        pytest.skip("no git folder of the official CosyVoice: set COSYVOICE_OFFICIAL_GIT to run its clients")
    return OFFICIAL_GIT
