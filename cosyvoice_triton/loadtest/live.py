"""Live-session figures (``python -m cosyvoice_triton.loadtest.live``, ``make bench-live``): how many concurrent
live voice-conversion streams one server holds at real time, their per-chunk latency, and live TTS's time from the
first text piece to the first audio. It prints (and writes ``report.md`` / ``report.json``); it asserts nothing.

One integrated server (the load tests' render and launcher: :func:`.setup.render`, ``TritonServer``), then:

* **VC at real time**: ``N`` streams at once (``--streams``, default 1, 2, 4, 8; stops after the first level with an
  underrun or a failed stream), each its own gRPC live session sending a workload source (repeated to
  ``--stream-seconds``) at real-time pace in pieces of ``--piece-ms``. Per level: chunk latency p50 / p95 (arrival
  after the piece it answers was sent), first audio, the smallest play-out margin (playback from the first chunk
  plus ``--buffer-ms``), underruns and stalled seconds, the play-out buffer each stream would have needed, failed
  streams. A level is held when no stream failed or underran.
* **VC as fast as possible**: one stream sent without pacing: its real-time factor (first piece to last chunk over
  the audio) and latency.
* **TTS**: each ``--tts-text`` sent word by word at ``--tts-words-per-s`` to ``cosyvoice_tts_live`` (skipped,
  with the reason, while the server has none): first text piece to first audio, and the whole session.

``--via grpc,ws`` (``make loadtest-live-gateway``): each level and each TTS text also through the gateway's
WebSocket routes (:class:`~..clients.live_ws.LiveSocket`, one tenant whose live share is the largest level), right
after the same sessions over Triton's gRPC, so the two columns differ by what the door adds (the gateway's
process, its own gRPC session upstream, the socket's framing): the same pieces, the same pacing, latency measured
alike (a chunk's arrival after the input message that let it be computed was sent).

``--config full`` (``make bench-live DEMO_SIZE=full``): CosyVoice2-0.5B dims, one stream paced and one as fast as
possible. The setup lines carry the commit and the load average before and after: figures from a loaded machine say
little about the server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import resources
from ..clients.live import TTS_LIVE_MODEL, VC_LIVE_MODEL, LiveClient, LiveStats, PacedPieces
from ..clients.live_ws import LiveSocket
from .callers import _no_retry
from .report import _jsonable, latency_summary

__all__ = ["commit", "main", "run_live", "summarize_level"]

DEFAULTS = {"tiny": {"streams": (1, 2, 4, 8), "stream_seconds": 20.0},
            "full": {"streams": (1,), "stream_seconds": 10.0}}
#: How a session reaches the live models: Triton's gRPC directly, or the gateway's WebSocket.
VIAS = {"grpc": "Triton gRPC directly", "ws": "gateway WebSocket"}
BENCH_KEY = "live-bench-key"


@dataclass
class Door:
    """Where the sessions go: ``via`` (:data:`VIAS`), Triton's gRPC ``url`` or the gateway's ``http`` address and
    the reference recording it takes encoded (``wav``)."""

    via: str
    url: str
    wav: bytes = b""


def commit() -> str:
    """The checkout's commit (short), ``+dirty`` with uncommitted changes to tracked files; ``unknown`` for an
    installed package (no checkout)."""
    clone = resources.checkout()
    if clone is None:
        return "unknown"

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=clone, capture_output=True, text=True, timeout=30,
                              check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) + f" (1, 5, 15 min; {os.cpu_count()} CPUs)"


def _source(workload, i: int, seconds: float) -> tuple[np.ndarray, int]:
    wave, sr = workload.sources[i % len(workload)], int(workload.source_rates[i % len(workload)])
    return np.tile(wave, max(1, int(np.ceil(seconds * sr / len(wave))))), sr


def _stream(door: Door | str, wave, sr: int, prompt, prompt_sr: int, *, piece_ms: float, realtime: bool,
            buffer_s: float, timeout: float, seed: int) -> dict[str, Any]:
    """One live VC session; its figures (``error`` instead when it failed)."""
    door = door if isinstance(door, Door) else Door("grpc", door)
    stats = LiveStats(buffer_s=buffer_s)
    t0 = time.perf_counter()
    try:
        pieces = PacedPieces(wave, sample_rate=sr, piece_ms=piece_ms, realtime=realtime)
        if door.via == "ws":
            socket = LiveSocket(door.url, key=BENCH_KEY, timeout=timeout, proxy=None)
            for _ in socket.convert_live(pieces, sample_rate=pieces.sample_rate, reference_audio=door.wav, seed=seed,
                                         stats=stats):
                pass
        else:
            with LiveClient(door.url, timeout=timeout, **_no_retry()) as client:
                for _ in client.convert_live(pieces, prompt=prompt, prompt_sr=prompt_sr, seed=seed, stats=stats):
                    pass
    except Exception as exc:  # counted: a load test reports failures
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "wall_s": time.perf_counter() - t0}
    return {"source_s": stats.source_seconds, "audio_s": stats.audio_seconds, "chunks": stats.chunks,
            "latencies_s": list(stats.latencies_s), "first_audio_s": stats.first_audio_s, "margin_s": stats.margin_s,
            "underruns": stats.underruns, "stall_s": stats.stall_s, "needed_buffer_s": stats.needed_buffer_s,
            "rtf": stats.rtf, "total_s": stats.total_s, "wall_s": time.perf_counter() - t0}


def summarize_level(streams: int, results: Sequence[dict[str, Any]], via: str = "grpc") -> dict[str, Any]:
    """One concurrency level's figures from its streams' results."""
    ok = [r for r in results if "error" not in r]
    lat = latency_summary([x for r in ok for x in r["latencies_s"]])
    margins = [r["margin_s"] for r in ok if r["margin_s"] is not None]
    underruns = sum(r["underruns"] for r in ok)
    errors = sorted({r["error"] for r in results if "error" in r})[:3]
    return {"via": via, "streams": streams, "failed": len(results) - len(ok), "errors": errors,
            "chunks": sum(r["chunks"] for r in ok), "latency_p50_ms": lat["p50_ms"], "latency_p95_ms": lat["p95_ms"],
            "first_audio_p50_ms": latency_summary([r["first_audio_s"] for r in ok if r["first_audio_s"]])["p50_ms"],
            "min_margin_ms": min(margins) * 1000 if margins else float("nan"), "underruns": underruns,
            "stall_s": sum(r["stall_s"] for r in ok),
            "needed_buffer_max_ms": max((r["needed_buffer_s"] for r in ok), default=float("nan")) * 1000,
            "audio_s": sum(r["audio_s"] for r in ok), "held": not underruns and len(ok) == len(results) > 0}


def _level(door: Door, workload, n: int, args) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{}] * n

    def one(i: int) -> None:
        wave, sr = _source(workload, i, args.stream_seconds)
        results[i] = _stream(door, wave, sr, workload.prompt, workload.prompt_sr, piece_ms=args.piece_ms,
                             realtime=True, buffer_s=args.buffer_ms / 1000.0, timeout=args.timeout_s,
                             seed=args.seed + i)

    threads = [threading.Thread(target=one, args=(i,), name=f"live{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize_level(n, results, door.via)


def _tts(doors: Sequence[Door], workload, args) -> list[dict[str, Any]]:
    out = []
    with contextlib.ExitStack() as stack:
        speakers = {}
        for door in doors:
            if door.via == "ws":
                socket = LiveSocket(door.url, key=BENCH_KEY, timeout=args.timeout_s, proxy=None)
                speakers["ws"] = lambda texts, stats, socket=socket, wav=door.wav: socket.tts_live(
                    texts, reference_audio=wav, reference_text=workload.prompt_text or None, seed=args.seed,
                    stats=stats)
            else:
                client = stack.enter_context(LiveClient(door.url, model=TTS_LIVE_MODEL, timeout=args.timeout_s,
                                                        **_no_retry()))
                speakers["grpc"] = lambda texts, stats, client=client: client.tts_live(
                    texts, prompt=workload.prompt, prompt_sr=workload.prompt_sr,
                    prompt_text=workload.prompt_text or None, seed=args.seed, stats=stats)
        for text in args.tts_texts or workload.texts[:3]:
            words = [w + " " for w in text.split()]
            for via, speak in speakers.items():
                stats = LiveStats()

                def paced(words=words):
                    for k, word in enumerate(words):
                        if k:
                            time.sleep(1.0 / args.tts_words_per_s)
                        yield word

                t0 = time.perf_counter()
                try:
                    for _ in speak(paced(), stats):
                        pass
                    row = {"first_audio_ms": (stats.first_audio_s or float("nan")) * 1000,
                           "audio_s": stats.audio_seconds, "total_s": stats.total_s, "chunks": stats.chunks}
                except Exception as exc:
                    row = {"error": f"{type(exc).__name__}: {exc}"[:300], "total_s": time.perf_counter() - t0}
                out.append({"via": via, "text": text, "pieces": len(words), **row})
                print(f"   tts: {out[-1]}", flush=True)
    return out


def _wav(wave, sr: int) -> bytes:
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.asarray(wave, np.float32).reshape(-1), int(sr), format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _ready(url: str, model: str) -> bool:
    with LiveClient(url, model=model, timeout=60) as client:
        return client.is_ready()


def run_live(opts, args) -> dict[str, Any]:
    """The figures for the runner's ``Options`` (model, ONNX, render tunables, server flags) and this module's
    ``args``; writes ``report.md`` / ``report.json`` into ``opts.out_dir``."""
    from ..serving.launch.server import TritonServer
    from ..shapes import GRAPHS
    from .setup import _versions, ensure_assets, machine, render
    from .workload import cached_workload

    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = {"commit": commit(), "machine": machine(), "load average at start": _load(),
             "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    ensure_assets(opts, list(GRAPHS))
    workload = cached_workload(out_dir / "workload.npz", n_sources=opts.n_sources, seed=opts.seed,
                               fixtures=resources.path("tests/fixtures"))
    tts = (Path(opts.model_dir) / "llm.pt").is_file() and not args.no_tts
    tunables = {**opts.integrated_tunables, "tts": "on" if tts else "off",
                "live_max_sessions": max(max(args.streams), 1)}
    opts = replace(opts, integrated_tunables=tunables)
    repo, rendered = render("integrated", opts, out_dir / "model_repository")
    server = TritonServer(repo, work_dir=(out_dir / "triton").resolve(), exit_timeout=10,
                          extra_args=tuple(opts.server_args))
    print("== live: starting tritonserver", flush=True)
    server.start(timeout=opts.startup_timeout_s)
    levels: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(server)
        url = server.grpc_url
        if not _ready(url, VC_LIVE_MODEL):
            raise RuntimeError(f"the server has no ready {VC_LIVE_MODEL} model")
        doors = []
        for via in args.via:
            if via == "ws":
                from .setup import gateway

                most = str(max(max(args.streams), 1))
                _, http, _ = stack.enter_context(gateway(
                    server, out_dir / "gateway", {"bench": BENCH_KEY}, "--live-sessions-per-tenant",
                    f"{VC_LIVE_MODEL}={most}", "--live-sessions-per-tenant", f"{TTS_LIVE_MODEL}=1",
                    "--max-concurrency-per-key", str(int(most) + 2), "--log-level", "warning"))
                doors.append(Door("ws", http, _wav(workload.prompt, workload.prompt_sr)))
            else:
                doors.append(Door("grpc", url))
        wave, sr = _source(workload, 0, 2.0)
        for door in doors:  # loads and warms every stage (and the gateway's way to them)
            warm = _stream(door, wave, sr, workload.prompt, workload.prompt_sr, piece_ms=args.piece_ms,
                           realtime=False, buffer_s=0.0, timeout=args.timeout_s, seed=args.seed)
            if "error" in warm:
                raise RuntimeError(f"the warm-up session ({VIAS[door.via]}) failed: {warm['error']}")
        for n in args.streams:
            held = False
            for door in doors:
                print(f"== {n} live VC stream(s) at real time over {VIAS[door.via]}, {args.stream_seconds:.0f} s "
                      "each", flush=True)
                levels.append(_level(door, workload, n, args))
                print(f"   {json.dumps(_jsonable({k: v for k, v in levels[-1].items() if k != 'errors'}))}",
                      flush=True)
                held = held or levels[-1]["held"]
            if not held and not args.whole_sweep:
                break
        print("== one live VC stream as fast as possible", flush=True)
        wave, sr = _source(workload, 0, args.stream_seconds)
        fast = _stream(url, wave, sr, workload.prompt, workload.prompt_sr, piece_ms=args.piece_ms, realtime=False,
                       buffer_s=0.0, timeout=args.timeout_s, seed=args.seed)
        fast.update(latency_summary(fast.pop("latencies_s", [])))
        tts_rows: list[dict[str, Any]] | str
        if not tts:
            tts_rows = "skipped: no llm.pt in the model folder" if not args.no_tts else "skipped: --no-tts"
        elif not _ready(url, TTS_LIVE_MODEL):
            tts_rows = f"skipped: the server has no ready {TTS_LIVE_MODEL} model"
        else:
            print("== live TTS, text word by word", flush=True)
            tts_rows = _tts(doors, workload, args)
    setup.update({"load average at end": _load(), "config": opts.name,
                  "model": f"{opts.model_dir} ({opts.demo_size} dims; random weights, real shapes)",
                  "sources": workload.describe(), "pieces": f"{args.piece_ms:.0f} ms at real-time pace, "
                  f"{args.stream_seconds:.0f} s per stream", "play-out buffer": f"{args.buffer_ms:.0f} ms",
                  "repository": f"local flavor, graph precision {rendered.get('graph_precision')}, tunables "
                  f"{tunables}", "versions": ", ".join(f"{k} {v}" for k, v in _versions().items())})
    held_by_via = {door.via: max([lv["streams"] for lv in levels if lv["held"] and lv["via"] == door.via],
                                 default=0) for door in doors}
    report = {"mode": "live", "setup": setup, "levels": levels, "fast": fast, "tts": tts_rows,
              "held_streams": held_by_via[doors[0].via], "held_by_via": held_by_via,
              "tried": sorted({lv["streams"] for lv in levels})}
    md = render_markdown(report)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.json").write_text(json.dumps(_jsonable(report), indent=2) + "\n")
    print(md, flush=True)
    print(f"wrote {out_dir / 'report.md'}, {out_dir / 'report.json'}", flush=True)
    return report


def _f(v, digits: int = 0) -> str:
    return "n/a" if v is None or v != v else f"{v:,.{digits}f}"


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# Live sessions: voice conversion at real time, live TTS", ""]
    lines += [f"- {k}: {v}" for k, v in report["setup"].items()]
    held = report.get("held_by_via") or {"grpc": report["held_streams"]}
    tried = ", ".join(str(n) for n in report["tried"])
    if len(held) == 1:
        lines += ["", f"Held at real time (no underrun, no failed stream): {report['held_streams']} concurrent live VC "
                  f"stream(s); levels tried: {tried}."]
    else:
        lines += ["", "Held at real time (no underrun, no failed stream): " + "; ".join(
            f"{VIAS.get(via, via)} {n} concurrent live VC stream(s)" for via, n in held.items())
            + f"; levels tried: {tried}."]
    lines += ["", "| via | streams | chunks | latency p50 (ms) | latency p95 (ms) | first audio p50 (ms) | smallest "
              "margin (ms) | underruns | stalled (s) | buffer needed (ms) | failed |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for lv in report["levels"]:
        lines.append(f"| {lv.get('via', 'grpc')} | {lv['streams']} | {lv['chunks']} | {_f(lv['latency_p50_ms'])} | "
                     f"{_f(lv['latency_p95_ms'])} | {_f(lv['first_audio_p50_ms'])} | {_f(lv['min_margin_ms'])} | "
                     f"{lv['underruns']} | {lv['stall_s']:.2f} | {_f(lv['needed_buffer_max_ms'])} | {lv['failed']} |")
        if lv["errors"]:
            lines.append(f"|  | errors: {'; '.join(lv['errors'])} ||||||||||")
    lines += _door_adds(report["levels"])
    fast = report["fast"]
    lines.append("")
    if "error" in fast:
        lines.append(f"One stream as fast as possible: failed ({fast['error']}).")
    else:
        lines.append(f"One stream as fast as possible: {fast['source_s']:.1f} s of source in {fast['total_s']:.2f} s, "
                     f"real-time factor {fast['rtf']:.3f}; chunk latency p50 {_f(fast['p50_ms'])} ms, p95 "
                     f"{_f(fast['p95_ms'])} ms (pieces sent back to back, so they queue).")
    lines.append("")
    if isinstance(report["tts"], str):
        lines.append(f"Live TTS: {report['tts']}.")
    else:
        lines += ["| via | live TTS text | pieces | first piece -> first audio (ms) | audio (s) | session (s) |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for row in report["tts"]:
            via = row.get("via", "grpc")
            if "error" in row:
                lines.append(f"| {via} | {row['text']} | {row['pieces']} | failed: {row['error']} | | |")
            else:
                lines.append(f"| {via} | {row['text']} | {row['pieces']} | {_f(row['first_audio_ms'])} | "
                             f"{row['audio_s']:.2f} | {row['total_s']:.2f} |")
    lines += ["", "Latency: a chunk's arrival after the piece whose arrival let the server compute it was sent (the "
              "algorithmic latency of the live model's chunk schedule included). Margin: how early a chunk came for "
              "gap-free playback starting at the first chunk plus the play-out buffer; buffer needed: the smallest "
              "play-out buffer that would have had no underrun. The client threads run on the same machine."]
    return "\n".join(lines) + "\n"


def _door_adds(levels: Sequence[dict[str, Any]]) -> list[str]:
    """What the gateway's WebSocket adds to the same level over Triton's gRPC (ms; empty without both)."""
    by = {(lv.get("via", "grpc"), lv["streams"]): lv for lv in levels}
    pairs = [(by[("grpc", n)], by[("ws", n)]) for (via, n) in by if via == "ws" and ("grpc", n) in by]
    if not pairs:
        return []
    out = ["", "What the gateway's WebSocket adds to the same sessions over Triton's gRPC (ws minus grpc, ms):", "",
           "| streams | latency p50 | latency p95 | first audio p50 | underruns (grpc / ws) |",
           "| ---: | ---: | ---: | ---: | ---: |"]
    for g, w in pairs:
        out.append(f"| {g['streams']} | {_f(w['latency_p50_ms'] - g['latency_p50_ms'])} | "
                   f"{_f(w['latency_p95_ms'] - g['latency_p95_ms'])} | "
                   f"{_f(w['first_audio_p50_ms'] - g['first_audio_p50_ms'])} | {g['underruns']} / {w['underruns']} |")
    return out


def _csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.loadtest.live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("tiny", "full"), default="tiny")
    p.add_argument("--model-dir")
    p.add_argument("--onnx-dir")
    p.add_argument("--out-dir")
    p.add_argument("--streams", type=_csv_ints, help="concurrency levels (tiny: 1,2,4,8; full: 1)")
    p.add_argument("--whole-sweep", action="store_true", help="go on after a level that was not held")
    p.add_argument("--stream-seconds", type=float, help="source seconds per stream (tiny: 20, full: 10)")
    p.add_argument("--piece-ms", type=float, default=200.0)
    p.add_argument("--buffer-ms", type=float, default=200.0, help="play-out buffer after the first chunk")
    p.add_argument("--tts-text", dest="tts_texts", action="append", help="a live TTS text (repeatable; default: "
                   "three of the load tests' sentences)")
    p.add_argument("--tts-words-per-s", type=float, default=10.0, help="how fast the TTS text pieces come")
    p.add_argument("--no-tts", action="store_true")
    p.add_argument("--timeout-s", type=float, default=600.0, help="a session's wait for an answer")
    p.add_argument("--startup-timeout-s", type=float)
    p.add_argument("--server-arg", dest="server_args", action="append", help="a tritonserver flag (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--via", type=_vias, default=("grpc",), help="how the sessions reach the live models, one or "
                   "both, each level in turn: grpc (Triton directly), ws (the gateway's WebSocket); default grpc")
    return p


def _vias(text: str) -> tuple[str, ...]:
    vias = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not vias or set(vias) - set(VIAS):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(VIAS)}")
    return vias


def main(argv: Sequence[str] | None = None) -> int:
    from .setup import CONFIGS

    args = parser().parse_args(argv)
    base = CONFIGS[args.config]
    for key, value in DEFAULTS[args.config].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    overrides = {k: getattr(args, k) for k in ("model_dir", "onnx_dir", "out_dir", "startup_timeout_s")
                 if getattr(args, k) is not None}
    overrides.setdefault("out_dir", f"{base.out_dir}-live")
    opts = replace(base, **overrides, server_args=tuple(args.server_args or ()), seed=args.seed, notes=[])
    run_live(opts, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
