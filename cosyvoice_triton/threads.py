"""How many intra-op threads the library computes on, and whether idle pool threads spin: chosen from the machine.

PyTorch's default is one thread per core it sees, and its OpenMP workers spin (busy-wait) after every parallel
region. Beside other busy processes that is ruinous: a parallel region ends when its slowest thread does, and a
thread that must share its core with a neighbour waits for its time slice, while the spinning threads take cores
the neighbours want. The in-process API (:meth:`~.pipeline.CosyVoice2.from_pretrained`), the in-process commands of
``cosyvoice-triton`` and the benches therefore choose, unless told:

1. an argument (``threads=``, ``--threads N``), then ``COSYVOICE_THREADS`` (a number, or ``auto``);
2. else ``OMP_NUM_THREADS`` (torch read it at its import: left as it is), or a count set with
   ``torch.set_num_threads`` before the library looked (torch reports another count than its start-up one, or
   than the library last set: left as it is);
3. else the rule of :func:`decide`: the cores this process may use (``os.sched_getaffinity``, the cgroup's CPU
   quota when readable) less what the rest of the machine keeps busy (the 1-minute load average less this
   process's own share, scaled to the allowed CPUs when the host has more), one thread per free core, at least 1.

Spinning (``COSYVOICE_SPINNING=0|1``, an argument, or ``OMP_WAIT_POLICY`` for torch): on only when every chosen
thread has a free core (within the same ``SLACK``). onnxruntime takes it per session
(``session.intra_op.allow_spinning``, :func:`ort_spinning`).
The OpenMP runtime of torch (GNU libgomp in the PyPI wheels) reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once,
when torch is imported; set later they do nothing, and ``KMP_BLOCKTIME`` is Intel OpenMP's, which these wheels do
not use. So :func:`prepare_environment` sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported (the command line
calls it first), and a program importing the library can call it before its own ``import torch``.

:func:`decide` is pure (the facts in, a :class:`ThreadChoice` with its reason out); :func:`machine` reads the facts.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger(__name__)

ENV_THREADS = "COSYVOICE_THREADS"
ENV_SPINNING = "COSYVOICE_SPINNING"
#: the OpenMP variables that fix torch's wait policy when set before its import (GNU libgomp reads both)
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: a core counts as free while the others keep it busy for at most this fraction of the time (a short ``ls`` or
#: a logger should not halve the threads; a neighbour that computes should)
SLACK = 0.25
#: the kernel's 1-minute load average: an exponential average over this many seconds
LOAD_WINDOW_S = 60.0
_ON, _OFF = {"1", "on", "true", "yes"}, {"0", "off", "false", "no"}


@dataclass(frozen=True)
class Machine:
    """What :func:`decide` needs to know about where it runs."""

    cpus_allowed: int  # len(os.sched_getaffinity(0))
    host_cpus: int  # the CPUs the load average counts over (os.cpu_count())
    quota: float | None = None  # the cgroup's CPU quota in CPUs; None: no quota, or not readable
    load: float | None = None  # the 1-minute load average; None: not readable
    own_load: float = 0.0  # this process's share of it (:func:`own_load`)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # intra-op threads (torch and the library's onnxruntime sessions)
    spinning: bool  # whether idle pool threads may spin
    set_torch: bool  # False: torch's count is the user's (OMP_NUM_THREADS, torch.set_num_threads): left alone
    source: str  # argument, COSYVOICE_THREADS, OMP_NUM_THREADS, torch.set_num_threads, auto
    free_cores: float  # the cores the rule sees free for this process
    reason: str


def _positive_int(value: str, what: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{what} must be a whole number >= 1 (or auto), got {value!r}")
    return n


def _flag(value: str, what: str) -> bool:
    v = str(value).strip().lower()
    if v in _ON | _OFF:
        return v in _ON
    raise ConfigError(f"{what} must be 1/on or 0/off, got {value!r}")


def capacity(m: Machine) -> int:
    """The cores this process may use: the allowed CPUs, fewer under a CPU quota (rounded down, at least 1)."""
    cores = max(1, m.cpus_allowed)
    if m.quota is not None and m.quota > 0:
        cores = min(cores, max(1, math.floor(m.quota)))
    return cores


def free_cores(m: Machine) -> float:
    """:func:`capacity` less the others' load: the load average less this process's share, spread evenly over the
    host's CPUs (the load average counts every CPU of the host, this process sees ``cpus_allowed`` of them)."""
    others = 0.0 if m.load is None else max(0.0, m.load - max(0.0, m.own_load))
    if m.host_cpus > m.cpus_allowed > 0:
        others *= m.cpus_allowed / m.host_cpus
    return max(0.0, capacity(m) - others)


def decide(m: Machine, *, threads: int | None = None, spinning: bool | None = None,
           env: Mapping[str, str] | None = None, torch_user_threads: int | None = None) -> ThreadChoice:
    """The thread count and spinning for machine ``m``, the caller's ``threads`` / ``spinning`` (None: not given),
    the environment ``env`` and torch's count when the user set it (``torch.set_num_threads``; None: not set)."""
    env = {} if env is None else env
    cap, free = capacity(m), free_cores(m)
    quota = "no CPU quota" if m.quota is None else f"CPU quota {m.quota:g}"
    load = ("load average not readable" if m.load is None else
            f"load average {m.load:.2f} ({m.own_load:.2f} of it this process's"
            + (f", the rest scaled to {m.cpus_allowed} of {m.host_cpus} CPUs" if m.host_cpus > m.cpus_allowed else "")
            + ")")
    facts = f"{m.cpus_allowed} CPU(s) allowed, {quota}, {load}: {free:.2f} core(s) free"
    env_threads = str(env.get(ENV_THREADS, "")).strip()
    set_torch = True
    if threads is not None:
        n, source = _positive_int(str(threads), "threads"), "argument"
    elif env_threads and env_threads.lower() != "auto":
        n, source = _positive_int(env_threads, ENV_THREADS), ENV_THREADS
    elif str(env.get("OMP_NUM_THREADS", "")).strip():
        n, source, set_torch = _positive_int(env["OMP_NUM_THREADS"], "OMP_NUM_THREADS"), "OMP_NUM_THREADS", False
    elif torch_user_threads is not None:
        n, source, set_torch = int(torch_user_threads), "torch.set_num_threads", False
    else:
        n, source = max(1, min(cap, math.floor(free + SLACK))), "auto"
    why = ("auto: one per free core, at least 1, a core free when others use at most "
           f"{SLACK:g} of it" if source == "auto" else f"set by {source}")
    if spinning is not None:
        spin, spin_why = bool(spinning), "spinning by argument"
    elif str(env.get(ENV_SPINNING, "")).strip():
        spin, spin_why = _flag(env[ENV_SPINNING], ENV_SPINNING), f"spinning by {ENV_SPINNING}"
    elif str(env.get("OMP_WAIT_POLICY", "")).strip():
        spin = str(env["OMP_WAIT_POLICY"]).strip().upper() == "ACTIVE"
        spin_why = "spinning as OMP_WAIT_POLICY says"
    else:
        spin = n > 1 and free + SLACK >= n
        spin_why = ("spinning: every thread has a free core" if spin else
                    "no spinning: one thread has no pool to spin" if n == 1 else
                    f"no spinning: {n} threads, {free:.2f} free cores")
    return ThreadChoice(n, spin, set_torch, source, free, f"{n} thread(s), {why}; {spin_why}; {facts}")


# -- the facts of this machine -------------------------------------------------------------------------------------

def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"max 100000"`` or ``"150000 100000"``) in CPUs; None: no quota."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_us: str, period_us: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in CPUs; None: no quota (-1)."""
    return parse_cpu_max(f"{quota_us.strip()} {period_us.strip()}") if quota_us.strip() != "-1" else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The smallest CPU quota over this process's cgroup and its parents (v2 ``cpu.max``, v1 CFS), in CPUs."""
    found: list[float] = []
    lines = (_read(proc_cgroup) or "").splitlines()
    for line in lines:
        hid, controllers, rel = [*line.split(":", 2), "", ""][:3]
        if hid == "0":
            base, reader = root, (lambda d: parse_cpu_max(_read(d / "cpu.max") or ""))
        elif "cpu" in controllers.split(","):
            base = next((root / n for n in (controllers, "cpu", "cpu,cpuacct") if (root / n).is_dir()), root / "cpu")
            reader = (lambda d: parse_cfs(_read(d / "cpu.cfs_quota_us") or "-1",
                                          _read(d / "cpu.cfs_period_us") or "100000"))
        else:
            continue
        d = base / rel.strip().lstrip("/")
        while True:
            if (q := reader(d)) is not None:
                found.append(q)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(found) if found else None


def own_load(stat: Path = Path("/proc/self/stat"), uptime: Path = Path("/proc/uptime")) -> float:
    """This process's share of the 1-minute load average: its CPU rate since it started (user + system time over
    its age) weighted as the kernel's average would have taken it in, ``rate * (1 - exp(-age / 60))``."""
    text, up = _read(stat), _read(uptime)
    if not text or not up:
        return 0.0
    try:
        fields = text.rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        cpu_s = (int(fields[11]) + int(fields[12])) / tick
        age = float(up.split()[0]) - int(fields[19]) / tick
    except (IndexError, ValueError, OSError):
        return 0.0
    if age <= 0:
        return 0.0
    return cpu_s / age * (1.0 - math.exp(-age / LOAD_WINDOW_S))


def machine() -> Machine:
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return Machine(cpus_allowed=allowed, host_cpus=os.cpu_count() or allowed, quota=cgroup_quota(), load=load,
                   own_load=own_load())


def torch_start_threads() -> int:
    """The count torch starts with when no variable sets it: one per physical core among the allowed CPUs (torch
    2.13 here follows the affinity: 2 CPUs allowed, 2 threads; ``taskset -c 0``, 1 thread)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        package, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        cores.add((package.strip(), core.strip()) if package and core else ("cpu", str(cpu)))
    return max(1, len(cores))


# -- applying it ---------------------------------------------------------------------------------------------------

_applied: ThreadChoice | None = None  # the last choice that set torch's count


def choose(threads: int | None = None, spinning: bool | None = None, *,
           env: Mapping[str, str] | None = None) -> ThreadChoice:
    """:func:`decide` on this machine and environment; a count the library set earlier by argument stays unless
    ``threads`` is given again, and one the library set by its rule is the library's to change."""
    env = os.environ if env is None else env
    user = None
    if "torch" in sys.modules:
        now = sys.modules["torch"].get_num_threads()
        if _applied is None:
            user = now if now != torch_start_threads() else None
        elif now != _applied.threads:
            user = now  # changed since the library set it
        elif threads is None and _applied.source != "auto" and ENV_THREADS not in env:
            threads = now  # an earlier explicit setting holds
    return decide(machine(), threads=threads, spinning=spinning, env=env, torch_user_threads=user)


def apply_torch(choice: ThreadChoice) -> ThreadChoice:
    """Set torch's intra-op count to the choice's (unless it is the user's); returns ``choice``."""
    global _applied
    if choice.set_torch:
        import torch

        torch.set_num_threads(choice.threads)
        _applied = choice
    log.info("threads: %s", choice.reason)
    return choice


def configure(threads: int | None = None, spinning: bool | None = None) -> ThreadChoice:
    """:func:`choose`, then :func:`apply_torch`: what the in-process entry points call."""
    return apply_torch(choose(threads, spinning))


def prepare_environment(threads: int | None = None, spinning: bool | None = None, *,
                        environ: MutableMapping[str, str] | None = None) -> ThreadChoice | None:
    """Before torch is imported: when the choice has no spinning and neither ``OMP_WAIT_POLICY`` nor
    ``GOMP_SPINCOUNT`` is set, set ``OMP_WAIT_POLICY=PASSIVE`` so that torch's OpenMP threads sleep when idle.
    Returns the choice, or None when torch is already imported (too late: the runtime has read the variables)."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules:
        return None
    choice = decide(machine(), threads=threads, spinning=spinning, env=environ)
    if not choice.spinning and not any(str(environ.get(v, "")).strip() for v in OPENMP_WAIT_VARS):
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return choice


def openmp_wait_policy(environ: Mapping[str, str] | None = None) -> str:
    """What torch's OpenMP threads do when idle, as far as the environment says (read at torch's import)."""
    environ = os.environ if environ is None else environ
    policy = str(environ.get("OMP_WAIT_POLICY", "")).strip().upper()
    count = str(environ.get("GOMP_SPINCOUNT", "")).strip()
    if policy == "PASSIVE" or count == "0":
        return "sleep (OMP_WAIT_POLICY=PASSIVE)" if policy == "PASSIVE" else "sleep (GOMP_SPINCOUNT=0)"
    if policy == "ACTIVE":
        return "spin (OMP_WAIT_POLICY=ACTIVE)"
    return f"spin a while, then sleep (libgomp's default{', GOMP_SPINCOUNT=' + count if count else ''})"


def ort_spinning(options, spinning: bool):
    """Set ``session.intra_op.allow_spinning`` on onnxruntime ``SessionOptions``; returns them."""
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return options
