"""Repeated-speaker benchmark: the prompt cache on against off, in process and served.

Every request converts a different source (the 5 s fixture, rotated) into the voice of the same 3 s prompt, as when
many requests share a target speaker. In process (:class:`~cosyvoice_triton.pipeline.CosyVoice2`): the whole
conversion and the prompt computation alone (what a TTS request or a speaker registration pays), cache on and off
interleaved, medians; per conversion also the time of its front end, tokenizer and CAM++ stages (source and prompt
together), which is what the cache shortens. Served (``--served``): the same workload against ``cosyvoice_vc`` on
two servers rendered with ``prompt_cache_entries`` 256 and 0, at ``--concurrency`` users: latency, throughput, and
from Triton's statistics the ``preprocess`` compute time per request (the part the cache takes over in the ensemble:
an ensemble runs every step, so its tokenizer and CAM++ calls stay); and the ``speakers`` model registering the same
recording under new ids (there the cache skips the front end and both graphs).

    python -m cosyvoice_triton.bench.prompt_cache [--model-dir DIR] [--requests 8] [--served] [--json OUT]

The demo folder's ``speech_tokenizer_v2.onnx`` and ``campplus.onnx`` are small stand-ins with the official
signatures: the real tokenizer (a Whisper encoder) costs far more per prompt, so the gain measured on a demo folder
is a lower bound. Nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from ..frontend import audio
from ..pipeline import CosyVoice2, StageTimer
from ..prompt_cache import PromptCache
from ..resources import path as resource_path

FIXTURES = resource_path("tests/fixtures")
SOURCE, PROMPT = FIXTURES / "source_en_5s.wav", FIXTURES / "prompt_en_3s.wav"
PROMPT_STAGES = ("frontend", "tokenizer", "speaker_embedding")


def _sources(n: int) -> list[np.ndarray]:
    src = audio.load_audio(SOURCE, target_sr=audio.TOKENIZER_SR)
    return [np.roll(src, i * len(src) // max(n, 1)) for i in range(n)]


def _median_ms(values) -> float:
    return round(1000 * statistics.median(values), 1)


def in_process(model_dir: Path, requests: int) -> dict:
    model = CosyVoice2.from_pretrained(model_dir, prompt_cache=False)
    cache = PromptCache()
    prompt, prompt_sr = audio.decode_audio(PROMPT.read_bytes(), name="prompt")
    model.convert(_sources(1)[0], prompt, source_sr=audio.TOKENIZER_SR, prompt_sr=prompt_sr)  # warm-up
    runs: dict[str, dict[str, list[float]]] = {m: {"convert": [], "front_end_tokenizer_cam": [], "prompt": []}
                                               for m in ("on", "off")}
    model.prompt_cache = cache
    model.prompt(prompt, prompt_sr=prompt_sr)  # the first request of the speaker: the miss that fills the entry
    for i, src in enumerate(_sources(requests)):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            model.prompt_cache = cache if mode == "on" else None
            timer = StageTimer()
            t0 = time.perf_counter()
            model.convert(src, prompt, source_sr=audio.TOKENIZER_SR, prompt_sr=prompt_sr, timer=timer)
            runs[mode]["convert"].append(time.perf_counter() - t0)
            runs[mode]["front_end_tokenizer_cam"].append(sum(timer.seconds.get(k, 0.0) for k in PROMPT_STAGES))
            t0 = time.perf_counter()
            model.prompt(prompt, prompt_sr=prompt_sr)
            runs[mode]["prompt"].append(time.perf_counter() - t0)
    out = {mode: {k: _median_ms(v) for k, v in r.items() if v} for mode, r in runs.items()}
    out["cache"] = cache.stats()
    return out


def served(model_dir: Path, onnx_dir: Path, work: Path, requests: int, concurrency: int) -> dict:
    """Both servers up at once; rounds of ``concurrency`` conversions alternate between them (on, off, off, on,
    ...), so load from elsewhere on the machine falls on both alike."""
    import contextlib

    from ..clients.client import CosyVoiceClient
    from ..serving.launch.server import TritonServer
    from ..serving.repository import render_repository

    prompt_bytes = PROMPT.read_bytes()
    sources = _sources(requests)
    modes = {"on": 256, "off": 0}
    with contextlib.ExitStack() as stack:
        clients = {}
        for mode, entries in modes.items():
            repo = work / f"repo-{mode}"
            render_repository("local", repo, model_dir=model_dir, onnx_dir=onnx_dir, prompt_cache_entries=entries,
                              speaker_dir=str(work / f"speakers-{mode}"), tts="off")
            server = TritonServer(repo, work_dir=work / f"triton-{mode}", exit_timeout=5)
            server.start(timeout=600)
            stack.callback(server.stop)
            clients[mode] = stack.enter_context(CosyVoiceClient(server.http_url, concurrency=concurrency, timeout=600))
            clients[mode].convert(sources[0], prompt_bytes, source_sr=audio.TOKENIZER_SR)  # warm-up; fills the cache
        runs = {mode: {"latency": [], "wall": 0.0, "n": 0, "compute_ns": 0, "count": 0, "register": []}
                for mode in modes}
        rounds = [sources[i : i + concurrency] for i in range(0, len(sources), concurrency)]
        for r, batch in enumerate(rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                client, run = clients[mode], runs[mode]
                before = _model_stats(client.statistics("preprocess"))
                t0 = time.perf_counter()
                results = client.convert_many([{"source": s, "prompt": prompt_bytes, "source_sr": audio.TOKENIZER_SR}
                                               for s in batch])
                run["wall"] += time.perf_counter() - t0
                after = _model_stats(client.statistics("preprocess"))
                failed = [x for x in results if not hasattr(x, "latency_s")]
                if failed:
                    raise RuntimeError(f"{len(failed)} conversions failed: {failed[0]}")
                run["latency"] += [x.latency_s for x in results]
                run["n"] += len(results)
                run["compute_ns"] += after["compute_ns"] - before["compute_ns"]
                run["count"] += after["count"] - before["count"]
                t1 = time.perf_counter()
                client.register_speaker(f"bench{r}", prompt_bytes)  # the warm-up filled the cache (mode on)
                run["register"].append(time.perf_counter() - t1)
    return {mode: {"requests": run["n"], "concurrency": concurrency, "wall_s": round(run["wall"], 2),
                   "throughput_rps": round(run["n"] / run["wall"], 3), "latency_median_ms": _median_ms(run["latency"]),
                   "preprocess_compute_ms_per_request": round(run["compute_ns"] / max(run["count"], 1) / 1e6, 2),
                   "speaker_register_median_ms": _median_ms(run["register"])}
            for mode, run in runs.items()}


def _model_stats(stats: dict) -> dict:
    s = stats["model_stats"][0]["inference_stats"]
    return {"count": int(s["success"]["count"]),
            "compute_ns": int(s["compute_input"]["ns"]) + int(s["compute_infer"]["ns"])
            + int(s["compute_output"]["ns"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("build/bench-prompt-cache/tiny"),
                    help="a CosyVoice2 folder (written as the tiny demo model if missing)")
    ap.add_argument("--requests", type=int, default=8, help="conversions per mode")
    ap.add_argument("--no-in-process", action="store_true", help="only the served part")
    ap.add_argument("--served", action="store_true", help="also measure two live servers (cache on / off)")
    ap.add_argument("--concurrency", type=int, default=4, help="served: requests in flight")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if not (args.model_dir / "cosyvoice2.yaml").is_file():
        from ..models.demo import write_demo_model

        write_demo_model(args.model_dir, size="tiny")
    report = {} if args.no_in_process else {"in_process": in_process(args.model_dir, args.requests)}
    print(json.dumps(report, indent=1), flush=True)
    if args.served:
        from ..export.onnx_export import export_onnx

        work = args.model_dir.parent
        onnx_dir = work / "onnx"
        if not (onnx_dir / "fp32" / "manifest.json").is_file():
            export_onnx(args.model_dir, onnx_dir / "fp32", verify=False)
        report["served"] = served(args.model_dir, onnx_dir, work, args.requests, args.concurrency)
        print(json.dumps(report["served"], indent=1), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
