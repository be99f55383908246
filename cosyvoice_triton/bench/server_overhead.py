"""What the server adds to the library for the same chunk: the four streaming models in process and served.

For each of ``cosyvoice_vc_stream``, ``cosyvoice_tts_stream``, ``cosyvoice_vc_live`` and ``cosyvoice_tts_live`` the
same input goes both ways, one request at a time:

- in process: the stage the served model runs, built here from the server's own config parameters
  (:mod:`.stages_in_process`: the same builders, each graph on the served graph model's file, runtime and thread
  count, the stage's torch threads), called as the served model calls it;
- served: the project's clients over Triton's gRPC (:class:`~..clients.sync_client.CosyVoiceClient` for the
  streams, :class:`~..clients.live.LiveClient` for the live models) against a tritonserver started here on
  ``--model-dir`` (the tiny demo model by default; any CosyVoice2 folder, e.g. the full-dims random-weight one), or
  a running one (``--http-url`` and ``--grpc-url``).

Inputs: VC, the bundled 5 s source and 3 s prompt (the prompt's features come from the prompt cache after the
warm-up round, both ways); TTS, a speaker registered both ways (the 3 s prompt and its transcript) speaking two
clauses; live VC, the source in 200 ms pieces, each sent once the one before has been answered (no piece waits
behind another, so a chunk's latency is the work its piece caused); live TTS, the text's words as pieces, all at
once. The seed is fixed, so both ways compute the same chunks: each chunk is checked against the live tests' bar
(max abs difference at most 1e-3 of the in-process chunk's peak; as many chunks, of the same lengths).

A chunk's latency: a stream's first chunk from the request, each later one from the chunk before it (its own work,
to which the server adds its transport); a live VC chunk from the send of the piece that completed it. After a
warm-up round (not counted) the rounds alternate which side goes first. Per model it prints the p50 first-chunk
and later-chunk latency in process and served, their differences (what the server adds: gRPC, the BLS hops to the
graph models, the other processes) and the target, met or missed: at most 50 ms added for the same chunk (the larger
of the two differences). For the TTS stream also the first chunk's breakdown in process (to the first speech token:
the text front end, the speaker lookup and the LM's prefill; the rest of the first hop's tokens; the flow; HiFT)
with the transport (served less in process), and the target of a registered speaker's first streamed chunk served
within 4 s (meant for the real dims). Figures, never assertions; the load average is printed at the start and the
end, with the commit and the CPU.

    cosyvoice-triton bench-server-overhead [--model-dir DIR] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CosyVoiceError
from ..pipeline import StageTimer
from .first_chunk import PROMPT_TEXT, TEXT

__all__ = ["MODELS", "Run", "main", "run_bench"]

VC_STREAM, TTS_STREAM, VC_LIVE, TTS_LIVE = ("cosyvoice_vc_stream", "cosyvoice_tts_stream", "cosyvoice_vc_live",
                                            "cosyvoice_tts_live")
MODELS = (VC_STREAM, TTS_STREAM, VC_LIVE, TTS_LIVE)
#: what the server may add to the library for the same chunk
TARGET_ADDED_S = 0.050
#: a registered speaker's first streamed TTS chunk, served (the real-dims target)
TARGET_TTS_FIRST_CHUNK_S = 4.0
#: the live tests' bar: max |served - in process| / max |in process| of every chunk
CHUNK_BAR = 1e-3
SEED = 3
SPEAKER = "bench_server_overhead"
PIECE_S = 0.2


@dataclass
class Inputs:
    """The same input for both sides."""

    source: np.ndarray
    source_sr: int
    prompt: np.ndarray
    prompt_sr: int
    text: str = TEXT
    prompt_text: str = PROMPT_TEXT

    def vc_tensors(self) -> dict[str, np.ndarray]:
        return {"source_audio": self.source[None], "source_sample_rate": np.array([[self.source_sr]], np.int32),
                **self.prompt_tensors()}

    def prompt_tensors(self) -> dict[str, np.ndarray]:
        return {"prompt_audio": self.prompt[None], "prompt_sample_rate": np.array([[self.prompt_sr]], np.int32),
                "seed": np.array([[SEED]], np.int64)}

    def pieces(self) -> list[np.ndarray]:
        n = int(PIECE_S * self.source_sr)
        return [self.source[i: i + n] for i in range(0, len(self.source), n)]

    def words(self) -> list[bytes]:
        return [w.encode() for w in self.text.replace(" ", " \0").split("\0") if w]


def load_inputs(source_seconds: float = 0.0, text: str = TEXT) -> Inputs:
    """The bundled 5 s source (cut to ``source_seconds`` when > 0) and 3 s prompt, and ``text``."""
    import soundfile as sf

    from ..resources import path as resource_path

    fixtures = resource_path("tests/fixtures")
    src, ssr = sf.read(fixtures / "source_en_5s.wav", dtype="float32")
    prm, psr = sf.read(fixtures / "prompt_en_3s.wav", dtype="float32")
    if source_seconds > 0:
        src = src[: int(source_seconds * ssr)]
    return Inputs(np.ascontiguousarray(src), int(ssr), np.ascontiguousarray(prm), int(psr), text=text)


@dataclass
class Run:
    """One request (or session) of one side: the first chunk's latency, the later chunks', the chunks."""

    first_s: float
    later_s: list[float]
    chunks: list[np.ndarray] = field(repr=False)
    breakdown: dict[str, float] | None = None

    @classmethod
    def from_arrivals(cls, t0: float, arrivals: list[float], chunks: list[np.ndarray], **kw) -> Run:
        """A stream's latencies: the first chunk from ``t0``, each later one from the chunk before."""
        if not arrivals:
            raise CosyVoiceError("the stream answered no chunk")
        return cls(arrivals[0] - t0, [float(x) for x in np.diff(arrivals)], chunks, **kw)

    @classmethod
    def from_latencies(cls, latencies: list[float], chunks: list[np.ndarray]) -> Run:
        if not latencies:
            raise CosyVoiceError("the session answered no chunk")
        return cls(latencies[0], latencies[1:], chunks)


# ------------------------------------------------------------------------------------------------ in process


class _TokenClock:
    """Stands in for a :class:`~..serving.stages.tts.TTSService`'s streamer: the same chunks, and the time each
    speech token reached the chunk loop (:attr:`times`, cleared by :meth:`reset`)."""

    def __init__(self, streamer):
        self.streamer, self.times = streamer, []

    def reset(self) -> None:
        self.times = []

    def chunks(self, prompt, tokens, **kw):
        def timed():
            for token in tokens:
                self.times.append(time.perf_counter())
                yield token
        return self.streamer.chunks(prompt, timed(), **kw)

    def __getattr__(self, name: str):
        return getattr(self.streamer, name)


def _breakdown(t0: float, arrival: float, tokens: list[float], timer: StageTimer) -> dict[str, float]:
    """The in-process TTS first chunk: to the first speech token (front end, speaker lookup, prefill), the rest of
    the first hop's tokens, HiFT (its graphs), the flow (the rest of the chunk's work after its last token)."""
    hift = timer.seconds.get("hift_source", 0.0) + timer.seconds.get("hift_decoder", 0.0)
    return {"to_first_token_s": tokens[0] - t0, "first_hop_tokens": len(tokens),
            "first_hop_decode_s": tokens[-1] - tokens[0], "flow_s": arrival - tokens[-1] - hift, "hift_s": hift}


def _timed(fn: Callable, timer: StageTimer, name: str) -> Callable:
    def call(feeds):
        with timer.stage(name):
            return fn(feeds)
    return call


class Local:
    """The in-process side: the stages of ``models`` from :class:`~.stages_in_process.InProcessStages`."""

    def __init__(self, stages, inputs: Inputs, models=MODELS):
        import torch

        self.torch, self.stages, self.inputs = torch, stages, inputs
        self.vc_stream = stages.vc_stream() if VC_STREAM in models else None
        self.vc_live = stages.vc_live() if VC_LIVE in models else None
        self.tts = {m: stages.tts(m) for m in (TTS_STREAM, TTS_LIVE) if m in models}
        self.max_ratio = stages.configs.params(TTS_LIVE)["max_token_text_ratio"] if TTS_LIVE in models else None
        self.timer = StageTimer()
        for service in self.tts.values():  # HiFT's graph calls timed; the tokens' arrival noted
            for g in ("hift_source", "hift_decoder"):
                service.streamer.graphs[g] = _timed(service.streamer.graphs[g], self.timer, g)
            service.streamer = _TokenClock(service.streamer)
        stages.register(SPEAKER, inputs.prompt, inputs.prompt_sr, inputs.prompt_text)

    def run(self, model: str) -> Run:
        self.torch.set_num_threads(self.stages.threads[model])  # the served stage's torch_threads
        return {VC_STREAM: self._vc_stream, TTS_STREAM: self._tts_stream, VC_LIVE: self._vc_live,
                TTS_LIVE: self._tts_live}[model]()

    def _vc_stream(self) -> Run:
        t0, arrivals, chunks = time.perf_counter(), [], []
        for chunk in self.vc_stream.stream(self.inputs.vc_tensors()):
            arrivals.append(time.perf_counter())
            chunks.append(chunk)
        return Run.from_arrivals(t0, arrivals, chunks)

    def _tts_voice(self) -> dict[str, np.ndarray]:
        return {"speaker_id": np.array([[SPEAKER.encode()]], object), "seed": np.array([[SEED]], np.int64)}

    def _tts_chunks(self, service, responses: Callable[[], Iterator[dict]]) -> Run:
        clock = service.streamer
        clock.reset()
        self.timer.seconds.clear()
        t0, arrivals, chunks, breakdown = time.perf_counter(), [], [], None
        for out in responses():
            arrivals.append(time.perf_counter())
            chunks.append(np.asarray(out["waveform"][0], np.float32))
            if breakdown is None and clock.times:
                breakdown = _breakdown(t0, arrivals[0], list(clock.times), self.timer)
        return Run.from_arrivals(t0, arrivals, chunks, breakdown=breakdown)

    def _tts_stream(self) -> Run:
        service = self.tts[TTS_STREAM]
        tensors = {"text": np.array([[self.inputs.text.encode()]], object), **self._tts_voice()}
        return self._tts_chunks(service, lambda: service.responses(tensors))

    def _tts_live(self) -> Run:
        service = self.tts[TTS_LIVE]
        return self._tts_chunks(service, lambda: service.live(self._tts_voice(), self.inputs.words(),
                                                              max_token_text_ratio=self.max_ratio))

    def _vc_live(self) -> Run:
        """As ``live_vc.serve_session`` runs a session: the first piece opens it, each piece's chunks, the end."""
        inp, live, session = self.inputs, self.vc_live, None
        rate = {"source_sample_rate": np.array([[inp.source_sr]], np.int32)}
        pieces = [*inp.pieces(), np.zeros(0, np.float32)]  # the end of the sequence carries no audio
        latencies, chunks = [], []
        try:
            for k, piece in enumerate(pieces):
                tensors = {"source_audio": piece[None], **rate, **(inp.prompt_tensors() if k == 0 else {})}
                t0 = time.perf_counter()
                if session is None:
                    session = live.open(tensors)
                for chunk in live.piece(session, tensors, first=k == 0, last=k == len(pieces) - 1):
                    latencies.append(time.perf_counter() - t0)
                    chunks.append(chunk)
        finally:
            if session is not None:
                session.close()
        return Run.from_latencies(latencies, chunks)


# ------------------------------------------------------------------------------------------------ served


class Served:
    """The served side: the project's gRPC clients, one request or session at a time."""

    def __init__(self, grpc_url: str, inputs: Inputs, timeout: float):
        from ..clients.client import CosyVoiceClient
        from ..clients.live import LiveClient

        self.inputs = inputs
        self.client = CosyVoiceClient(grpc_url, protocol="grpc", timeout=timeout)
        self.live = LiveClient(grpc_url, timeout=timeout)  # live TTS: the text's pieces as the client sends them
        self.live_vc = LiveClient(grpc_url, timeout=timeout)
        self.live_vc.max_in_flight = 1  # a source piece goes once the one before has been answered
        self.client.register_speaker(SPEAKER, inputs.prompt, prompt_sr=inputs.prompt_sr,
                                     prompt_text=inputs.prompt_text)

    def run(self, model: str) -> Run:
        inp = self.inputs
        if model == VC_STREAM:
            return self._stream(self.client.convert_stream(inp.source, inp.prompt, source_sr=inp.source_sr,
                                                           prompt_sr=inp.prompt_sr, seed=SEED))
        if model == TTS_STREAM:
            return self._stream(self.client.tts_stream(inp.text, speaker_id=SPEAKER, seed=SEED))
        if model == TTS_LIVE:
            return self._stream(self.live.tts_live(inp.words(), speaker_id=SPEAKER, seed=SEED))
        got = list(self.live_vc.convert_live(inp.pieces(), prompt=inp.prompt, prompt_sr=inp.prompt_sr,
                                          sample_rate=inp.source_sr, seed=SEED))
        return Run.from_latencies([c.latency_s for c in got], [c.waveform for c in got])

    @staticmethod
    def _stream(chunks) -> Run:
        got = list(chunks)
        return Run.from_arrivals(0.0, [c.elapsed_s for c in got], [c.waveform for c in got])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.delete_speaker(SPEAKER)
        for client in (self.client, self.live, self.live_vc):
            client.close()


# ------------------------------------------------------------------------------------------------ the rounds


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(float(np.max(np.abs(want))), 1e-30))


def compare(served: Run, local: Run) -> tuple[bool, float]:
    """(equal within the bar, the largest chunk error; inf when the chunks differ in number or length)."""
    if [len(c) for c in served.chunks] != [len(c) for c in local.chunks]:
        return False, math.inf
    err = max((_rel_err(a, b) for a, b in zip(served.chunks, local.chunks, strict=True)), default=0.0)
    return bool(err <= CHUNK_BAR), err


def _finite(x: float) -> float | None:
    """None for a chunk error that could not be measured (the chunks differ in number or length)."""
    return x if math.isfinite(x) else None


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarize(model: str, local: list[Run], served: list[Run], errors: list[float], equal: bool) -> dict[str, Any]:
    sides = {}
    for name, runs in (("in_process", local), ("served", served)):
        later = [x for r in runs for x in r.later_s]
        sides[name] = {"first_chunk_s": [r.first_s for r in runs], "later_chunk_s": later,
                       "first_chunk_p50_s": p50([r.first_s for r in runs]), "later_chunk_p50_s": p50(later),
                       "chunks": len(runs[0].chunks) if runs else 0}
    added_first = _diff(sides["served"]["first_chunk_p50_s"], sides["in_process"]["first_chunk_p50_s"])
    added_later = _diff(sides["served"]["later_chunk_p50_s"], sides["in_process"]["later_chunk_p50_s"])
    added = max((x for x in (added_first, added_later) if x is not None), default=None)
    out = {**sides, "added_first_chunk_s": added_first, "added_later_chunk_s": added_later, "added_s": added,
           "target_s": TARGET_ADDED_S, "target_met": bool(added is not None and added <= TARGET_ADDED_S),
           "equal": equal, "max_rel_err": _finite(max(errors, default=math.inf)), "bar": CHUNK_BAR}
    breakdowns = [r.breakdown for r in local if r.breakdown]
    if breakdowns:
        out["breakdown_p50"] = {k: statistics.median(b[k] for b in breakdowns) for k in breakdowns[0]}
        if added_first is not None:
            out["breakdown_p50"]["transport_s"] = added_first
    return out


def run_rounds(local: Local, served: Served, rounds: int, models=MODELS, log=print) -> dict[str, dict]:
    """A warm-up round, then ``rounds`` rounds, each model in turn, the side that goes first alternating."""
    runs = {m: {"local": [], "served": [], "errors": [], "equal": True} for m in models}
    for r in range(rounds + 1):
        for model in models:
            order = (("local", local), ("served", served)) if r % 2 == 0 else (("served", served), ("local", local))
            got = {name: side.run(model) for name, side in order}
            equal, err = compare(got["served"], got["local"])
            entry = runs[model]
            entry["equal"] &= equal
            entry["errors"].append(err)
            what = "warm-up" if r == 0 else f"round {r}/{rounds}"
            log(f"  {what} {model}: first chunk in process {got['local'].first_s * 1e3:.0f} ms, served "
                f"{got['served'].first_s * 1e3:.0f} ms; {len(got['served'].chunks)} chunks, max rel err {err:.1e}",
                flush=True)
            if r:
                entry["local"].append(got["local"])
                entry["served"].append(got["served"])
    return {m: summarize(m, e["local"], e["served"], e["errors"], e["equal"]) for m, e in runs.items()}


# ------------------------------------------------------------------------------------------------ the server


@contextlib.contextmanager
def server_urls(args: argparse.Namespace, work: Path) -> Iterator[tuple[str, str, Path | None]]:
    """(http, grpc, repository) of the server: the one given, or one started here (stopped on every way out)."""
    if args.grpc_url or args.http_url:
        if not (args.grpc_url and args.http_url):
            raise CosyVoiceError("a running server needs both --http-url (its configs) and --grpc-url (the clients)")
        yield args.http_url, args.grpc_url, args.repository
        return
    from ..serving.launch.serve import prepare
    from ..serving.launch.server import TritonServer

    size = "full" if "full" in Path(args.model_dir).name else "tiny"
    repo = prepare(args.model_dir, onnx_dir=args.onnx_dir, repository=work / "model_repository", demo_size=size,
                   speaker_dir=str(work / "speakers"))
    server = TritonServer(repo, work_dir=work / "triton", exit_timeout=5, extra_args=args.server_arg)
    try:
        server.start(timeout=args.start_timeout)
        yield server.http_url, server.grpc_url, repo
    finally:
        server.stop()


def machine() -> dict[str, Any]:
    from ..export.quality import cpu_description
    from ..loadtest.live import commit

    cpu, simd = cpu_description()
    return {"commit": commit(), "cpu": cpu, "simd": simd, "cores": os.cpu_count()}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Start (or reach) the server, build the in-process stages from its configs, run the rounds; the report."""
    from .stages_in_process import InProcessStages, ServedConfigs

    report: dict[str, Any] = {**machine(), "load_start": load_average(), "model_dir": str(args.model_dir),
                              "rounds": args.rounds}
    inputs = load_inputs(args.source_seconds, args.text or TEXT)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        http_url, grpc_url, repo = stack.enter_context(server_urls(args, work))
        report["server"] = "started here" if not args.grpc_url else f"given: {grpc_url}"
        configs = ServedConfigs(http_url, repository=repo)
        stages = InProcessStages(configs, stack.enter_context(tempfile.TemporaryDirectory(prefix="speakers-")))
        stack.callback(stages.close)
        print("== building the in-process stages from the served configs", flush=True)
        local = Local(stages, inputs, args.models)
        served = Served(grpc_url, inputs, args.timeout)
        stack.callback(served.close)
        report["torch_threads"] = dict(stages.threads)
        report["models"] = run_rounds(local, served, args.rounds, args.models)
    report["load_end"] = load_average()
    report["equal"] = all(m["equal"] for m in report["models"].values())
    if TTS_STREAM not in report["models"]:
        return report
    tts = report["models"][TTS_STREAM]
    first = tts["served"]["first_chunk_p50_s"]
    report["tts_first_chunk"] = {"served_p50_s": first, "target_s": TARGET_TTS_FIRST_CHUNK_S,
                                 "target_met": bool(first is not None and first <= TARGET_TTS_FIRST_CHUNK_S),
                                 "breakdown_p50": tts.get("breakdown_p50")}
    return report


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.0f} ms"


def _signed_ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:+.0f} ms"


def report_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"commit {report['commit']}; {report['cpu']} ({report['simd']}), {report['cores']} cores; load average "
             f"{' '.join(map(str, report['load_start']))} at the start, {' '.join(map(str, report['load_end']))} at "
             f"the end; {report['model_dir']}, server {report['server']}; p50 of {report['rounds']} rounds after a "
             f"warm-up; torch threads per stage {report['torch_threads']}"]
    for model, m in report["models"].items():
        verdict = "met" if m["target_met"] else "missed"
        err = "chunk counts or lengths differ" if m["max_rel_err"] is None else f"max rel err {m['max_rel_err']:.1e}"
        eq = (f"equal within {m['bar']:g}" if m["equal"] else "NOT equal") + f" ({err})"
        lines += [f"{model}: {m['served']['chunks']} chunks; served output {eq}",
                  f"  first chunk: in process {_ms(m['in_process']['first_chunk_p50_s'])}, served "
                  f"{_ms(m['served']['first_chunk_p50_s'])}, added {_signed_ms(m['added_first_chunk_s'])}",
                  f"  later chunks: in process {_ms(m['in_process']['later_chunk_p50_s'])}, served "
                  f"{_ms(m['served']['later_chunk_p50_s'])}, added {_signed_ms(m['added_later_chunk_s'])}",
                  f"  target: the server adds at most {TARGET_ADDED_S * 1e3:.0f} ms to the library for the same "
                  f"chunk: {verdict} ({_signed_ms(m['added_s'])})"]
    t = report.get("tts_first_chunk")
    b = t and t["breakdown_p50"]
    if b:
        lines.append(f"TTS stream first chunk, in process: to the first speech token (front end, speaker lookup, "
                     f"prefill) {_ms(b['to_first_token_s'])}, the first hop's {b['first_hop_tokens']:.0f} tokens "
                     f"{_ms(b['first_hop_decode_s'])}, flow {_ms(b['flow_s'])}, HiFT {_ms(b['hift_s'])}; transport "
                     f"(served less in process) {_signed_ms(b.get('transport_s'))}")
    if t:
        lines.append(f"target: a registered speaker's first streamed TTS chunk served within "
                     f"{TARGET_TTS_FIRST_CHUNK_S:g} s: {'met' if t['target_met'] else 'missed'} "
                     f"({_ms(t['served_p50_s'])}; meant for the real dims)")
    lines.append("served and in-process outputs: " + ("equal within the bar for every model" if report["equal"] else
                                                      "NOT equal for " + ", ".join(
                                                          m for m, v in report["models"].items() if not v["equal"])))
    return lines


def _jsonable(report: dict[str, Any]) -> dict[str, Any]:
    """numpy scalars as Python numbers and bools."""
    return json.loads(json.dumps(report, default=lambda x: x.item() if hasattr(x, "item") else str(x)))


def _models(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"not one of {', '.join(MODELS)}: {', '.join(unknown) or text!r}")
    return tuple(m for m in MODELS if m in names)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-triton bench-server-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/cosyvoice2-demo-tiny",
                   help="the CosyVoice2 folder to serve (a demo folder is written when missing)")
    p.add_argument("--onnx-dir", default="build/onnx", help="its ONNX export (made when missing or stale)")
    p.add_argument("--work-dir", default="build/bench-server-overhead",
                   help="the rendered repository, the server's folder and its speakers")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up round")
    p.add_argument("--models", type=_models, default=MODELS,
                   help=f"some of the models, comma-separated (default: all: {','.join(MODELS)}); at the real dims "
                        "cosyvoice_tts_stream alone keeps one LM in process beside the server's")
    p.add_argument("--source-seconds", type=float, default=0.0, help="cut the 5 s source to this (0: whole)")
    p.add_argument("--text", default="", help="the TTS text (default: two clauses)")
    p.add_argument("--http-url", default="", help="a running server's HTTP address (its configs); with --grpc-url")
    p.add_argument("--grpc-url", default="", help="a running server's gRPC address (the clients); with --http-url")
    p.add_argument("--repository", type=Path, default=None,
                   help="a running server's repository folder (only for graphs with a relative onnx_path)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra tritonserver flag (repeat), e.g. --server-arg=--backend-config=python,"
                        "stub-timeout-seconds=600 at the real dims")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds the server may take to be ready")
    p.add_argument("--timeout", type=float, default=900.0, help="the clients' timeout per request, seconds")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")

    def stop(signum, frame):  # SIGTERM unwinds as Ctrl-C does: the server is stopped on the way out
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        report = run_bench(args)
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, after the server it started has stopped
        print(f"interrupted ({exc or 'Ctrl-C'}); no report", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    for line in report_lines(report):
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_jsonable(report), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
