"""The served demo, end to end (``cosyvoice-triton demo``).

``python -m cosyvoice_triton.serving.launch.serve_demo demo``: demo model (if missing) -> ONNX export (if missing) ->
render ``build/model_repository`` (flavor ``local``) -> start the ``tritonserver`` of the ``nvidia-pytriton`` wheel
-> convert the bundled sample through the ``cosyvoice_vc`` ensemble with the client -> write the result ->
speak one sentence through ``cosyvoice_tts`` in the prompt's voice (when the model folder has the TTS files) ->
with ``--cosyvoice3-dir`` (``make demo``: the CosyVoice3 demo folder, written if missing), the same conversion and
sentence through ``cosyvoice3_vc`` and ``cosyvoice3_tts`` -> print the latency and per-stage figures from Triton's
statistics API -> stop the server.

Production serving (``cosyvoice-triton serve``: the same preparation, then a supervised server in the foreground)
lives in :mod:`.serve`; ``python -m cosyvoice_triton.serving.launch.serve_demo serve`` and this module's ``prepare``,
``check_precision_sources``, ``serve`` and ``DEFAULT_MODEL_DIR`` still reach it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...resources import path as resource_path
from .serve import (  # re-exported: callers of this module used them from here
    DEFAULT_MODEL_DIR,
    add_arguments,
    add_common_arguments,
    check_precision_sources,
    prepare,
    run_serve,
    serve,
    user_errors,
)
from .serve import main as _serve_main

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_DIR", "DemoReport", "check_precision_sources", "format_statistics", "main", "prepare",
           "run_demo", "serve"]

DEFAULT_SOURCE = resource_path("tests/fixtures/source_en_5s.wav")
DEFAULT_PROMPT = resource_path("tests/fixtures/prompt_en_3s.wav")
DEFAULT_TTS_TEXT = "Hello from CosyVoice on Triton: this sentence was spoken by the served text to speech pipeline."


@dataclass
class DemoReport:
    output: Path
    seconds: float  # audio produced
    latencies: list[float]  # per conversion, first (cold) included
    server_start_s: float
    statistics: dict[str, Any] = field(default_factory=dict)
    tts_output: Path | None = None  # the sentence spoken through cosyvoice_tts (None: no TTS in this model folder)
    tts_seconds: float = 0.0
    tts_latency_s: float = 0.0
    cosyvoice3_outputs: list[Path] = field(default_factory=list)  # conversion and sentence through CosyVoice3

    @property
    def warm_latency(self) -> float:
        warm = self.latencies[1:] or self.latencies
        return sorted(warm)[len(warm) // 2]


def format_statistics(stats: dict) -> str:
    """Per-model table from Triton's statistics (``get_inference_statistics`` as a dict)."""
    rows = [f"  {'model':<18} {'requests':>8} {'executions':>10} {'avg batch':>9} {'queue ms':>9} "
            f"{'compute ms':>10} {'request ms':>10}"]
    for s in sorted(stats.get("model_stats", []), key=lambda s: s["name"]):
        inf, ex = int(s.get("inference_count", 0)), int(s.get("execution_count", 0))
        st = s.get("inference_stats", {})

        def ms(key, st=st):
            d = st.get(key, {})
            n = int(d.get("count", 0))
            return int(d.get("ns", 0)) / n / 1e6 if n else 0.0

        compute = ms("compute_input") + ms("compute_infer") + ms("compute_output")
        rows.append(f"  {s['name']:<18} {inf:>8} {ex:>10} {inf / ex if ex else 0:>9.2f} {ms('queue'):>9.1f} "
                    f"{compute:>10.1f} {ms('success'):>10.1f}")
    return "\n".join(rows)


def run_demo(model_dir: str | Path = DEFAULT_MODEL_DIR, *, source: str | Path = DEFAULT_SOURCE,
             prompt: str | Path = DEFAULT_PROMPT, output: str | Path = "build/vc_served_demo.wav",
             onnx_dir: str | Path = "build/onnx", repository: str | Path = "build/model_repository",
             protocol: str = "http", repeats: int = 3, seed: int = 0, startup_timeout: float = 300.0,
             tts_text: str = DEFAULT_TTS_TEXT, tts_output: str | Path = "build/tts_served_demo.wav",
             cosyvoice3_dir: str | Path | None = None, **tunables) -> DemoReport:
    """The whole served demo (see the module docstring); prints as it goes and returns the figures."""
    from ...clients.client import CosyVoiceClient
    from ..marker import MARKER
    from .server import TritonServer

    if cosyvoice3_dir is not None:
        tunables["cosyvoice3_dir"] = str(_cosyvoice3_folder(Path(cosyvoice3_dir)))
    repo = prepare(model_dir, onnx_dir=onnx_dir, repository=repository, **tunables)
    server = TritonServer(repo, exit_timeout=10)
    print("== starting tritonserver")
    server.start(timeout=startup_timeout)
    print(f"   ready in {server.start_seconds:.1f} s: http {server.http_url}, grpc {server.grpc_url}, "
          f"metrics {server.metrics_url}; log {server.log_path}")
    try:
        url = server.http_url if protocol == "http" else server.grpc_url
        with CosyVoiceClient(url, protocol=protocol) as client:
            latencies, result = [], None
            print(f"== converting {source} in the voice of {prompt} over {protocol} ({max(1, repeats)} runs)")
            for _ in range(max(1, repeats)):
                result = client.convert(source, prompt, seed=seed)
                latencies.append(result.latency_s)
            out = result.write(output)
            spoken = None
            if "cosyvoice_tts" in json.loads((Path(repo) / MARKER).read_text())["models"]:
                print(f"== speaking {tts_text!r} through cosyvoice_tts in the voice of {prompt} over {protocol}")
                spoken = client.tts(tts_text, prompt=prompt, seed=seed)
                spoken_path = spoken.write(tts_output)
            cv3 = _cosyvoice3_demo(url, protocol, source, prompt, tts_text) if cosyvoice3_dir is not None else []
            stats = client.statistics()
    finally:
        server.stop()
    report = DemoReport(Path(out), result.seconds, latencies, server.start_seconds or 0.0, stats,
                        cosyvoice3_outputs=cv3)
    print(f"wrote {out}: {report.seconds:.2f} s at {result.sample_rate} Hz")
    if spoken is not None:
        report.tts_output, report.tts_seconds = Path(spoken_path), spoken.seconds
        report.tts_latency_s = spoken.latency_s
        print(f"wrote {spoken_path}: {spoken.seconds:.2f} s of text to speech in {spoken.latency_s * 1000:.0f} ms "
              f"(real-time factor {spoken.latency_s / max(spoken.seconds, 1e-9):.3f})")
    print(f"latency: first {latencies[0] * 1000:.0f} ms, warm median {report.warm_latency * 1000:.0f} ms "
          f"(real-time factor {report.warm_latency / max(report.seconds, 1e-9):.3f})")
    print("per-model statistics (Triton statistics API; graphs count batch rows):")
    print(format_statistics(stats))
    return report


def _cosyvoice3_folder(path: Path) -> Path:
    """``path``, a CosyVoice3 folder; a missing demo folder (``demo`` in its name) is written first."""
    if not (path / "cosyvoice3.yaml").is_file() and "demo" in path.name:
        from ...models.cosyvoice3.demo import write_demo_model3

        print(f"== writing the tiny CosyVoice3 demo model (random weights) to {path}")
        write_demo_model3(path)
    return path


def _cosyvoice3_demo(url: str, protocol: str, source, prompt, text: str) -> list[Path]:
    """The conversion and the sentence again, through ``cosyvoice3_vc`` and ``cosyvoice3_tts``: the files written."""
    from ...clients.client import CosyVoiceClient

    written = []
    with CosyVoiceClient(url, protocol=protocol, model="cosyvoice3_vc") as client:
        print(f"== CosyVoice3: converting {source} through cosyvoice3_vc, speaking through cosyvoice3_tts")
        for name, result in (("vc3_served_demo.wav", client.convert(source, prompt)),
                             ("tts3_served_demo.wav", client.tts(text, prompt=prompt, model="cosyvoice3_tts"))):
            path = Path(result.write(Path("build") / name))
            print(f"wrote {path}: {result.seconds:.2f} s in {result.latency_s * 1000:.0f} ms (real-time factor "
                  f"{result.latency_s / max(result.seconds, 1e-9):.3f})")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.serving.launch.serve_demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo")
    add_common_arguments(d)
    d.add_argument("--source", default=str(DEFAULT_SOURCE))
    d.add_argument("--prompt", default=str(DEFAULT_PROMPT))
    d.add_argument("-o", "--output", default="build/vc_served_demo.wav")
    d.add_argument("--protocol", choices=("http", "grpc"), default="http")
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--tts-text", default=DEFAULT_TTS_TEXT, help="the sentence spoken through cosyvoice_tts")
    d.add_argument("--tts-output", default="build/tts_served_demo.wav")
    d.add_argument("--cosyvoice3-dir", default=None,
                   help="a CosyVoice3 folder served beside --model-dir (a missing *demo* folder is written); the "
                        "conversion and the sentence go through it too (build/vc3_served_demo.wav, "
                        "build/tts3_served_demo.wav)")
    add_arguments(sub.add_parser("serve", help="as `cosyvoice-triton serve` (cosyvoice_triton.serving.launch.serve)"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            run_demo(args.model_dir, source=args.source, prompt=args.prompt, output=args.output,
                     onnx_dir=args.onnx_dir, repository=args.repository, protocol=args.protocol,
                     repeats=args.repeats, seed=args.seed, tts_text=args.tts_text, tts_output=args.tts_output,
                     cosyvoice3_dir=args.cosyvoice3_dir)
            return 0
        return run_serve(args)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def serve_main(argv: list[str] | None = None) -> int:
    """``cosyvoice-triton serve ARGS``: :func:`.serve.main`, kept here for callers of this module."""
    return _serve_main(argv)


def demo_main(argv: list[str] | None = None) -> int:
    """``cosyvoice-triton demo ARGS``."""
    return main(["demo", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main())
