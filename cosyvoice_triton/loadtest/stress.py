"""Stress mode (``loadtest/run.py --mode stress``): innocent traffic beside hostile clients, through the gateway, on
one real ``tritonserver``; judged on the innocent requests and on memory. Triton's own QA stresses with crashing
clients and broken sequences (``L0_long_running_stress``) under a memory-growth limit (``L0_memory_growth``); this is
the same at the gateway, the door of this deployment.

One server (the integrated repository, its live models' idle time ``live_idle_timeout_s`` short so that abandoned
sessions are reclaimed within the run) and the gateway in front of it (``python -m cosyvoice_triton.gateway``, two
tenants' keys: ``innocent`` and ``hostile``). For ``--stress-seconds``:

* ``--stress-users`` innocent users (the ``innocent`` key) in turn: a ``cosyvoice_vc`` conversion over the gateway's
  HTTP ``/v2`` and over its gRPC port, a whole live VC session (start, pieces, end) over a gRPC stream (at most as
  many users at once as the tenant's live share), ``/health``. Each must succeed: a failed innocent request fails
  the run;
* ``--stress-hostile-users`` hostile users (the ``hostile`` key), each act drawn at random: a client that vanishes
  mid-request (half a body sent, then the socket closed), one that vanishes mid-answer (closed after the first
  bytes of the answer), one that cancels a streamed conversion after its first chunk, a live sequence without its
  start, a live session without its end (the stream closed, or cancelled, after its first pieces), and requests
  that time out (a gRPC deadline of a few ms, an HTTP client that gives up). Their outcomes are counted, not judged.

Memory: the resident set of Triton's process tree and of the gateway sampled every second; start (the peak of the
first window after the warm-up), end (the peak of the last window), the peak, and the growth from start to end,
printed and written to ``report.json`` / ``report.md``. Verdict: 0 failed innocent requests (the innocent kinds
once more after the run included), both growths under ``--stress-max-growth``, the server and the gateway alive, and
the hostile key served again once its acts stopped (a slot a vanished, cancelled or timed-out request kept for good
would lock it out: the stress mode found one, a stream cancelled while a request was checked,
``tests/unit/test_gateway_stream_slots.py``).

    cosyvoice-triton loadtest --mode stress --stress-seconds 1800 --stress-users 4 --stress-hostile-users 8
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import random
import socket
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .setup import FIXTURES, Options, ensure_assets, gateway, machine, render

log = logging.getLogger(__name__)

__all__ = ["StressResult", "memory_figures", "run_stress", "stress_markdown"]

INNOCENT_KEY, HOSTILE_KEY = "sk-stress-innocent", "sk-stress-hostile"
VC, VC_STREAM, VC_LIVE = "cosyvoice_vc", "cosyvoice_vc_stream", "cosyvoice_vc_live"
#: The live models' idle time in this mode: a session left without its end is reclaimed after it.
LIVE_IDLE_S = 5.0
#: Innocent clients' patience: far beyond any answer on a loaded machine; a request past it is a failure.
PATIENCE_S = 300.0
#: The live share of each tenant on cosyvoice_vc_live (the gateway's default, half the model's 4 sessions).
LIVE_SHARE = 2
HOSTILE_ACTS = ("vanish_mid_request", "vanish_mid_answer", "cancel_mid_stream", "live_without_start",
                "live_without_end", "live_cancelled", "grpc_deadline", "http_gives_up")
INNOCENT_KINDS = ("vc_http", "vc_grpc", "live", "health")


@dataclass
class StressResult:
    seconds: float
    users: int
    hostile_users: int
    innocent: Counter = field(default_factory=Counter)  # kind -> answered
    innocent_failures: list[str] = field(default_factory=list)
    hostile: Counter = field(default_factory=Counter)  # "act: outcome" -> count
    latencies: dict[str, list[float]] = field(default_factory=dict)
    memory: list[tuple[float, float, float]] = field(default_factory=list)  # (t, triton MB, gateway MB)


# ---------------------------------------------------------------------------------------------- requests


def _audio() -> dict[str, tuple[np.ndarray, int]]:
    import soundfile as sf

    src, ssr = sf.read(FIXTURES / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    return {"source": (src[: 2 * ssr], ssr), "prompt": (prm[: int(1.5 * psr)], psr)}


def _vc_request(audio, model: str = VC, request_id: str = "s"):
    from tritonclient.grpc import service_pb2

    (src, ssr), (prm, psr) = audio["source"], audio["prompt"]
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, value in (("source_audio", src), ("prompt_audio", prm)):
        req.inputs.add(name=name, datatype="FP32", shape=[1, len(value)])
        req.raw_input_contents.append(np.ascontiguousarray(value, "<f4").tobytes())
    for name, rate in (("source_sample_rate", ssr), ("prompt_sample_rate", psr)):
        req.inputs.add(name=name, datatype="INT32", shape=[1, 1])
        req.raw_input_contents.append(np.array([rate], "<i4").tobytes())
    return req


def _vc_http_body(audio) -> tuple[bytes, dict[str, str]]:
    """A KServe ``infer`` body of ``cosyvoice_vc`` with the binary tensor extension."""
    (src, ssr), (prm, psr) = audio["source"], audio["prompt"]
    tensors = [("source_audio", "FP32", src[None].astype("<f4")), ("source_sample_rate", "INT32",
                                                                    np.array([[ssr]], "<i4")),
               ("prompt_audio", "FP32", prm[None].astype("<f4")), ("prompt_sample_rate", "INT32",
                                                                    np.array([[psr]], "<i4"))]
    head = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": list(a.shape),
                                   "parameters": {"binary_data_size": a.nbytes}} for n, d, a in tensors],
                       "outputs": [{"name": "waveform", "parameters": {"binary_data": True}}]}).encode()
    return head + b"".join(a.tobytes() for _, _, a in tensors), {
        "content-type": "application/octet-stream", "inference-header-content-length": str(len(head))}


def _live_piece(audio, sequence_id: int, k: int, *, start=False, end=False):
    from tritonclient.grpc import service_pb2

    (src, ssr), (prm, psr) = audio["source"], audio["prompt"]
    req = service_pb2.ModelInferRequest(model_name=VC_LIVE, id=f"p{k}")
    req.parameters["sequence_id"].int64_param = sequence_id
    req.parameters["sequence_start"].bool_param = start
    req.parameters["sequence_end"].bool_param = end
    n = int(0.4 * ssr)
    piece = src[k * n: (k + 1) * n] if not end else src[:0]
    req.inputs.add(name="source_audio", datatype="FP32", shape=[1, len(piece)])
    req.raw_input_contents.append(np.ascontiguousarray(piece, "<f4").tobytes())
    if start:
        for name, dt, value in (("source_sample_rate", "INT32", np.array([ssr], "<i4")),
                                ("prompt_audio", "FP32", np.ascontiguousarray(prm, "<f4")),
                                ("prompt_sample_rate", "INT32", np.array([psr], "<i4"))):
            req.inputs.add(name=name, datatype=dt, shape=[1, value.size])
            req.raw_input_contents.append(value.tobytes())
    return req


class _Requests:
    """A stream's request iterator the caller feeds (``put``) and ends (``close``): the stream stays open until then,
    so that a decoupled model's answers come in full."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def put(self, req) -> None:
        self.q.put(req)

    def close(self) -> None:
        self.q.put(None)

    def __iter__(self):
        while (req := self.q.get()) is not None:
            yield req


def _final(answer) -> bool:
    p = answer.infer_response.parameters.get("triton_final_response")
    return p is not None and p.bool_param


class Door:
    """The gateway's two entry points and the calls the users make on them."""

    def __init__(self, http: str, grpc_address: str):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.http, self.grpc_address = http, grpc_address
        self.channel = grpc.insecure_channel(grpc_address, options=[("grpc.max_receive_message_length", -1)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    @staticmethod
    def metadata(key: str):
        return [("authorization", f"Bearer {key}")]

    def http_post(self, path: str, body: bytes, headers: dict[str, str], key: str,
                  timeout: float = PATIENCE_S) -> tuple[int, bytes]:
        import http.client

        host, port = self.http.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={**headers, "authorization": f"Bearer {key}"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def live_session(self, audio, key: str, sequence_id: int, pieces: int, *, end: bool = True,
                     start: bool = True, cancel_after: int | None = None) -> list:
        """A live VC session over one gRPC stream: its answers (each request's final or error awaited before the
        stream is closed). ``cancel_after``: the call is cancelled once that many answers came."""
        reqs = _Requests()
        call = self.stub.ModelStreamInfer(iter(reqs), metadata=self.metadata(key), timeout=PATIENCE_S)
        sent = 0
        for k in range(pieces):
            req = _live_piece(audio, sequence_id, k, start=start and k == 0)
            req.parameters["triton_enable_empty_final_response"].bool_param = True
            reqs.put(req)
            sent += 1
        if end:
            req = _live_piece(audio, sequence_id, pieces, end=True)
            req.parameters["triton_enable_empty_final_response"].bool_param = True
            reqs.put(req)
            sent += 1
        answers, done = [], 0
        try:
            for a in call:
                answers.append(a)
                done += bool(a.error_message) or _final(a)
                if cancel_after is not None and len(answers) >= cancel_after:
                    call.cancel()
                    return answers
                if done >= sent:
                    break
            reqs.close()  # every request answered: the client closes its side, the stream ends
            answers += list(call)
        finally:
            reqs.close()
        return answers


# ---------------------------------------------------------------------------------------------- users


def _innocent(door: Door, audio, kind: str, sequence_id: int) -> None:
    """One innocent request of ``kind``; raises (naming what went wrong) unless it succeeded."""
    if kind == "vc_http":
        body, headers = _vc_http_body(audio)
        status, answer = door.http_post(f"/v2/models/{VC}/infer", body, headers, INNOCENT_KEY)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {answer[:200]!r}")
    elif kind == "vc_grpc":
        answer = door.stub.ModelInfer(_vc_request(audio), metadata=door.metadata(INNOCENT_KEY), timeout=PATIENCE_S)
        if not answer.outputs:
            raise RuntimeError("no outputs")
    elif kind == "live":
        answers = door.live_session(audio, INNOCENT_KEY, sequence_id, pieces=3)
        errors = [a.error_message for a in answers if a.error_message]
        if errors or sum(_final(a) for a in answers) != 4:
            raise RuntimeError(f"live session: errors {errors[:2]}, {sum(_final(a) for a in answers)} of 4 finals")
    elif kind == "health":
        with urllib.request.urlopen(f"http://{door.http}/health", timeout=PATIENCE_S) as r:
            if r.status != 200:
                raise RuntimeError(f"/health {r.status}")
    else:
        raise ValueError(kind)


def _raw(door: Door, data: bytes, *, read: int = 0, timeout: float = 30.0) -> str:
    """Send ``data`` and vanish (after the first ``read`` bytes of the answer): -> what came, for the report."""
    host, port = door.http.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return "vanished"
        got = s.recv(read)
        return f"vanished after HTTP {got[9:12].decode(errors='replace')}" if got.startswith(b"HTTP/") else \
            "vanished unanswered"


def _session_outcome(answers, done: str) -> str:
    """``refused`` (an answer with an error: a limit, an unknown id), ``done`` (what the client did), or ``no
    answer`` before it gave up."""
    if any(a.error_message for a in answers):
        return "refused"
    return done if answers else "no answer"


def _hostile(door: Door, audio, act: str, rng: random.Random) -> str:
    """One hostile act; -> its outcome (a word for the report)."""
    import grpc

    body, headers = _vc_http_body(audio)
    head = (f"POST /v2/models/{VC}/infer HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {HOSTILE_KEY}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + f"content-length: {len(body)}\r\n\r\n").encode()
    sid = rng.randrange(1, 2**62)
    try:
        if act == "vanish_mid_request":
            return _raw(door, head + body[: rng.randrange(1, len(body))])
        if act == "vanish_mid_answer":
            return _raw(door, head + body, read=rng.randrange(12, 64), timeout=PATIENCE_S)
        if act == "cancel_mid_stream":
            call = door.stub.ModelStreamInfer(iter([_vc_request(audio, VC_STREAM)]),
                                              metadata=door.metadata(HOSTILE_KEY), timeout=PATIENCE_S)
            answers = []
            for a in call:
                answers.append(a)
                call.cancel()
                break
            return _session_outcome(answers, "cancelled after its first chunk")
        if act == "live_without_start":
            answers = door.live_session(audio, HOSTILE_KEY, sid, pieces=2, start=False)
            return "refused" if all(a.error_message for a in answers) else "answered"
        if act == "live_without_end":
            return _session_outcome(door.live_session(audio, HOSTILE_KEY, sid, pieces=2, end=False),
                                    "closed without its end")
        if act == "live_cancelled":
            return _session_outcome(door.live_session(audio, HOSTILE_KEY, sid, pieces=3, end=False, cancel_after=1),
                                    "cancelled without its end")
        if act == "grpc_deadline":
            door.stub.ModelInfer(_vc_request(audio), metadata=door.metadata(HOSTILE_KEY),
                                 timeout=rng.choice([0.005, 0.05, 0.3]))
            return "answered in time"
        if act == "http_gives_up":
            status, _ = door.http_post(f"/v2/models/{VC}/infer", body, headers, HOSTILE_KEY,
                                       timeout=rng.choice([0.05, 0.3]))
            return f"HTTP {status}"
        raise ValueError(act)
    except grpc.RpcError as exc:
        return exc.code().name
    except (OSError, TimeoutError) as exc:
        return type(exc).__name__


# ---------------------------------------------------------------------------------------------- memory


def memory_figures(samples: list[tuple[float, float, float]], window_s: float) -> dict[str, dict[str, float]]:
    """Per process (``triton``, ``gateway``): start (the peak of the first ``window_s``), end (the peak of the last
    ``window_s``), the peak, all in MB, the growth from start to end, and the slope (MB/s) of a least-squares line
    through the samples past the first window. Peaks, not means: RSS rises and falls with each wave of requests,
    and a window's peak holds a whole wave."""
    out = {}
    if not samples:
        return out
    t0, t1 = samples[0][0], samples[-1][0]
    for i, name in ((1, "triton"), (2, "gateway")):
        first = [s[i] for s in samples if s[0] <= t0 + window_s]
        last = [s[i] for s in samples if s[0] >= t1 - window_s]
        start, end = max(first), max(last)
        past = np.array([(s[0], s[i]) for s in samples if s[0] > t0 + window_s]).reshape(-1, 2)
        slope = float(np.polyfit(past[:, 0], past[:, 1], 1)[0]) if len(past) >= 2 else math.nan
        out[name] = {"start_mb": start, "end_mb": end, "peak_mb": max(s[i] for s in samples),
                     "growth": end / start - 1.0 if start else math.nan, "slope_mb_s": slope}
    return out


def memory_series(samples: list[tuple[float, float, float]], points: int = 400) -> list[tuple[float, float, float]]:
    """The samples as (seconds from the first, triton MB, gateway MB), at most about ``points`` of them: each the
    peak of its stretch, so that the trajectory keeps what the windows' figures are taken from."""
    if not samples:
        return []
    t0, step = samples[0][0], max(1, -(-len(samples) // points))
    out = []
    for i in range(0, len(samples), step):
        part = samples[i: i + step]
        out.append((round(part[0][0] - t0, 1), round(max(s[1] for s in part), 1), round(max(s[2] for s in part), 1)))
    return out


class _Memory:
    def __init__(self, triton_pid: int, gateway_pid: int, every_s: float = 1.0):
        self.pids, self.every_s = (triton_pid, gateway_pid), every_s
        self.samples: list[tuple[float, float, float]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        from .sampler import sample_tree

        triton, gateway = (sample_tree(p).rss_bytes / 2**20 for p in self.pids)
        self.samples.append((time.monotonic(), triton, gateway))

    def _run(self) -> None:
        while not self.stopping.wait(self.every_s):
            with contextlib.suppress(Exception):
                self.sample()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join()


# ---------------------------------------------------------------------------------------------- the run


@contextlib.contextmanager
def _gateway(server, work: Path):
    with gateway(server, work, {"innocent": INNOCENT_KEY, "hostile": HOSTILE_KEY}, "--open-metrics",
                 "--sequence-idle-s", str(LIVE_IDLE_S + 5), "--log-level", "warning",
                 patience_s=PATIENCE_S) as (proc, http, grpc_door):
        yield proc, Door(http, grpc_door)


def _slots_come_back(door: Door, audio) -> bool:
    """Whether the hostile key is served again once its acts have stopped and its abandoned sessions are reclaimed:
    a slot that a vanished, cancelled or timed-out request kept for good would lock the key out."""
    import grpc

    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        try:
            door.stub.ModelInfer(_vc_request(audio), metadata=door.metadata(HOSTILE_KEY), timeout=PATIENCE_S)
            return True
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False
        time.sleep(1.0)
    return False


def _drive(door: Door, audio, opts: Options, result: StressResult) -> None:
    """The users, for ``opts.stress_seconds``; the hostile ones stop first, the innocent ones finish their
    request."""
    stop, lock = threading.Event(), threading.Lock()
    kinds, acts = opts.stress_kinds or INNOCENT_KINDS, opts.stress_acts or HOSTILE_ACTS

    def innocent(i: int) -> None:
        rng = random.Random(opts.seed * 1000 + i)
        k = i
        while not stop.is_set():
            kind = kinds[k % len(kinds)]
            k += 1
            if kind == "live" and i >= LIVE_SHARE:  # the tenant's live share: no more sessions at once
                kind = "vc_grpc" if "vc_grpc" in kinds else "health"
            t0 = time.perf_counter()
            try:
                _innocent(door, audio, kind, rng.randrange(1, 2**62))
            except Exception as exc:
                with lock:
                    result.innocent_failures.append(f"{kind}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            with lock:
                result.innocent[kind] += 1
                result.latencies.setdefault(kind, []).append(time.perf_counter() - t0)

    def hostile(i: int) -> None:
        rng = random.Random(opts.seed * 1000 + 500 + i)
        while not stop.is_set():
            act = rng.choice(acts)
            outcome = _hostile(door, audio, act, rng)
            with lock:
                result.hostile[f"{act}: {outcome}"] += 1

    threads = [threading.Thread(target=innocent, args=(i,), daemon=True) for i in range(opts.stress_users)]
    threads += [threading.Thread(target=hostile, args=(i,), daemon=True) for i in range(opts.stress_hostile_users)]
    for t in threads:
        t.start()
    stop.wait(opts.stress_seconds)
    stop.set()
    for t in threads:
        t.join(PATIENCE_S)


def run_stress(opts: Options) -> dict[str, Any]:
    """The stress run described by ``opts``; writes ``report.json`` / ``report.md`` into ``opts.out_dir``, prints the
    markdown and returns the report (``verdict.passed``)."""
    from ..serving.launch.server import TritonServer
    from ..shapes import GRAPHS

    out_dir = Path(opts.out_dir)
    work = out_dir / "stress"
    work.mkdir(parents=True, exist_ok=True)
    ensure_assets(opts, list(GRAPHS))
    tunables = {**opts.integrated_tunables, "live_idle_timeout_s": LIVE_IDLE_S}
    saved, opts.integrated_tunables = opts.integrated_tunables, tunables
    try:
        repo, rendered = render("integrated", opts, work / "model_repository")
    finally:
        opts.integrated_tunables = saved
    audio = _audio()
    result = StressResult(opts.stress_seconds, opts.stress_users, opts.stress_hostile_users)
    started = time.time()
    print("== stress: starting tritonserver", flush=True)
    server = TritonServer(repo, work_dir=(work / "triton").resolve(), exit_timeout=10, extra_args=opts.server_args)
    server.start(timeout=opts.startup_timeout_s)
    with server, _gateway(server, work) as (gateway, door):
        for kind in INNOCENT_KINDS:  # warm-up: every innocent kind once, alone
            _innocent(door, audio, kind, 1)
        print(f"   warm; {opts.stress_users} innocent and {opts.stress_hostile_users} hostile users for "
              f"{opts.stress_seconds:.0f} s", flush=True)
        with _Memory(server.process.pid, gateway.pid) as memory:
            memory.sample()
            _drive(door, audio, opts, result)
            for kind in INNOCENT_KINDS:  # after: the door still serves each kind
                try:
                    _innocent(door, audio, kind, 2)
                    result.innocent[kind] += 1
                except Exception as exc:
                    result.innocent_failures.append(f"{kind} after the run: {type(exc).__name__}: {str(exc)[:300]}")
            memory.sample()
        result.memory = memory.samples
        freed = _slots_come_back(door, audio)
        alive = gateway.poll() is None and server.process.poll() is None
        door.channel.close()
    window = max(5.0, 0.2 * opts.stress_seconds)
    mem = memory_figures(result.memory, window)
    growth_ok = all(m["growth"] <= opts.stress_max_growth for m in mem.values())
    verdict = {"innocent_failures": len(result.innocent_failures), "growth_ok": growth_ok, "alive": alive,
               "hostile_key_freed": freed,
               "passed": not result.innocent_failures and growth_ok and alive and freed and bool(mem)}
    report = {
        "mode": "stress", "config_name": opts.name, "machine": machine(), "rendered": rendered,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1), "seconds": opts.stress_seconds, "users": opts.stress_users,
        "hostile_users": opts.stress_hostile_users, "acts": list(opts.stress_acts or HOSTILE_ACTS),
        "kinds": list(opts.stress_kinds or INNOCENT_KINDS), "max_growth": opts.stress_max_growth, "window_s": window,
        "innocent": dict(result.innocent), "innocent_failures": result.innocent_failures[:50],
        "innocent_p50_s": {k: float(np.median(v)) for k, v in result.latencies.items()},
        "hostile": dict(sorted(result.hostile.items())), "memory": mem, "memory_samples": len(result.memory),
        "memory_series": memory_series(result.memory), "verdict": verdict,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    if result.memory:
        from .plots import plot_memory

        span = result.memory[-1][0] - result.memory[0][0]
        plot_memory({name: [(p[0], p[i]) for p in report["memory_series"]] for i, name in
                     ((1, "triton"), (2, "gateway"))}, out_dir / "memory.png", windows=((0, window),
                                                                                       (span - window, span)),
                    title=f"Resident memory, {report['users']} innocent and {report['hostile_users']} hostile users")
    md = stress_markdown(report)
    (out_dir / "report.md").write_text(md)
    print(md, flush=True)
    return report


def stress_markdown(report: dict[str, Any]) -> str:
    v = report["verdict"]
    lines = [f"# Stress: {report['users']} innocent and {report['hostile_users']} hostile users for "
             f"{report['seconds']:.0f} s ({report['config_name']})", "",
             f"**{'PASSED' if v['passed'] else 'FAILED'}**: {v['innocent_failures']} failed innocent requests; memory "
             f"growth {'within' if v['growth_ok'] else 'OVER'} {report['max_growth']:.0%}; server and gateway "
             f"{'alive' if v['alive'] else 'NOT alive'} at the end; the hostile key "
             f"{'served again' if v['hostile_key_freed'] else 'NOT served again'} after its acts.", "",
             "| innocent request | answered | p50 s |", "|---|---:|---:|"]
    lines += [f"| {k} | {n} | {report['innocent_p50_s'].get(k, math.nan):.2f} |"
              for k, n in sorted(report["innocent"].items())]
    lines += ["", "| hostile act: outcome | count |", "|---|---:|"]
    lines += [f"| {k} | {n} |" for k, n in report["hostile"].items()]
    if report.get("acts") and report.get("kinds"):
        lines += ["", f"Hostile acts drawn: {', '.join(report['acts'])}; innocent kinds: {', '.join(report['kinds'])}."]
    lines += ["", f"| memory (RSS, MB; windows of {report['window_s']:.0f} s) | start | end | peak | growth | "
              "slope MB/s |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {m['start_mb']:.0f} | {m['end_mb']:.0f} | {m['peak_mb']:.0f} | {m['growth']:+.1%} | "
              f"{m.get('slope_mb_s', math.nan):.4f} |" for name, m in report["memory"].items()]
    if report.get("memory_series"):
        lines += ["", "Memory over the run: `memory.png` (the windows of the start and end figures shaded)."]
    if report["innocent_failures"]:
        lines += ["", "Failed innocent requests (first ones):", ""] + [f"- {f}" for f in report["innocent_failures"]]
    return "\n".join(lines) + "\n"
