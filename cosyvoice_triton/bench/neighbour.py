"""``cosyvoice-triton bench-neighbour``: the first streamed TTS chunk in process beside busy neighbours.

    cosyvoice-triton bench-neighbour [--model-dir models/cosyvoice2-demo-tiny] [--neighbours N] [--rounds R]

Starts ``N`` neighbour processes that keep a core busy each (a pure-Python loop; default: one per CPU this
process may use), waits until the 1-minute load average has caught up with them (``--settle-s``), then measures
a registered speaker's first streamed TTS chunk (as :mod:`.first_chunk` does) in one worker process per setting:

- ``torch-default``: torch's own thread count, its OpenMP threads spinning as they do by default (GNU libgomp:
  spin a while after each parallel region) and onnxruntime's spinning on (its default);
- ``torch-default-nospin``: the same count, ``OMP_WAIT_POLICY=PASSIVE`` and no onnxruntime spinning;
- ``library``: the library's choice (:mod:`~cosyvoice_triton.threads`: threads from the free cores, spinning
  only when every thread has a free core), made in the worker once the neighbours run;
- ``library-spin``: the library's thread count with spinning on.

Each worker loads the model and makes one cold call, then the rounds interleave the settings in a rotating order,
so that the load is alike for all. ``COSYVOICE_THREADS``, ``COSYVOICE_SPINNING``, ``OMP_NUM_THREADS`` and the
OpenMP wait variables are removed from the workers' environment: each setting is the bench's. Prints the load
average (before, after settling, at the end), the commit, the CPU model and its cores with the figures; ``--json``
writes them. The neighbours and the workers are stopped on every way out (an error, Ctrl-C, SIGTERM). Figures,
not assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SETTINGS = ("torch-default", "torch-default-nospin", "library", "library-spin")
DEFAULT_SETTINGS = ("torch-default", "torch-default-nospin", "library")
#: (threads: "torch" = torch's own count, "library" = the library's; spinning: on / off / the library's)
_SETTING = {"torch-default": ("torch", "on"), "torch-default-nospin": ("torch", "off"),
            "library": ("library", "auto"), "library-spin": ("library", "on")}
_CLEARED = ("COSYVOICE_THREADS", "COSYVOICE_SPINNING", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
            "GOMP_SPINCOUNT")
_MARK = "@@bench-neighbour "  # a worker's report lines (its logging goes to stderr)
#: a busy neighbour: pure Python, leaving on its own when the bench (its argument's pid) is no longer its parent,
#: since a killed bench cannot stop it
NEIGHBOUR = ("import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n"
             "    for _ in range(100_000):\n        pass\n")


# -- the worker: one setting, one model --------------------------------------------------------------------------

def _say(obj: dict) -> None:
    print(_MARK + json.dumps(obj), flush=True)


def worker(model_dir: Path, setting: str) -> int:
    """Load the model under ``setting``, make the cold call, then answer ``round`` lines on stdin."""
    from .. import threads as th

    which, spin = _SETTING[setting]
    spinning = {"on": True, "off": False, "auto": None}[spin]
    if which == "torch":
        if spinning is False:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        th.prepare_environment(spinning=spinning)  # before torch: the OpenMP runtime reads it at its start
    import torch

    from ..pipeline import CosyVoice2, StageTimer
    from .first_chunk import PROMPT_TEXT, TEXT, _first, _fixtures

    count = torch.get_num_threads() if which == "torch" else None
    ort_spin = True if which == "torch" and spinning is None else spinning
    model = CosyVoice2.from_pretrained(model_dir, tts=True, threads=count, spinning=ort_spin)
    model.register_speaker("bench", str(_fixtures() / "prompt_en_3s.wav"), prompt_text=PROMPT_TEXT)

    def one() -> dict:
        timer = StageTimer()
        seconds, stages, samples = _first(model.tts_stream(TEXT, speaker_id="bench", seed=0, timer=timer), timer)
        return {"first_chunk_s": seconds, "samples": samples, "stages_s": stages}

    choice = model.thread_choice
    _say({"ready": True, "threads": torch.get_num_threads(), "spinning": choice.spinning,
          "openmp_idle": th.openmp_wait_policy(), "reason": choice.reason, "cold": one()})
    for line in sys.stdin:
        if line.strip() != "round":
            break
        _say(one())
    return 0


# -- the parent: neighbours, workers, rounds ----------------------------------------------------------------------

class _Stop(Exception):
    pass


def _on_term(signum, frame):  # SIGTERM: leave through the finally blocks, as Ctrl-C does
    raise _Stop(f"signal {signum}")


class _Worker:
    """A worker process and a thread that hands its report lines over (so that waiting for one can time out)."""

    def __init__(self, name: str, model_dir: Path):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, "--worker", name, "--model-dir", str(model_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True, name=f"bench-neighbour-{name}").start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                self.lines.put(json.loads(line[len(_MARK):]))
        self.lines.put(None)

    def ask(self) -> None:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict:
        try:
            got = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no report within {timeout_s:.0f} s") from None
        if got is None:
            raise RuntimeError(f"{self.name}: the worker exited ({self.proc.wait()}) before reporting; its stderr "
                               "is above")
        return got


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _CLEARED}


def _allowed_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _settle(n: int, settle_s: float) -> float:
    """Wait until the 1-minute load average reaches 80 % of ``n`` or ``settle_s`` passes; the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < settle_s and os.getloadavg()[0] < 0.8 * n:
        time.sleep(min(2.0, settle_s))
    return time.monotonic() - t0


def ensure_model(model_dir: Path) -> Path:
    from ..models.demo import write_demo_model

    if not all((model_dir / n).is_file() for n in ("cosyvoice2.yaml", "flow.pt", "hift.pt", "llm.pt")):
        print(f"writing the tiny demo model to {model_dir} (once)", flush=True)
        write_demo_model(model_dir, size="tiny", seed=0)
    return model_dir


def run(model_dir: Path, *, neighbours: int, rounds: int, settings=DEFAULT_SETTINGS, settle_s: float = 60.0,
        timeout_s: float = 600.0) -> dict:
    from ..export.quality import cpu_description
    from ..loadtest.live import commit

    cpu, simd = cpu_description()
    report: dict = {"commit": commit(), "cpu": cpu, "simd": simd, "cpus": os.cpu_count(),
                    "cpus_allowed": _allowed_cpus(), "neighbours": neighbours, "rounds": rounds,
                    "model_dir": str(model_dir), "load_before": _loadavg(), "settings": {}}
    procs: list[subprocess.Popen] = []
    workers: dict[str, _Worker] = {}
    main = threading.current_thread() is threading.main_thread()  # only there can a signal handler go
    previous = signal.signal(signal.SIGTERM, _on_term) if main else None
    try:
        for _ in range(neighbours):
            procs.append(subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(os.getpid())], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, env=_env()))
        report["settled_s"] = round(_settle(neighbours, settle_s), 1) if neighbours else 0.0
        report["load_settled"] = _loadavg()
        print(f"{neighbours} neighbour(s) busy; load average {report['load_settled']} after "
              f"{report['settled_s']} s", flush=True)
        for name in settings:  # one at a time: a loading worker does not load the others' figures
            workers[name] = w = _Worker(name, model_dir)
            procs.append(w.proc)
            ready = w.read(timeout_s)
            report["settings"][name] = {k: ready[k] for k in ("threads", "spinning", "openmp_idle", "reason")}
            report["settings"][name].update(cold_s=ready["cold"]["first_chunk_s"], rounds_s=[])
            print(f"  {name}: {ready['threads']} thread(s), spinning {'on' if ready['spinning'] else 'off'}, "
                  f"OpenMP idle: {ready['openmp_idle']}; cold call {ready['cold']['first_chunk_s']:.2f} s", flush=True)
        names = list(settings)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # a rotating order
                workers[name].ask()
                got = workers[name].read(timeout_s)
                report["settings"][name]["rounds_s"].append(got["first_chunk_s"])
                print(f"  round {r + 1}/{rounds} {name}: {got['first_chunk_s']:.2f} s", flush=True)
    finally:
        _stop(procs)
        if main:
            signal.signal(signal.SIGTERM, previous)
    report["load_end"] = _loadavg()
    for s in report["settings"].values():
        if s["rounds_s"]:
            s["median_s"], s["min_s"] = statistics.median(s["rounds_s"]), min(s["rounds_s"])
    return report


def lines(report: dict) -> list[str]:
    out = [f"first streamed TTS chunk beside {report['neighbours']} busy neighbour(s); commit {report['commit']}; "
           f"{report['cpu']} ({report['simd']}), {report['cpus']} CPU(s), {report['cpus_allowed']} allowed; "
           f"load average {report['load_before']} before, {report['load_settled']} with the neighbours, "
           f"{report['load_end']} at the end (1, 5, 15 min); {report['rounds']} round(s) after a cold call",
           f"{'setting':<22} {'threads':>7} {'spin':>5} {'median s':>9} {'min s':>7}  cold s"]
    base = report["settings"].get("torch-default", {}).get("median_s")
    for name, s in report["settings"].items():
        med = s.get("median_s")
        ratio = f"  ({base / med:.1f}x torch-default)" if base and med and name != "torch-default" else ""
        out.append(f"{name:<22} {s['threads']:>7} {'on' if s['spinning'] else 'off':>5} "
                   f"{med if med is not None else float('nan'):>9.2f} "
                   f"{s.get('min_s', float('nan')):>7.2f}  {s['cold_s']:.2f}{ratio}")
    out += [f"  {name}: {s['reason']}; OpenMP idle: {s['openmp_idle']}" for name, s in report["settings"].items()]
    return out


def _settings(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in SETTINGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"settings are {', '.join(SETTINGS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cosyvoice-triton bench-neighbour", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path("models/cosyvoice2-demo-tiny"),
                   help="a model folder with llm.pt (the tiny demo is written there when missing)")
    p.add_argument("--neighbours", type=int, default=None, help="busy processes (default: the CPUs allowed)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per setting, interleaved")
    p.add_argument("--settings", type=_settings, default=DEFAULT_SETTINGS,
                   help=f"comma-separated, of {', '.join(SETTINGS)} (default: {','.join(DEFAULT_SETTINGS)})")
    p.add_argument("--settle-s", type=float, default=60.0,
                   help="longest wait for the load average to show the neighbours (0: none)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="longest wait for one worker's answer")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    p.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        return worker(ns.model_dir, ns.worker)
    neighbours = _allowed_cpus() if ns.neighbours is None else ns.neighbours
    if neighbours < 0 or ns.rounds < 0:
        p.error("--neighbours and --rounds must be >= 0")
    try:
        report = run(ensure_model(ns.model_dir), neighbours=neighbours, rounds=ns.rounds, settings=ns.settings,
                     settle_s=ns.settle_s, timeout_s=ns.timeout_s)
    except (_Stop, KeyboardInterrupt) as exc:
        print(f"bench-neighbour: stopped ({exc or 'Ctrl-C'}); the neighbours and workers are stopped",
              file=sys.stderr)
        return 1
    print("\n".join(lines(report)))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
