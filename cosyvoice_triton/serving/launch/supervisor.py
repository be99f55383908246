"""Keep a ``tritonserver`` serving without an operator: reload a model whose Python stub died, restart a server
that exited, and let readiness tell the truth in between.

Two ways a hostile request breaks Triton 2.51 that no model code can prevent:

* a binary input whose declared shape overflows the byte-size product (``[1, 2**62]`` FP32 with 0 bytes of data)
  passes Triton's size check; the Python backend's stub builds the numpy array before any model code runs, numpy
  raises "array is too big" outside the stub's error handling, and the stub dies. Triton neither restarts it nor
  marks the model unready: every later request fails "Stub process ... is not healthy" while
  ``/v2/health/ready`` answers 200;
* an HTTP JSON body nested ~100,000 levels deep overflows the stack of Triton's JSON parser: the server itself
  dies with SIGSEGV.

:class:`Supervisor` watches a :class:`~cosyvoice_triton.serving.launch.server.TritonServer` started with
``model_control="explicit"`` from a thread (or the foreground, :meth:`Supervisor.run`). Every ``interval`` s it
compares the server's stub processes with those it saw when the models were last loaded: a stub that died
(zombie or gone) gets its model unloaded at once (with ``--strict-readiness`` the server, and the ensemble that
uses the model, answer not-ready from then on) and loaded again (new stubs, ~2-3 s for a stage). A server that
exited is started again on the same ports after a backoff (``backoff`` s doubled per restart in the window, at most
``max_backoff``); more than ``max_restarts`` restarts within ``restart_window`` s and it gives up (:attr:`failed`;
the CLI exits 1 so that the orchestrator's restart policy takes over). Every action is logged and kept in
:attr:`events` with how long it took.

The blind spot is one ``interval``: between a stub's death and the next check the server still says ready.

Readiness while it acts: ``/v2/health/ready`` answers 400 from the unload of a model with a dead stub until its
load is done (``--strict-readiness``), and the port refuses connections from a server's exit until its restart is
ready; the supervisor has no endpoint of its own (``<work dir>/warm`` and the CLI's exit code are its signals).

Leftovers: each Python stub has a shared-memory region ``/dev/shm/triton_python_backend_shm_region_<uuid>`` (its
name is the stub's second argument). A stub or a server that dies can leave its regions behind (RAM that
nothing frees). The supervisor notes the region of every stub of its server it sees; once that stub is gone and no
live process but the server maps the region, it removes it (event ``shm-removed``): Triton 2.51 keeps a dead stub's
region mapped after it has unloaded the model, so that RAM comes back only when the server exits, but no longer
outlives it. Regions of other servers on the machine are never touched: only names read from this server's own
stubs are candidates.

After every (re)start and every reload it warms the server up (``warmup``, default
:func:`~cosyvoice_triton.serving.launch.warmup.warm_up`: one request through every public pipeline) from a thread of its
own, so that the checks go on meanwhile (a warm-up that waited on a stage killed during it would otherwise blind
the supervisor), and then writes ``<work dir>/warm`` (removed while a restart runs): the Kubernetes
``startupProbe`` waits for that file; :meth:`Supervisor.start` waits for the first warm-up. On SIGTERM
/ SIGINT the CLI stops watching and stops the server with SIGINT: Triton refuses new requests, finishes those in
flight (up to ``--exit-timeout`` s), unloads and exits; the CLI exits 0 (1 after giving up).

    server = TritonServer(repo, model_control="explicit", load_models=["*"])
    with Supervisor(server, interval=1.0):    # starts the server if needed, then watches it
        ...

CLI (the container's entry point runs it): ``python -m cosyvoice_triton.serving.launch.supervisor --model-repository
REPO [--triton-root /opt/tritonserver] [--host 127.0.0.1] [--http-port 8000] ...``. On a repository rendered with
versions (:mod:`~cosyvoice_triton.serving.launch.rollout`) it loads what :func:`~.rollout.startup_models` names (the
live version's pipeline, the router, and each versioned stage's versions of its config) instead of every model.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .rollout import RolloutError, startup_models
from .server import (
    SHM_DIR,
    SHM_PATTERN,
    ServerError,
    StubProcess,
    TritonInstallation,
    TritonServer,
    _tail,
    check_loopback,
    shm_region_users,
)
from .warmup import warm_up

log = logging.getLogger(__name__)

__all__ = ["Event", "Supervisor", "main", "models_to_load"]


def models_to_load(model_repository: str | Path) -> list[str]:
    """``--load-model`` of a supervised server: :func:`~.rollout.startup_models` for a versioned repository (loading
    every model would load the staged-only pipelines, whose versions the stages' ``version_policy`` leaves out),
    else ``["*"]``."""
    try:
        return startup_models(model_repository)
    except (RolloutError, OSError, ValueError):
        return ["*"]


@dataclass(frozen=True)
class Event:
    """Something the supervisor saw or did: ``kind`` is ``stub-died``, ``reloaded``, ``reload-failed``,
    ``server-exited``, ``restarted``, ``restart-failed``, ``gave-up``, ``warmed-up`` or ``shm-removed``;
    ``seconds``: how long the action took."""

    time: float  # time.time()
    kind: str
    detail: str
    seconds: float = 0.0


class Supervisor:
    """Watch ``server`` (see the module docstring).

    Args:
        server: started with ``model_control="explicit"`` (the reload goes through the model-control API).
        interval: seconds between two checks.
        max_restarts: server restarts allowed within ``restart_window`` seconds before it gives up.
        backoff, max_backoff: the wait before a restart, doubled per restart in the window, capped.
        start_timeout: seconds a (re)start, or the load of a reload, may take to become ready.
        unload_timeout: seconds the unload of a reload may take (it waits for the model's requests in flight);
            past it the server is restarted instead.
        warmup: called with the server after each (re)start and reload (returns model -> seconds or error);
            None: no warm-up.
    """

    def __init__(self, server: TritonServer, *, interval: float = 1.0, max_restarts: int = 5,
                 restart_window: float = 600.0, backoff: float = 1.0, max_backoff: float = 60.0,
                 start_timeout: float = 600.0, unload_timeout: float = 60.0,
                 warmup: Callable[[TritonServer], dict] | None = warm_up):
        if server.model_control != "explicit":
            raise ValueError("the supervisor reloads models through Triton's model-control API: start the server "
                             f"with model_control='explicit' (and load_models=['*']), not {server.model_control!r}")
        if (interval <= 0 or max_restarts < 0 or restart_window <= 0 or backoff < 0 or max_backoff < backoff
                or unload_timeout <= 0):
            raise ValueError("interval, restart_window and unload_timeout must be > 0, max_restarts and backoff "
                             ">= 0, max_backoff >= backoff")
        self.server = server
        self.interval, self.max_restarts, self.restart_window = float(interval), int(max_restarts), restart_window
        self.backoff, self.max_backoff, self.start_timeout = float(backoff), float(max_backoff), start_timeout
        self.unload_timeout = float(unload_timeout)
        self.warmup = warmup
        self.warm_file = server.work_dir / "warm"
        self._warming: threading.Thread | None = None
        self._warm_again = False
        self._warm_lock = threading.Lock()
        self.events: list[Event] = []
        self.failed: str | None = None
        self._stubs: dict[int, tuple[str, str]] = {}  # pid -> (model, instance) of the live stubs last seen
        self._regions: dict[str, int] = {}  # shared-memory region -> the pid of the stub it belongs to
        self._restarts: collections.deque[float] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ checks

    def _event(self, kind: str, detail: str, seconds: float = 0.0) -> Event:
        ev = Event(time.time(), kind, detail, seconds)
        self.events.append(ev)
        level = logging.ERROR if kind in ("gave-up", "reload-failed", "restart-failed") else logging.WARNING
        log.log(level, "supervisor: %s: %s%s", kind, detail, f" ({seconds:.1f} s)" if seconds else "")
        return ev

    def _remember_stubs(self) -> None:
        self._stubs = {}
        self._track(self.server.python_stubs())

    def _track(self, stubs: list[StubProcess]) -> list[StubProcess]:
        """Note the live stubs (those of a model loaded through the API too) and their shared-memory regions."""
        for s in stubs:
            if s.alive and s.model:
                self._stubs[s.pid] = (s.model, s.instance)
            if s.alive and s.shm_region:
                self._regions[s.shm_region] = s.pid
        return stubs

    def dead_models(self, stubs: list[StubProcess] | None = None) -> list[str]:
        """Models with a stub that died. A stub that Triton stopped itself (its model unloaded, or loaded again
        through the API: a rollout's reload) is reaped by Triton and gone; one that died is left a zombie, which
        Triton 2.51 neither reaps nor replaces. A zombie seen once is looked at again a moment later (Triton reaps
        the stubs it stops at once); a stub gone without a live successor of its instance while its model says
        ready counts as dead too."""
        stubs = self.server.python_stubs() if stubs is None else stubs
        now = {s.pid: s for s in stubs}
        live = {(s.model, s.instance) for s in stubs if s.alive}
        zombies = [pid for pid in self._stubs if pid in now and not now[pid].alive]
        if zombies:
            time.sleep(0.3)
        dead = set()
        for pid, (model, instance) in list(self._stubs.items()):
            if pid in zombies:
                again = StubProcess.read(pid)
                if again is not None and not again.alive:
                    dead.add(model)
                    continue
            elif pid in now:
                continue
            del self._stubs[pid]  # stopped by Triton
            if (model, instance) not in live and self.server.is_model_ready(model):
                dead.add(model)
        return sorted(dead)

    def sweep_regions(self) -> list[str]:
        """Remove the shared-memory regions of this server's stubs that are gone, once no live process but the
        running tritonserver maps them (nothing opens a dead stub's region by name again); returns the names
        removed."""
        alive = {s.pid for s in self.server.python_stubs() if s.alive}
        gone = [name for name, pid in self._regions.items() if pid not in alive]
        if not gone:
            return []
        paths = {name: SHM_DIR / name for name in gone}
        for name, path in paths.items():
            if not path.exists():
                del self._regions[name]
        users = shm_region_users([paths[n] for n in gone if n in self._regions])
        server = self.server.process.pid if self.server.running else None
        removed, freed = [], 0
        for path, pids in users.items():
            if set(pids) - {server}:
                continue
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("supervisor: cannot remove %s: %s", path, exc)
                continue
            del self._regions[path.name]
            removed.append(path.name)
        if removed:
            self._event("shm-removed", f"{len(removed)} shared-memory region(s) of dead stubs ({freed / 2**20:.0f} "
                                       f"MiB, freed once no process maps them): {', '.join(sorted(removed))}")
        return removed

    def check(self) -> None:
        """One round: restart the server if it exited, else reload every model with a dead stub; then remove the
        shared-memory regions that dead stubs left."""
        if self.failed:
            return
        if not self.server.running:
            self._restart()
        else:
            stubs = self._track(self.server.python_stubs())
            for model in self.dead_models(stubs):
                self._reload(model)
        self.sweep_regions()

    def _reload(self, model: str) -> None:
        self._event("stub-died", f"a Python stub of model {model!r} died: unloading it (not ready) and loading it")
        t0 = time.monotonic()
        try:
            self.server.unload_model(model, timeout=self.unload_timeout)
            # the unload waits for the model's in-flight requests (one may wait on the dead stub): load only once
            # it is done, or the load would be folded into it and readiness would never go false
            deadline = time.monotonic() + self.start_timeout
            while self.server.is_model_ready(model) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.server.load_model(model, timeout=self.start_timeout)
        except (ServerError, OSError) as exc:
            self._event("reload-failed", f"{model}: {exc}; restarting the server", time.monotonic() - t0)
            self.server.stop(grace=10.0)
            self._restart()
            return
        self._stubs = {pid: mi for pid, mi in self._stubs.items() if mi[0] != model}
        self._track(self.server.python_stubs())
        self._event("reloaded", model, time.monotonic() - t0)
        self.warm_up_soon()

    def _restart(self) -> None:
        proc = self.server.process
        code = proc.returncode if proc is not None else None
        self._event("server-exited", f"tritonserver exited with code {code}; log tail:\n"
                                     f"{_tail(self.server.log_path, 8)}")
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.restart_window:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            self.failed = (f"tritonserver exited {len(self._restarts) + 1} times within {self.restart_window:.0f} s "
                           f"(max_restarts={self.max_restarts}): giving up (log: {self.server.log_path})")
            self._event("gave-up", self.failed)
            self.server.stop(grace=10.0)
            self.sweep_regions()
            return
        delay = min(self.max_backoff, self.backoff * 2 ** len(self._restarts))
        self._restarts.append(now)
        if self._stop.wait(delay):
            return
        self.server.stop(grace=10.0)  # closes the log, reaps what is left of the process group
        self.warm_file.unlink(missing_ok=True)
        t0 = time.monotonic()
        try:
            self.server.start(timeout=self.start_timeout)
        except ServerError as exc:
            self._event("restart-failed", str(exc).splitlines()[0], time.monotonic() - t0)
            return
        self._remember_stubs()
        self._event("restarted", f"tritonserver ready again on http {self.server.http_url}, grpc "
                                 f"{self.server.grpc_url} (restart {len(self._restarts)} in the window)",
                    time.monotonic() - t0)
        self.warm_up_soon()

    def first_start(self) -> None:
        """Start the server; one that dies or hangs before it is ready (a Python stub failing under memory
        pressure, say) is stopped, the shared-memory regions its try left behind are removed, and it is started
        again after the backoff, within the restart budget (``max_restarts``). Raises the last
        :class:`~.server.ServerError` when the budget is spent or :meth:`stop` was asked."""
        self.warm_file.unlink(missing_ok=True)
        tries = 0
        while True:
            before = set(SHM_DIR.glob(SHM_PATTERN))
            t0 = time.monotonic()
            try:
                self.server.start(timeout=self.start_timeout)
                return
            except ServerError as exc:
                self.server.stop(grace=10.0)
                self._remove_orphans(set(SHM_DIR.glob(SHM_PATTERN)) - before)
                first = str(exc).splitlines()[0]
                if tries >= self.max_restarts or self._stop.is_set():
                    self.failed = f"tritonserver did not start in {tries + 1} tries: {first}"
                    self._event("gave-up", self.failed, time.monotonic() - t0)
                    raise
                delay = min(self.max_backoff, self.backoff * 2 ** tries)
                tries += 1
                self._event("start-failed", f"{first}; try {tries + 1} of {self.max_restarts + 1} in {delay:g} s",
                            time.monotonic() - t0)
                if self._stop.wait(delay):
                    raise

    def _remove_orphans(self, paths: set[Path]) -> None:
        """Remove those of ``paths`` (regions that appeared during a failed start) that no process maps."""
        users = shm_region_users(sorted(paths)) if paths else {}
        removed = []
        for path in sorted(paths):
            if users.get(path):
                continue
            try:
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("supervisor: cannot remove %s: %s", path, exc)
        if removed:
            self._event("shm-removed", f"{len(removed)} shared-memory region(s) left by a failed start: "
                                       f"{', '.join(removed)}")

    def warm_up_soon(self) -> threading.Thread | None:
        """Run :meth:`warm_up` in a thread (once more after it if asked again while it runs); returns the thread."""
        with self._warm_lock:
            if self._warming is not None and self._warming.is_alive():
                self._warm_again = True
                return self._warming
            self._warming = threading.Thread(target=self._warm_loop, name="triton-warm-up", daemon=True)
            self._warming.start()
            return self._warming

    def _warm_loop(self) -> None:
        while True:
            self.warm_up()
            with self._warm_lock:
                if not self._warm_again or self._stop.is_set():
                    self._warm_again = False
                    return
                self._warm_again = False

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up in progress (if any); True when none is left running."""
        thread = self._warming
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def warm_up(self) -> dict:
        """Run :attr:`warmup` on the server, then write :attr:`warm_file`; returns what it returned."""
        if self.warmup is None:
            self.warm_file.write_text("no warm-up\n")
            return {}
        t0 = time.monotonic()
        try:
            done = self.warmup(self.server)
        except Exception as exc:  # the server serves cold: never fatal
            done = {"*": f"{type(exc).__name__}: {exc}"}
        cold = {k: v for k, v in done.items() if isinstance(v, str)}
        self._event("warmed-up", f"{len(done) - len(cold)} pipeline(s) warm" + (f"; failed: {cold}" if cold else ""),
                    time.monotonic() - t0)
        self.warm_file.write_text(json.dumps(done) + "\n")
        return done

    # -------------------------------------------------------------------------------------- life cycle

    def run(self) -> None:
        """Check every ``interval`` s until :meth:`stop` or until it gives up (the foreground form)."""
        if not self._stubs:
            self._remember_stubs()
        while not self._stop.wait(self.interval) and not self.failed:
            try:
                self.check()
            except Exception:  # a supervisor that dies protects nothing: log and go on
                log.exception("supervisor: check failed")

    def start(self) -> Supervisor:
        """Start the server if it is not running, then watch it from a daemon thread."""
        started = not self.server.running
        if started:
            self.first_start()
        self._remember_stubs()
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="triton-supervisor", daemon=True)
        self._thread.start()
        if started:
            self.warm_up_soon()
            self.wait_warm(self.start_timeout)
        return self

    def stop(self) -> None:
        """Stop watching (the server keeps running)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.start_timeout + 30.0)
            self._thread = None

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.server.stop()
        self.sweep_regions()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.serving.launch.supervisor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", required=True, help="the rendered repository")
    p.add_argument("--triton-root", default=None,
                   help="an installed Triton (e.g. /opt/tritonserver); default: the nvidia-pytriton wheel's")
    p.add_argument("--work-dir", default=None, help="log and admin key folder (default <repository>/../triton)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address Triton's ports bind to; beyond loopback only with --public-triton")
    p.add_argument("--public-triton", action="store_true",
                   help="allow a Triton address beyond loopback (its own ports have no keys: put a proxy in front)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--restart-window", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=1800.0)
    p.add_argument("--unload-timeout", type=float, default=60.0,
                   help="seconds the unload of a model with a dead stub may take before the server is restarted")
    p.add_argument("--exit-timeout", type=int, default=30,
                   help="on SIGTERM, seconds Triton waits for the requests in flight before it unloads anyway")
    p.add_argument("--no-warmup", action="store_true", help="do not send warm-up requests after (re)loads")
    p.add_argument("extra", nargs="*", help="more tritonserver flags (after --)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_loopback(args.host, args.extra, args.public_triton)
    except ValueError as exc:
        p.error(str(exc))
    inst = TritonInstallation.at(args.triton_root) if args.triton_root else None
    server = TritonServer(args.model_repository, work_dir=args.work_dir, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, model_control="explicit",
                          load_models=models_to_load(args.model_repository), extra_args=args.extra,
                          installation=inst, exit_timeout=args.exit_timeout, public=args.public_triton)
    sup = Supervisor(server, interval=args.interval, max_restarts=args.max_restarts,
                     restart_window=args.restart_window, start_timeout=args.start_timeout,
                     unload_timeout=args.unload_timeout, warmup=None if args.no_warmup else warm_up)

    def on_signal(signum, frame):
        log.warning("signal %d: stopping; requests in flight finish first (up to %d s)", signum, args.exit_timeout)
        sup._stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        sup.first_start()
    except ServerError as exc:
        sup.sweep_regions()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not sup._stop.is_set():
        sup.warm_up_soon()  # the checks start at once; the warm file appears when it is done
    print(f"serving {Path(args.model_repository)}: http {server.http_url}, grpc {server.grpc_url}, metrics "
          f"{server.metrics_url}; log {server.log_path}; admin key (restricted APIs) in "
          f"{server.work_dir / 'admin_key'}", flush=True)
    try:
        sup.run()
    finally:
        code = server.stop()
        sup.sweep_regions()
        sup.warm_file.unlink(missing_ok=True)
        log.info("tritonserver stopped (exit code %s)", code)
    if sup.failed:
        print(f"error: {sup.failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
