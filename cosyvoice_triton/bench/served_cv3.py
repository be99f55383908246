"""CosyVoice3 through the server: ``cosyvoice3_tts_stream``'s first streamed chunk and each later one, and a whole
``cosyvoice3_vc`` conversion, over Triton's gRPC and in process, the same request both ways.

A ``tritonserver`` started here serves a repository rendered with ``cosyvoice3_dir`` (default: the full-size demo
folder) beside the tiny CosyVoice2 demo, and loads only the two models measured (model control ``explicit``: every
CosyVoice3 model holds its own copy of the weights, and at the release's dims all six would not fit a 24 GB
machine beside this process). In process: the served model's own service
(:func:`~..serving.stages.cosyvoice3.build_service`) on the parameters the server's model read (its config over the
admin HTTP API), with its stream state and torch threads. Requests: a zero-shot TTS of ``--text`` in the voice of the
bundled 3 s English prompt and its transcript; the bundled 5 s source in that voice. Each chunk is checked against
the in-process one (max |difference| at most 1e-3 of its peak, as many chunks of the same lengths).

A chunk's latency: the first from the request, each later one from the chunk before. The first round is cold
(the prompt's features, the first calls into each kernel) and reported apart; the rounds after it alternate which
side goes first, and their medians are the figures. Figures, never assertions; the load average is printed at the
start and the end, with the commit and the CPU.

    cosyvoice-triton bench-served-cv3 [--model-dir models/cosyvoice3-demo-full] [--rounds 3] [--set torch_threads=2]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..serving.repository.tunables import SET_HELP, TunableAction
from .server_overhead import CHUNK_BAR, Inputs, Run, compare, load_average, load_inputs, machine, p50

TTS_MODEL, VC_MODEL = "cosyvoice3_tts_stream", "cosyvoice3_vc"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet green forest."


def tts_tensors(inp: Inputs) -> dict[str, np.ndarray]:
    """The TTS request as the client sends it: the text, the prompt and its transcript (no seed: the default)."""
    return {"text": np.array([[inp.text.encode()]], object), "prompt_text": np.array([[inp.prompt_text.encode()]],
                                                                                       object),
            "prompt_audio": inp.prompt[None], "prompt_sample_rate": np.array([[inp.prompt_sr]], np.int32)}


def vc_tensors(inp: Inputs) -> dict[str, np.ndarray]:
    """The VC request as the client sends it (no seed: CosyVoice3's vocoder noise is the checkpoint's)."""
    return {k: v for k, v in inp.vc_tensors().items() if k != "seed"}


class Served:
    """The served side: the project's gRPC client, one request at a time, one connection for the run."""

    def __init__(self, grpc_url: str, inputs: Inputs, timeout: float):
        from ..clients.client import CosyVoiceClient

        self.inputs = inputs
        self.client = CosyVoiceClient(grpc_url, protocol="grpc", model=VC_MODEL, timeout=timeout)

    def tts(self) -> Run:
        inp = self.inputs
        got = list(self.client.tts_stream(inp.text, prompt=inp.prompt, prompt_sr=inp.prompt_sr,
                                          prompt_text=inp.prompt_text, model=TTS_MODEL))
        return Run.from_arrivals(0.0, [c.elapsed_s for c in got], [c.waveform for c in got])

    def vc(self) -> Run:
        inp = self.inputs
        t0 = time.perf_counter()
        got = self.client.convert(inp.source, inp.prompt, source_sr=inp.source_sr, prompt_sr=inp.prompt_sr)
        return Run(time.perf_counter() - t0, [], [got.waveform])

    def close(self) -> None:
        self.client.close()


class Local:
    """The in-process side: the served model's own service, built from the parameters it read."""

    def __init__(self, params: dict[str, Any], inputs: Inputs):
        import torch

        from ..serving.stages.cosyvoice3 import build_service

        torch.set_num_threads(int(params["torch_threads"]))
        self.service = build_service(None, {**params, "speakers_model": ""})
        self.tts_request, self.vc_request = tts_tensors(inputs), vc_tensors(inputs)

    def tts(self) -> Run:
        chunks, arrivals = [], []
        t0 = time.perf_counter()
        for response in self.service.responses(self.tts_request):
            arrivals.append(time.perf_counter())
            chunks.append(np.asarray(response["waveform"]).reshape(-1))
        return Run.from_arrivals(t0, arrivals, chunks)

    def vc(self) -> Run:
        t0 = time.perf_counter()
        wave = self.service.convert(self.vc_request)["waveform"]
        return Run(time.perf_counter() - t0, [], [np.asarray(wave).reshape(-1)])


def summarize(runs: list[Run], sample_rate: int) -> dict[str, Any]:
    """One side: the cold round's first chunk, the warm rounds' median first and later chunk, the chunk count."""
    cold, warm = runs[0], runs[1:]
    return {"cold_first_s": cold.first_s, "chunks": len(cold.chunks),
            "first_p50_s": p50([r.first_s for r in warm]), "later_p50_s": p50([x for r in warm for x in r.later_s]),
            "audio_s": sum(c.size for c in cold.chunks) / sample_rate}


def run_rounds(local: Local, served: Served, rounds: int, sample_rate: int, log=print) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for model, how in ((TTS_MODEL, "tts"), (VC_MODEL, "vc")):
        runs: dict[str, list[Run]] = {"in_process": [], "served": []}
        errors = []
        for k in range(rounds):
            order = ("in_process", "served") if k % 2 == 0 else ("served", "in_process")
            got = {side: getattr(local if side == "in_process" else served, how)() for side in order}
            for side in order:
                runs[side].append(got[side])
            errors.append(compare(got["served"], got["in_process"])[1])
            log(f"  {model} round {k + 1}/{rounds}{' (cold)' if k == 0 else ''}: "
                + ", ".join(f"{s} first {got[s].first_s:.2f} s of {len(got[s].chunks)} chunk(s)" for s in order)
                + f", max chunk error {errors[-1]:.1e}")
        sides = {side: summarize(rs, sample_rate) for side, rs in runs.items()}
        first = [sides[s]["first_p50_s"] for s in ("served", "in_process")]
        err = max(errors)
        report[model] = {**sides, "max_chunk_error": err if np.isfinite(err) else None, "equal": err <= CHUNK_BAR,
                         "server_adds_first_s": None if None in first else first[0] - first[1]}
    return report


@contextlib.contextmanager
def server(args: argparse.Namespace, work: Path) -> Iterator[Any]:
    """A tritonserver on the rendered repository with only the two measured models loaded (stopped on every way
    out)."""
    from ..serving.launch.serve import prepare
    from ..serving.launch.server import TritonServer

    repo = prepare(args.cv2_dir, onnx_dir=args.onnx_dir, repository=work / "model_repository", demo_size="tiny",
                   speaker_dir=str(work / "speakers"), cosyvoice3_dir=str(Path(args.model_dir).resolve()),
                   **dict(args.set or []))
    s = TritonServer(repo, work_dir=work / "triton", model_control="explicit", load_models=[TTS_MODEL, VC_MODEL],
                     exit_timeout=5, start_timeout=args.start_timeout)
    try:
        s.start()
        yield s
    finally:
        s.stop()


def loaded_models(http_url: str) -> list[str]:
    """The models the server reports READY (its repository index)."""
    import tritonclient.http as httpclient

    from ..admin import admin_headers, given_admin_key

    with contextlib.closing(httpclient.InferenceServerClient(http_url, network_timeout=60.0)) as client:
        index = client.get_model_repository_index(headers=admin_headers("http", given_admin_key(None)))
    return sorted(m["name"] for m in index if m.get("state") == "READY")


def run_bench(args: argparse.Namespace, log=print) -> dict[str, Any]:
    from .stages_in_process import ServedConfigs

    model_dir = Path(args.model_dir)
    if not (model_dir / "flow.pt").is_file():
        from ..models.cosyvoice3.demo import write_demo_model3

        size = "full" if "full" in model_dir.name else "tiny"
        log(f"== writing the {size} CosyVoice3 demo folder (random weights) to {model_dir}")
        write_demo_model3(model_dir, size=size)
    report: dict[str, Any] = {**machine(), "load_start": load_average(), "model_dir": str(model_dir),
                              "rounds": args.rounds, "text": args.text, "tunables": dict(args.set or [])}
    log(f"== {report['commit']} on {report['cpu']} ({report['cores']} cores), load average {report['load_start']}")
    inputs = load_inputs(text=args.text)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(server(args, work))
        report["loaded_models"] = loaded_models(s.http_url)
        configs = ServedConfigs(s.http_url, repository=s.model_repository)
        stack.callback(configs.close)
        params = configs.params(TTS_MODEL)
        log(f"== the in-process side: {TTS_MODEL}'s service on its parameters (torch threads "
            f"{params['torch_threads']}); loaded: {', '.join(report['loaded_models'])}")
        local = Local(params, inputs)
        stack.callback(local.service.close)
        served = Served(s.grpc_url, inputs, args.timeout)
        stack.callback(served.close)
        report["torch_threads"] = int(params["torch_threads"])
        rate = local.service.model.sample_rate if not params["output_sample_rate"] else params["output_sample_rate"]
        report["models"] = run_rounds(local, served, args.rounds, int(rate), log)
    report["load_end"] = load_average()
    return report


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def report_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"commit {report['commit']}, {report['cpu']} ({report['simd']}), {report['cores']} cores; load average "
             f"{report['load_start']} at the start, {report['load_end']} at the end; torch threads "
             f"{report['torch_threads']}; {report['rounds']} rounds (the first cold); tunables "
             f"{report['tunables'] or 'the defaults'}", "",
             "| model | side | cold first (s) | first p50 (s) | later p50 (s) | chunks | audio (s) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for model, m in report["models"].items():
        for side in ("in_process", "served"):
            r = m[side]
            lines.append(f"| {model} | {side.replace('_', ' ')} | {_s(r['cold_first_s'])} | {_s(r['first_p50_s'])} "
                         f"| {_s(r['later_p50_s'])} | {r['chunks']} | {r['audio_s']:.2f} |")
    lines.append("")
    for model, m in report["models"].items():
        err = m["max_chunk_error"]
        lines.append(f"- {model}: the server adds {_s(m['server_adds_first_s'])} s to the first chunk (p50); "
                     + (f"chunks equal (max error {err:.1e} of the peak, bar {CHUNK_BAR:g})" if m["equal"] else
                        "chunks NOT equal" + (f" (max error {err:.1e})" if err is not None else " (shapes differ)")))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-triton bench-served-cv3", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/cosyvoice3-demo-full",
                   help="a CosyVoice3 folder (written as a demo folder when missing; default the full-size demo)")
    p.add_argument("--cv2-dir", default="models/cosyvoice2-demo-tiny",
                   help="the CosyVoice2 folder the repository is rendered around (default the tiny demo)")
    p.add_argument("--onnx-dir", default="build/onnx", help="its ONNX export (made when missing)")
    p.add_argument("--work-dir", default="build/bench-served-cv3", help="repository, server logs (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the first cold (default 3)")
    p.add_argument("--text", default=TEXT, help="the TTS text")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one answer")
    p.add_argument("--start-timeout", type=float, default=1200.0, help="seconds to wait for the server to be ready")
    p.add_argument("--set", action=TunableAction, default=[], help=SET_HELP)
    p.add_argument("--json", default=None, help="also write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        print("bench-served-cv3: --rounds must be >= 1", file=sys.stderr)
        return 2

    def stop(signum, frame):  # SIGTERM unwinds as Ctrl-C does: the server is stopped on the way out
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    report = run_bench(args)
    print("\n".join(["", *report_lines(report)]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
