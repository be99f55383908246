"""Run NVIDIA Triton Inference Server from the ``nvidia-pytriton`` wheel, without Docker and without PyTriton.

The PyPI wheel ``nvidia-pytriton==0.7.0`` carries a real ``tritonserver`` (Triton 2.51.0), the Python backend,
one ``triton_python_backend_stub`` per Python version and the shared libraries they need. This module lays
out a backend folder from it (the backend files plus the stub of *this* interpreter's Python version), then
starts the binary on loopback ports with the environment the stub needs: ``LD_LIBRARY_PATH`` on the wheel's
libraries and this environment's ``bin/`` first on ``PATH`` (the stub's embedded interpreter finds this
environment's site-packages through it).

    with TritonServer("build/model_repository") as server:   # free ports, waits until ready
        print(server.http_url, server.grpc_url)

:class:`TritonServer` starts the server in its own process group, captures its log to a file, waits for
readiness with a timeout (failing early, with the log's tail, when the process exits), and stops it with
SIGINT (Triton unloads its models and its Python stubs exit), then SIGKILL of the whole group after a grace
period, so that no stub process outlives it. Nothing here imports ``tritonclient``: readiness is polled with
plain HTTP.

The administrative APIs (shared-memory registration, model repository control, model configs, statistics, trace
and log settings) are restricted on both protocols (Triton's ``--http-restricted-api`` /
``--grpc-restricted-protocol``): a request to them needs the header :data:`ADMIN_HEADER` with the admin key
(:mod:`cosyvoice_triton.admin`, whose names this module re-exports). The key comes from
``$COSYVOICE_TRITON_ADMIN_KEY``, else it is drawn at random once per process and put into that variable (so this
process and its children can read it); each server also writes it to ``<work_dir>/admin_key`` (mode 0600) for a
client in another shell. Health, metadata and inference stay open.
:class:`TritonInstallation.at` serves with an installed Triton (``/opt/tritonserver`` in the NGC image) instead
of the wheel.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...admin import ADMIN_HEADER, ADMIN_KEY_ENV, admin_headers, admin_key  # re-exported: the public names here

log = logging.getLogger(__name__)

__all__ = [
    "ADMIN_HEADER",
    "ADMIN_KEY_ENV",
    "PYTRITON_REQUIREMENT",
    "RESTRICTED_APIS",
    "SHM_DIR",
    "ServerError",
    "StubProcess",
    "TritonInstallation",
    "TritonNotInstalled",
    "TritonServer",
    "admin_headers",
    "admin_key",
    "find_installation",
    "free_ports",
    "prepare_backends",
    "rate_limit_flags",
    "response_cache_flags",
    "shm_region_users",
]

#: What provides the server binary (install with ``pip install --no-deps``: its Python API is not used).
PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
TRITON_VERSION = "2.51.0"

#: Triton's API groups that need the admin header; ``health``, ``metadata`` and ``inference`` stay open.
RESTRICTED_APIS = ("shared-memory", "model-repository", "model-config", "statistics", "trace", "logging")
#: The request size limit passed where the binary has the flag (``--http-max-input-size``, Triton >= 25.05; not in
#: 2.51, the wheel, nor in the old 25.01 image; the 26.07 image should have it, detected at start: without it the
#: gateway or a proxy in front must cap bodies, README "Hardening"). 64 MiB: a 30 s
#: 48 kHz source + prompt as JSON numbers is ~45 MB, as binary data ~12 MB.
HTTP_MAX_INPUT_BYTES = 64 << 20


_process_admin_key = admin_key


class TritonNotInstalled(RuntimeError):
    """The ``tritonserver`` binary of the ``nvidia-pytriton`` wheel is not available here."""


class ServerError(RuntimeError):
    """The server did not start, did not become ready in time, or exited; ``log_tail`` has its last lines."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message + (f"\n--- tritonserver log (tail) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


@dataclass(frozen=True)
class TritonInstallation:
    """Paths inside an installed ``nvidia-pytriton`` wheel."""

    root: Path  # site-packages/pytriton/tritonserver
    binary: Path
    backends: Path
    stub: Path  # the triton_python_backend_stub of this Python version
    libs: Path | None  # site-packages/nvidia_pytriton.libs; None for an installed Triton
    bundled: bool = True  # the wheel's layout (backends are copied, the stub put into them)

    @property
    def python_version(self) -> str:
        return self.stub.parent.name

    @classmethod
    def at(cls, root: str | Path = "/opt/tritonserver") -> TritonInstallation:
        """An installed Triton (``bin/tritonserver``, ``backends/`` with the Python backend's stub in it), e.g.
        ``/opt/tritonserver`` of the NGC image; raises :class:`TritonNotInstalled` naming what is missing."""
        root = Path(root)
        inst = cls(root=root, binary=root / "bin" / "tritonserver", backends=root / "backends",
                   stub=root / "backends" / "python" / "triton_python_backend_stub", libs=None, bundled=False)
        for what, path in (("tritonserver binary", inst.binary), ("backend folder", inst.backends)):
            if not path.exists():
                raise TritonNotInstalled(f"no {what} at {path} (is Triton installed at {root}?)")
        return inst


def find_installation(python_version: str | None = None) -> TritonInstallation:
    """Locate the wheel's ``tritonserver``, backends, Python stub and libraries, or raise
    :class:`TritonNotInstalled` saying what is missing and how to install it."""
    import importlib.util

    how = f"install it with `pip install --no-deps {PYTRITON_REQUIREMENT}`"
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotInstalled(f"the tritonserver binary comes from the {PYTRITON_REQUIREMENT} wheel, which is "
                                 f"not installed in {sys.prefix}: {how}")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    root = pkg / "tritonserver"
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    inst = TritonInstallation(root=root, binary=root / "bin" / "tritonserver", backends=root / "backends",
                              stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
                              libs=pkg.parent / "nvidia_pytriton.libs")
    for what, path in (("tritonserver binary", inst.binary), ("Python backend", inst.backends / "python"),
                       (f"Python {version} backend stub", inst.stub), ("shared libraries", inst.libs)):
        if not path.exists():
            raise TritonNotInstalled(f"{PYTRITON_REQUIREMENT}: no {what} at {path}; {how}")
    return inst


def prepare_backends(out_dir: str | Path, installation: TritonInstallation | None = None) -> Path:
    """Copy the wheel's backends to ``out_dir`` and put the stub of this Python version into ``python/``.

    Idempotent (files are copied again only when their size or time differ). Returns ``out_dir``.
    """
    inst = installation or find_installation()
    if not inst.bundled:
        return inst.backends
    out = Path(out_dir)
    shutil.copytree(inst.backends, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    stub = out / "python" / inst.stub.name
    if not stub.exists() or stub.stat().st_size != inst.stub.stat().st_size:
        shutil.copy2(inst.stub, stub)
    stub.chmod(0o755)
    return out


_HELP: dict[str, str] = {}


def server_flags(installation: TritonInstallation) -> str:
    """The ``tritonserver --help`` text of ``installation`` (cached): which flags this Triton has."""
    key = str(installation.binary)
    if key not in _HELP:
        env = dict(os.environ)
        if installation.libs is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join([str(installation.libs), env.get("LD_LIBRARY_PATH", "")])
        try:
            run = subprocess.run([key, "--help"], capture_output=True, text=True, timeout=60, env=env, check=False)
            _HELP[key] = run.stdout + run.stderr
        except (OSError, subprocess.TimeoutExpired):
            _HELP[key] = ""
    return _HELP[key]


def _rendered_tunables(model_repository: str | Path) -> dict:
    """The render tunables recorded in a repository's marker (:data:`~..marker.MARKER`); raises OSError /
    ValueError / AttributeError for a folder that cosyvoice_triton did not render."""
    from ..marker import read_marker

    return read_marker(model_repository).get("tunables", {})


def response_cache_flags(model_repository: str | Path, installation: TritonInstallation) -> list[str]:
    """``--cache-config local,size=N`` (and the wheel's cache folder) when the rendered repository's marker asks for
    Triton's response cache (tunable ``response_cache_mb`` > 0: the prompt-side graphs have ``response_cache``
    enabled; without the flag Triton loads them and caches nothing); ``[]`` otherwise or for a repository that was
    not rendered by cosyvoice_triton."""
    try:
        size = int(float(_rendered_tunables(model_repository).get("response_cache_mb", 0)) * (1 << 20))
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    if size <= 0:
        return []
    return [f"--cache-config=local,size={size}", f"--cache-directory={installation.root / 'caches'}"]


def rate_limit_flags(model_repository: str | Path) -> list[str]:
    """``--rate-limit=execution_count`` (and ``--rate-limit-resource=task_quota:N`` for a quota above 1) when the
    rendered repository's marker has rate-limited models (tunables ``task_quota`` > 0 or ``rate_limit``): without the
    flag Triton ignores the configs' ``rate_limiter`` blocks, and without the resource flag a quota of N acts as the
    largest single need; ``[]`` otherwise or for a repository that was not rendered by cosyvoice_triton."""
    try:
        tunables = _rendered_tunables(model_repository)
        quota = int(tunables.get("task_quota") or 0)
        limits = dict(tunables.get("rate_limit") or {})
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    if quota <= 0 and not limits:
        return []
    flags = ["--rate-limit=execution_count"]
    if quota > 1:
        flags.append(f"--rate-limit-resource=task_quota:{quota}")
    return flags


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that are free on ``host`` right now (bound to port 0 and released)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


#: tritonserver flags that name an address to bind (besides ``host``, which sets all three).
ADDRESS_FLAGS = ("--http-address", "--grpc-address", "--metrics-address")
PUBLIC_TRITON_REFUSED = ("Triton would listen on {addr}, not loopback: its own ports have no keys, no per-tenant "
                         "voices or sessions and the bugs of docs/operations/hardening.md; keep it on 127.0.0.1 behind "
                         "the gateway, or pass --public-triton (public=True; the image: TRITON_PUBLIC=1) to publish it "
                         "on purpose, behind a proxy")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) binds loopback only."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: whatever it resolves to, not ours to trust
        return False


def check_loopback(host: str, extra_args: Sequence[str] = (), public: bool = False) -> None:
    """Refuse (:class:`ValueError`) a Triton bound beyond loopback, by ``host`` or an address flag in
    ``extra_args``, unless ``public``."""
    if public:
        return
    addrs = [host]
    for i, arg in enumerate(extra_args):
        flag, eq, value = arg.partition("=")
        if flag in ADDRESS_FLAGS:
            addrs.append(value if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else ""))
    for addr in addrs:
        if not is_loopback(addr):
            raise ValueError(PUBLIC_TRITON_REFUSED.format(addr=addr or "(empty)"))


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class TritonServer:
    """One ``tritonserver`` process on loopback ports.

    Args:
        model_repository: the rendered repository (see :mod:`cosyvoice_triton.serving.repository`).
        work_dir: where the backend folder and the log go (default: ``<repository>/../triton``).
        http_port, grpc_port, metrics_port: 0 picks free ports at start.
        host: the address every endpoint binds to (loopback by default); another address (here or as an address
            flag in ``extra_args``) is refused unless ``public`` (:func:`check_loopback`).
        model_control: ``"none"`` (load everything at start) or ``"explicit"``.
        load_models: with ``"explicit"``, the models to load at start (``["*"]`` for all).
        log_verbose: Triton's ``--log-verbose`` level.
        exit_timeout: Triton's ``--exit-timeout-secs``: how long a stop waits for in-flight requests and open
            HTTP connections before unloading anyway.
        extra_args: more ``tritonserver`` flags.
        env: extra environment variables for the server and its stubs.
        admin_key: the key of the restricted APIs (default :func:`admin_key`); ``restricted_apis``: which (empty:
            none restricted, for a server that only loopback clients of the same user reach).
        http_max_input_bytes: the HTTP request size limit, passed as ``--http-max-input-size`` where this Triton
            has the flag (:attr:`size_limit_enforced`); None: Triton's default.
        start_timeout: seconds :meth:`start` / :meth:`wait_ready` wait for readiness when not told otherwise.
        probe_timeout: seconds a readiness probe (:meth:`is_ready`, :meth:`is_model_ready`) waits for the answer;
            no answer in time counts as not ready.
    """

    def __init__(self, model_repository: str | Path, *, work_dir: str | Path | None = None, http_port: int = 0,
                 grpc_port: int = 0, metrics_port: int = 0, host: str = "127.0.0.1", model_control: str = "none",
                 load_models: Sequence[str] = (), log_verbose: int = 0, exit_timeout: int = 10,
                 extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, installation: TritonInstallation | None = None,
                 admin_key: str | None = None, restricted_apis: Sequence[str] = RESTRICTED_APIS,
                 http_max_input_bytes: int | None = HTTP_MAX_INPUT_BYTES, start_timeout: float = 120.0,
                 probe_timeout: float = 2.0, public: bool = False):
        check_loopback(host, extra_args, public)
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist (render it first)")
        if model_control not in ("none", "explicit", "poll"):
            raise ValueError(f"model_control must be none, explicit or poll, got {model_control!r}")
        # absolute: the server runs with this folder as its working directory
        self.work_dir = (Path(work_dir) if work_dir else self.model_repository.parent / "triton").resolve()
        self.host = host
        self.ports = {"http": int(http_port), "grpc": int(grpc_port), "metrics": int(metrics_port)}
        self.model_control = model_control
        self.load_models = list(load_models)
        self.log_verbose = int(log_verbose)
        self.exit_timeout = int(exit_timeout)
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.installation = installation
        self.restricted_apis = tuple(restricted_apis)
        unknown = set(self.restricted_apis) - {*RESTRICTED_APIS, "health", "metadata", "inference"}
        if unknown:
            raise ValueError(f"unknown restricted API group(s) {sorted(unknown)}; Triton 2.51 has {RESTRICTED_APIS}")
        self.admin_key = admin_key or _process_admin_key()
        self.http_max_input_bytes = http_max_input_bytes
        if start_timeout <= 0 or probe_timeout <= 0:
            raise ValueError(f"start_timeout and probe_timeout must be > 0, got {start_timeout}, {probe_timeout}")
        self.start_timeout, self.probe_timeout = float(start_timeout), float(probe_timeout)
        self.process: subprocess.Popen | None = None
        self.log_path = self.work_dir / "tritonserver.log"
        self._log_file = None
        self.start_seconds: float | None = None

    # ----------------------------------------------------------------------------------------- urls

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metrics']}/metrics"

    # -------------------------------------------------------------------------------------- command

    def environment(self) -> dict[str, str]:
        inst = self.installation or find_installation()
        env = dict(os.environ)
        env.pop(ADMIN_KEY_ENV, None)  # the stubs run model code: they need no admin key
        env.update(self.extra_env)
        venv_bin = str(Path(sys.prefix) / "bin")
        env["PATH"] = os.pathsep.join([venv_bin, *[p for p in env.get("PATH", "").split(os.pathsep) if p]])
        if inst.libs is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                [str(inst.libs), *[p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]])
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Every stub is a process of its own: one BLAS/OpenMP thread each unless a model asks for more.
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, "1")
        return env

    def command(self) -> list[str]:
        inst = self.installation or find_installation()
        backends = self.work_dir / "backends" if inst.bundled else inst.backends
        cmd = [str(inst.binary), f"--model-repository={self.model_repository}", f"--backend-directory={backends}",
               f"--http-address={self.host}", f"--http-port={self.ports['http']}",
               f"--grpc-address={self.host}", f"--grpc-port={self.ports['grpc']}",
               f"--metrics-address={self.host}", f"--metrics-port={self.ports['metrics']}",
               "--allow-metrics=true", "--allow-gpu-metrics=false",
               "--disable-auto-complete-config", "--strict-readiness=true", "--exit-on-error=true",
               f"--model-control-mode={self.model_control}", f"--log-verbose={self.log_verbose}",
               f"--exit-timeout-secs={self.exit_timeout}"]
        cmd += [f"--load-model={m}" for m in self.load_models]
        if self.http_max_input_bytes is not None and self.size_limit_enforced:
            cmd.append(f"--http-max-input-size={int(self.http_max_input_bytes)}")
        if self.restricted_apis:
            apis = ",".join(self.restricted_apis)
            cmd += [f"--http-restricted-api={apis}:{ADMIN_HEADER}={self.admin_key}",
                    f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={self.admin_key}"]
        if not any(a.startswith("--cache-config") for a in self.extra_args):
            cmd += response_cache_flags(self.model_repository, inst)
        if not any(a.startswith("--rate-limit") for a in self.extra_args):
            cmd += rate_limit_flags(self.model_repository)
        return cmd + self.extra_args

    @property
    def size_limit_enforced(self) -> bool:
        """Whether this Triton caps HTTP request sizes itself (``--http-max-input-size``); if not, only a proxy can."""
        return "--http-max-input-size" in server_flags(self.installation or find_installation())

    def admin_headers(self, protocol: str = "http") -> dict[str, str]:
        """Headers that open this server's restricted APIs (see :func:`admin_headers`)."""
        return admin_headers(protocol, self.admin_key)

    # ---------------------------------------------------------------------------------- life cycle

    def start(self, timeout: float | None = None) -> TritonServer:
        """Start the server and wait until it is ready (all models loaded); raise :class:`ServerError`
        with the log's tail when it exits or is not ready within ``timeout`` seconds (default
        :attr:`start_timeout`)."""
        if self.process is not None:
            raise ServerError("server already started")
        inst = self.installation = self.installation or find_installation()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        prepare_backends(self.work_dir / "backends", inst)
        key_file = self.work_dir / "admin_key"
        key_file.unlink(missing_ok=True)
        key_file.touch(mode=0o600)
        key_file.write_text(self.admin_key + "\n")
        wanted = [k for k, v in self.ports.items() if v == 0]
        for k, p in zip(wanted, free_ports(len(wanted), self.host), strict=True):
            self.ports[k] = p
        if self.log_path.is_file() and self.log_path.stat().st_size:  # a restart keeps the previous run's log
            self.log_path.replace(self.log_path.with_suffix(".previous.log"))
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        t0 = time.perf_counter()
        log.info("starting tritonserver (http %s, grpc %s, metrics %s), log %s", self.ports["http"],
                 self.ports["grpc"], self.ports["metrics"], self.log_path)
        self.process = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=self.environment(), cwd=self.work_dir,
                                        start_new_session=True)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        log.info("tritonserver ready in %.1f s", self.start_seconds)
        return self

    def request(self, method: str, path: str, *, body: bytes | None = None, admin: bool = False,
                timeout: float = 2.0) -> tuple[int, bytes]:
        """One plain HTTP request to the server (``admin``: with the admin header); (status, body)."""
        conn = http.client.HTTPConnection(self.host, self.ports["http"], timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=self.admin_headers("http") if admin else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _get(self, path: str, timeout: float | None = None) -> int:
        return self.request("GET", path, timeout=self.probe_timeout if timeout is None else timeout)[0]

    def load_model(self, model: str, timeout: float = 300.0) -> None:
        """(Re)load ``model`` through the model-control API (explicit mode): a loaded one gets new instances."""
        self._control(model, "load", timeout)

    def unload_model(self, model: str, timeout: float = 60.0) -> None:
        """Unload ``model`` (explicit mode); with strict readiness the server answers not-ready until it is back."""
        self._control(model, "unload", timeout)

    def _control(self, model: str, action: str, timeout: float) -> None:
        status, body = self.request("POST", f"/v2/repository/models/{model}/{action}", admin=True, timeout=timeout)
        if status != 200:
            text = body[:300].decode(errors="replace")
            raise ServerError(f"{action} of model {model!r} failed: HTTP {status} {text}")

    def python_stubs(self) -> list[StubProcess]:
        """The Python-backend stub processes of this server (one per model instance), alive or not."""
        if self.process is None:
            return []
        return [s for pid in _group_members(self.process.pid) if (s := StubProcess.read(pid)) is not None]

    def is_ready(self) -> bool:
        try:
            return self._get("/v2/health/ready") == 200
        except OSError:
            return False

    def is_model_ready(self, model: str) -> bool:
        try:
            return self._get(f"/v2/models/{model}/ready") == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float | None = None) -> None:
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self.process is None:
                raise ServerError("server not started")
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"tritonserver exited with code {code} before it was ready "
                                  f"(log: {self.log_path})", _tail(self.log_path))
            if self.is_ready():
                return
            if time.monotonic() > deadline:
                raise ServerError(f"tritonserver not ready after {timeout:.0f} s (log: {self.log_path})",
                                  _tail(self.log_path))
            time.sleep(0.2)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, grace: float | None = None) -> int | None:
        """SIGINT (Triton unloads its models, stubs exit), then SIGKILL of the process group after ``grace``
        seconds (default: the exit timeout + 20 s); also kills any process left in the group. Returns the exit
        code (None if never started)."""
        grace = self.exit_timeout + 20.0 if grace is None else grace
        proc, self.process = self.process, None
        code = None
        if proc is not None:
            pgid = proc.pid  # start_new_session: the server leads its own group, stubs are in it
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    log.warning("tritonserver did not stop within %.0f s of SIGINT: killing it", grace)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
                    proc.wait()
            code = proc.returncode
            _reap_group(pgid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def __enter__(self) -> TritonServer:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class StubProcess:
    """One ``triton_python_backend_stub`` process: its model, instance (e.g. ``hift_0_0``) and whether it lives
    (a stub that died is a zombie until Triton unloads its model: Triton 2.51 neither reaps nor restarts it)."""

    pid: int
    model: str
    instance: str
    alive: bool
    shm_region: str = ""  # its shared-memory region in /dev/shm (the stub's second argument); "" for a zombie

    @classmethod
    def read(cls, pid: int) -> StubProcess | None:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if not argv or not argv[0].endswith(b"triton_python_backend_stub") or len(argv) < 2:
            # a zombie has an empty cmdline: name it from its stat line, find its model through the instance name
            if argv != [b""] or "(triton_python_b" not in stat:
                return None
            return cls(pid, "", "", alive=False)
        model_py = Path(argv[1].decode(errors="replace"))  # <repository>/<model>/<version>/model.py
        instance = argv[8].decode(errors="replace") if len(argv) > 8 else model_py.parent.parent.name
        state = stat.rsplit(")", 1)[-1].split()[0]
        region = argv[2].decode(errors="replace") if len(argv) > 2 else ""
        return cls(pid, model_py.parent.parent.name, instance, alive=state not in ("Z", "X"),
                   shm_region=region if _REGION_NAME.fullmatch(region) else "")


_REGION_NAME = re.compile(r"[A-Za-z0-9_.-]+")
SHM_DIR = Path("/dev/shm")
#: The Python backend's shared-memory regions under SHM_DIR (one per stub).
SHM_PATTERN = "triton_python_backend_shm_region_*"


def shm_region_users(paths: Sequence[Path]) -> dict[Path, list[int]]:
    """The live processes that map each of ``paths`` (from ``/proc/*/maps``; zombies map nothing)."""
    wanted = {str(p): p for p in paths}
    users: dict[Path, list[int]] = {p: [] for p in paths}
    if not wanted:
        return users
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            with open(entry / "maps", errors="replace") as maps:
                seen = {line.rstrip("\n").split(maxsplit=5)[-1].removesuffix(" (deleted)") for line in maps
                        if "/dev/shm/" in line}
        except OSError:
            continue
        for name in seen & wanted.keys():
            users[wanted[name]].append(int(entry.name))
    return users


def _group_members(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid:
                pids.append(int(entry.name))
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def _reap_group(pgid: int, wait: float = 5.0) -> None:
    """Wait for the processes left in the server's group (its Python stubs) to exit; kill them after ``wait``."""
    deadline = time.monotonic() + wait
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _group_members(pgid)
    if left:
        log.warning("killing %d process(es) left behind by tritonserver: %s", len(left), left)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
