"""The served demo, end to end, and a foreground server.

``python -m cosyvoice_triton.serving.launch.serve_demo demo``: demo model (if missing) -> ONNX export (if missing) ->
render ``build/model_repository`` (flavor ``local``) -> start the ``tritonserver`` of the ``nvidia-pytriton`` wheel
-> convert the bundled sample through the ``cosyvoice_vc`` ensemble with the client -> write the result ->
speak one sentence through ``cosyvoice_tts`` in the prompt's voice (when the model folder has the TTS files) ->
print the latency and per-stage figures from Triton's statistics API -> stop the server.

``python -m cosyvoice_triton.serving.launch.serve_demo serve``: the same preparation, then serve in the foreground on
fixed ports until Ctrl-C, with the OpenAI speech gateway (``cosyvoice_triton.gateway``) beside it on ``--gateway-port``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...resources import path as resource_path

log = logging.getLogger(__name__)

__all__ = ["DemoReport", "format_statistics", "main", "prepare", "run_demo", "serve"]

DEFAULT_MODEL_DIR = "models/cosyvoice2-demo-tiny"
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

    @property
    def warm_latency(self) -> float:
        warm = self.latencies[1:] or self.latencies
        return sorted(warm)[len(warm) // 2]


def prepare(model_dir: str | Path = DEFAULT_MODEL_DIR, *, onnx_dir: str | Path = "build/onnx",
            repository: str | Path = "build/model_repository", flavor: str = "local", precision: str = "fp32",
            demo_size: str = "tiny", **tunables) -> Path:
    """Make sure the model folder and its ONNX export exist, then render the repository. Returns its path."""
    from ..repository import render_repository

    model_dir, onnx_dir = Path(model_dir), Path(onnx_dir)
    if not (model_dir / "flow.pt").is_file():
        if "demo" not in model_dir.name:
            raise FileNotFoundError(f"{model_dir}/flow.pt not found: point --model-dir at a CosyVoice2 folder")
        from ...models.demo import write_demo_model

        print(f"== writing the {demo_size} demo model (random weights) to {model_dir}")
        write_demo_model(model_dir, size=demo_size)
    if flavor != "trt":  # fp32 is every precision's fallback: an export of THIS folder's weights, or made again
        from ...export.onnx_export import export_onnx, stale_graphs

        stale = stale_graphs(model_dir, onnx_dir / "fp32")
        if stale:
            why = "; ".join(f"{g}: {r}" for g, r in stale.items())
            print(f"== exporting ONNX graphs of {model_dir} to {onnx_dir / 'fp32'} ({why})")
            export_onnx(model_dir, onnx_dir / "fp32", graphs=list(stale))
        check_precision_sources(model_dir, onnx_dir, precision)
    report = render_repository(flavor, repository, model_dir=model_dir, onnx_dir=onnx_dir, precision=precision,
                               **tunables)
    print(report.describe())
    return Path(repository)


def check_precision_sources(model_dir: Path, onnx_dir: Path, precision: str) -> None:
    """Refuse to serve a quantised or fp16 graph made from another fp32 graph than the one in ``onnx_dir/fp32``
    (another model folder's): its manifest's ``fp32_sha256`` names what it was made from."""
    from ...export.quantize import read_manifest
    from ...hashing import file_sha256
    from ..repository.precisions import PRECISIONS

    for folder in [] if precision == "fp32" else sorted(set(PRECISIONS) - {"fp32"}):
        graphs = read_manifest(onnx_dir / folder).get("graphs") or {}
        for g, entry in graphs.items():
            fp32 = onnx_dir / "fp32" / f"{g}.onnx"
            if (onnx_dir / folder / f"{g}.onnx").is_file() and fp32.is_file() \
                    and entry.get("fp32_sha256") != file_sha256(fp32):
                raise FileNotFoundError(
                    f"{onnx_dir / folder / g}.onnx was made from another fp32 graph than {fp32} (another model "
                    f"folder's): run `cosyvoice-triton quantize --model-dir {model_dir} --onnx-root {onnx_dir}` again")


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
             **tunables) -> DemoReport:
    """The whole served demo (see the module docstring); prints as it goes and returns the figures."""
    from ...clients.client import CosyVoiceClient
    from ..marker import MARKER
    from .server import TritonServer

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
            stats = client.statistics()
    finally:
        server.stop()
    report = DemoReport(Path(out), result.seconds, latencies, server.start_seconds or 0.0, stats)
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


def serve(model_dir: str | Path = DEFAULT_MODEL_DIR, *, onnx_dir: str | Path = "build/onnx",
          repository: str | Path = "build/model_repository", http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, host: str = "127.0.0.1", flavor: str = "local", precision: str = "fp32",
          gateway_port: int = 8080, rendered: bool = False, **tunables) -> int:
    """Render and serve in the foreground until SIGINT / SIGTERM, under :class:`~.supervisor.Supervisor` (a model
    whose Python stub dies is reloaded, a server that dies is restarted; it gives up after 5 restarts in 10 min).
    The gateway (``gateway_port``; 0: none) runs as its own process on Triton's gRPC port and stops with it.
    ``rendered``: serve ``repository`` as it is (written by ``render``), without preparing or rendering."""
    from .server import TritonServer
    from .supervisor import Supervisor

    if rendered:
        repo = Path(repository)
        if not repo.is_dir():
            raise FileNotFoundError(f"{repo}: no rendered repository (write one with `cosyvoice-triton render`)")
    else:
        repo = prepare(model_dir, onnx_dir=onnx_dir, repository=repository, flavor=flavor, precision=precision,
                       **tunables)
    server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host,
                          model_control="explicit", load_models=["*"])
    supervisor = Supervisor(server, start_timeout=600)
    supervisor.start()
    print(f"serving {repo}: http {server.http_url}, grpc {server.grpc_url}, metrics {server.metrics_url} "
          f"(log {server.log_path}); admin key of the restricted APIs in {server.work_dir / 'admin_key'}; "
          "Ctrl-C stops")
    gateway = None
    if gateway_port:
        gateway = subprocess.Popen([sys.executable, "-m", "cosyvoice_triton.gateway", "--triton-grpc",
                                    f"{host}:{grpc_port}", "--triton-http", f"{host}:{http_port}", "--host", host,
                                    "--port", str(gateway_port), "--grpc-port", str(gateway_port + 1),
                                    "--triton-metrics", f"http://{host}:{metrics_port}/metrics"])
        print(f"gateway (OpenAI speech API): http://{host}:{gateway_port}/v1/audio/speech, Triton's API checked: "
              f"http://{host}:{gateway_port}/v2 and gRPC {host}:{gateway_port + 1} (pid {gateway.pid})")
    stop = {"now": False}

    def handler(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    try:
        while not stop["now"] and not supervisor.failed and (gateway is None or gateway.poll() is None):
            time.sleep(0.5)
    finally:
        if gateway is not None:
            gateway.terminate()
            try:
                gateway.wait(timeout=15)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()
        supervisor.stop()
        code = server.stop()
    print(f"tritonserver stopped (exit code {code})")
    if supervisor.failed:
        print(f"error: {supervisor.failed}", file=sys.stderr)
        return 1
    if gateway is not None and not stop["now"]:
        print(f"error: the gateway exited (code {gateway.returncode})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_triton.serving.launch.serve_demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("demo", "serve"):
        s = sub.add_parser(name)
        s.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
        s.add_argument("--onnx-dir", default="build/onnx")
        s.add_argument("--repository", default="build/model_repository")
        if name == "demo":
            s.add_argument("--source", default=str(DEFAULT_SOURCE))
            s.add_argument("--prompt", default=str(DEFAULT_PROMPT))
            s.add_argument("-o", "--output", default="build/vc_served_demo.wav")
            s.add_argument("--protocol", choices=("http", "grpc"), default="http")
            s.add_argument("--repeats", type=int, default=3)
            s.add_argument("--seed", type=int, default=0)
            s.add_argument("--tts-text", default=DEFAULT_TTS_TEXT, help="the sentence spoken through cosyvoice_tts")
            s.add_argument("--tts-output", default="build/tts_served_demo.wav")
        else:
            s.add_argument("--host", default="127.0.0.1")
            s.add_argument("--http-port", type=int, default=8000)
            s.add_argument("--grpc-port", type=int, default=8001)
            s.add_argument("--metrics-port", type=int, default=8002)
            s.add_argument("--gateway-port", type=int, default=8080, help="the OpenAI speech gateway's port; 0: none")
            s.add_argument("--flavor", choices=("local", "onnx", "trt"), default="local",
                           help="how the graphs are served (as `render --flavor`)")
            s.add_argument("--precision", default="fp32", help="as `render --precision`")
            s.add_argument("--rendered", action="store_true",
                           help="serve --repository as `render` wrote it (no export, no render)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ...errors import CosyVoiceError
    from ..repository import RenderError
    from .server import ServerError, TritonNotInstalled

    try:
        if args.command == "demo":
            run_demo(args.model_dir, source=args.source, prompt=args.prompt, output=args.output,
                     onnx_dir=args.onnx_dir, repository=args.repository, protocol=args.protocol,
                     repeats=args.repeats, seed=args.seed, tts_text=args.tts_text, tts_output=args.tts_output)
            return 0
        return serve(args.model_dir, onnx_dir=args.onnx_dir, repository=args.repository, host=args.host,
                     http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                     gateway_port=args.gateway_port, flavor=args.flavor, precision=args.precision,
                     rendered=args.rendered)
    except (TritonNotInstalled, ServerError, CosyVoiceError, FileNotFoundError, RenderError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2



def serve_main(argv: list[str] | None = None) -> int:
    """``cosyvoice-triton serve ARGS``."""
    return main(["serve", *(argv or [])])


def demo_main(argv: list[str] | None = None) -> int:
    """``cosyvoice-triton demo ARGS``."""
    return main(["demo", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main())
