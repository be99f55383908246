"""Production serving in the foreground (``cosyvoice-triton serve``): prepare a model folder (the demo model when
it is missing, the ONNX export when stale, the render; :func:`prepare`) or take a repository ``render`` wrote, then
run ``tritonserver`` under the :class:`~.supervisor.Supervisor` on fixed ports, with the OpenAI speech gateway
beside it, until Ctrl-C (:func:`serve`)."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["DEFAULT_MODEL_DIR", "add_arguments", "add_common_arguments", "check_precision_sources", "main", "prepare",
           "run_serve", "serve", "user_errors"]

DEFAULT_MODEL_DIR = "models/cosyvoice2-demo-tiny"


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
    from ...export.quantize_manifest import read_manifest
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


def serve(model_dir: str | Path = DEFAULT_MODEL_DIR, *, onnx_dir: str | Path = "build/onnx",
          repository: str | Path = "build/model_repository", http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, host: str = "127.0.0.1", flavor: str = "local", precision: str = "fp32",
          gateway_port: int = 8080, rendered: bool = False, public_triton: bool = False, **tunables) -> int:
    """Render and serve in the foreground until SIGINT / SIGTERM, under :class:`~.supervisor.Supervisor` (a model
    whose Python stub dies is reloaded, a server that dies is restarted; it gives up after 5 restarts in 10 min).
    The gateway (``gateway_port``; 0: none) runs as its own process on Triton's gRPC port and stops with it.
    ``rendered``: serve ``repository`` as it is (written by ``render``), without preparing or rendering.
    ``host`` is the gateway's address; Triton's ports stay on loopback (:func:`triton_host`) unless
    ``public_triton``."""
    from .server import TritonServer
    from .supervisor import Supervisor

    if rendered:
        repo = Path(repository)
        if not repo.is_dir():
            raise FileNotFoundError(f"{repo}: no rendered repository (write one with `cosyvoice-triton render`)")
    else:
        repo = prepare(model_dir, onnx_dir=onnx_dir, repository=repository, flavor=flavor, precision=precision,
                       **tunables)
    triton = triton_host(host, public_triton)
    server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=triton,
                          model_control="explicit", load_models=["*"], public=public_triton)
    near = "127.0.0.1" if triton in ("0.0.0.0", "::") else triton  # where the gateway reaches Triton
    supervisor = Supervisor(server, start_timeout=600)
    supervisor.start()
    print(f"serving {repo}: http {server.http_url}, grpc {server.grpc_url}, metrics {server.metrics_url} "
          f"(log {server.log_path}); admin key of the restricted APIs in {server.work_dir / 'admin_key'}; "
          "Ctrl-C stops")
    gateway = None
    if gateway_port:
        gateway = subprocess.Popen([sys.executable, "-m", "cosyvoice_triton.gateway", "--triton-grpc",
                                    f"{near}:{grpc_port}", "--triton-http", f"{near}:{http_port}", "--host", host,
                                    "--port", str(gateway_port), "--grpc-port", str(gateway_port + 1),
                                    "--triton-metrics", f"http://{near}:{metrics_port}/metrics"])
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


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The model folder, its export and the repository: what :func:`prepare` takes (``serve`` and ``demo``)."""
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--onnx-dir", default="build/onnx")
    p.add_argument("--repository", default="build/model_repository")


def triton_host(host: str, public_triton: bool = False) -> str:
    """Where Triton's own ports listen under :func:`serve`: ``host`` when ``public_triton``, else loopback (its ports
    have no keys; the gateway on ``host`` is the door)."""
    return host if public_triton else "127.0.0.1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``serve``'s options."""
    add_common_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (0.0.0.0: every interface); Triton's "
                   "ports stay on 127.0.0.1 unless --public-triton")
    p.add_argument("--public-triton", action="store_true", help="Triton's own ports (no keys) on --host too")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--gateway-port", type=int, default=8080, help="the OpenAI speech gateway's port; 0: none")
    p.add_argument("--flavor", choices=("local", "onnx", "trt"), default="local",
                   help="how the graphs are served (as `render --flavor`)")
    p.add_argument("--precision", default="fp32", help="as `render --precision`")
    p.add_argument("--rendered", action="store_true",
                   help="serve --repository as `render` wrote it (no export, no render)")


def user_errors() -> tuple[type[BaseException], ...]:
    """What a launch reports as one line and exit code 2 (no Triton, a server that failed, a bad model folder)."""
    from ...errors import CosyVoiceError
    from ..repository import RenderError
    from .server import ServerError, TritonNotInstalled

    return TritonNotInstalled, ServerError, CosyVoiceError, FileNotFoundError, RenderError


def run_serve(args: argparse.Namespace) -> int:
    """:func:`serve` with parsed :func:`add_arguments` options."""
    return serve(args.model_dir, onnx_dir=args.onnx_dir, repository=args.repository, host=args.host,
                 http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                 gateway_port=args.gateway_port, flavor=args.flavor, precision=args.precision,
                 rendered=args.rendered, public_triton=args.public_triton)


def main(argv: list[str] | None = None) -> int:
    """``cosyvoice-triton serve ARGS``."""
    p = argparse.ArgumentParser(prog="cosyvoice-triton serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_serve(args)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
