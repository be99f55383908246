"""The subcommands of ``cosyvoice-triton`` that hand their arguments to another entry point unchanged.

Each entry is a command with its own parser (``cosyvoice-triton client --help`` shows that parser's help): a
``module:function`` of this package, called with the remaining arguments, or a script of the repository
(``export/``, ``model_repository/``: the clone's, or the installed package's copy, :mod:`.resources`), run as
``python SCRIPT ARGS``.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
import warnings
from collections.abc import Sequence

from . import resources

#: name -> (help, target, examples)
PASSTHROUGH: dict[str, tuple[str, str, str]] = {
    "client": ("client of a running server: vc, tts, speaker, tokens, embedding (HTTP or gRPC, streams, live)",
               "cosyvoice_triton.clients.cli:main",
               "client tts --text 'Hello there.' --speaker alice -o hi.wav"),
    "serve": ("render the repository, start tritonserver (supervised) and the HTTP gateway until Ctrl-C",
              "cosyvoice_triton.serving.launch.serve:main",
              "serve --model-dir models/cosyvoice2-demo-tiny --gateway-port 8080"),
    "demo": ("start a server, convert a sample and speak a sentence through it, stop it",
             "cosyvoice_triton.serving.launch.serve_demo:demo_main",
             "demo --model-dir models/cosyvoice2-demo-tiny --source a.wav --prompt b.wav -o out.wav"),
    "supervise": ("the production launcher: tritonserver restarted when it dies, stubs reloaded",
                  "cosyvoice_triton.serving.launch.supervisor:main",
                  "supervise --model-repository build/model_repository"),
    "render": ("render build/model_repository from the templates (flavor, precision, tunables, versions)",
               "model_repository/render.py",
               "render --flavor local --model-dir models/cosyvoice2-demo-tiny "
               "--set instances=flow:2,max_queue_delay_us=5000"),
    "gateway": ("the HTTP gateway alone (OpenAI speech API, CosyVoice's routes, the page) in front of Triton",
                "cosyvoice_triton.gateway.__main__:main",
                "gateway --triton-grpc 127.0.0.1:8001 --port 8080"),
    "loadtest": ("Locust + perf_analyzer load test, plain vs integrated (VC, TTS, mixed, prompt cache)",
                 "cosyvoice_triton.loadtest.runner:main",
                 "loadtest --config tiny --mode tts"),
    "loadtest-live": ("live-input streams at real-time pace: latency per chunk, underruns",
                      "cosyvoice_triton.loadtest.live:main", "loadtest-live --config tiny"),
    "loadtest-rollout": ("a rollout under load: stage, canary, promote, rollback",
                         "cosyvoice_triton.loadtest.rollout:main", "loadtest-rollout"),
    "soak": ("a long run under load: memory growth, failures", "cosyvoice_triton.loadtest.soak:main",
             "soak --model-dir models/cosyvoice2-demo-tiny --minutes 30"),
    "bench-tts": ("LM prefill / decode, RTF, the first streamed chunk at full dims",
                  "cosyvoice_triton.bench.tts:main", "bench-tts --model-dir models/cosyvoice2-demo-full"),
    "bench-peer": ("the official code against the library and the served pipeline",
                   "cosyvoice_triton.bench.peer:main", "bench-peer --official ~/CosyVoice"),
    "bench-cv3": ("CosyVoice3: the official code against the library at full dims",
                  "cosyvoice_triton.bench.cosyvoice3:main", "bench-cv3 --official ~/CosyVoice"),
    "bench-live-cv3": ("live CosyVoice3 conversion per chunk as the stream grows, against the official recompute",
                       "cosyvoice_triton.bench.live_vc3:main",
                       "bench-live-cv3 --model-dir models/cosyvoice3-demo-full --seconds 20"),
    "bench-cv3-graphs": ("one step of CosyVoice3's DiT in PyTorch and on its ONNX graph, alone and in padded batches",
                         "cosyvoice_triton.bench.cv3_graphs:main",
                         "bench-cv3-graphs --model-dir models/cosyvoice3-demo-full --frames 500"),
    "bench-gpu": ("the GPU scenario without Triton (VC batches, streaming TTS)", "cosyvoice_triton.bench.gpu:main",
                  "bench-gpu --size tiny --device cpu"),
    "bench-incremental": ("streaming token-to-wav with and without the incremental flow",
                          "cosyvoice_triton.bench.incremental:main",
                          "bench-incremental --model-dir models/cosyvoice2-demo-full"),
    "bench-schedule": ("what a latency-first stream schedule costs in quality and gains in first-chunk time",
                       "cosyvoice_triton.bench.stream_schedule:main",
                       "bench-schedule --model-dir models/cosyvoice2-demo-tiny"),
    "bench-prompt-cache": ("the prompt cache on and off, in process and served",
                           "cosyvoice_triton.bench.prompt_cache:main",
                           "bench-prompt-cache --model-dir models/cosyvoice2-demo-tiny"),
    "bench-neighbour": ("the first streamed TTS chunk beside busy processes: torch's default threads against the "
                        "library's choice", "cosyvoice_triton.bench.neighbour:main",
                        "bench-neighbour --neighbours 2 --rounds 5 --json build/bench-neighbour.json"),
    "bench-server-overhead": ("what the server adds to the library for the same chunk: the four streaming models "
                              "in process and served", "cosyvoice_triton.bench.server_overhead:main",
                              "bench-server-overhead --model-dir models/cosyvoice2-demo-tiny --rounds 5"),
    "bench-served-cv3": ("CosyVoice3 through the server: the first streamed TTS chunk and a whole conversion, served "
                         "and in process", "cosyvoice_triton.bench.served_cv3:main",
                         "bench-served-cv3 --model-dir models/cosyvoice3-demo-full --rounds 3"),
    "bench-lm-kernels": ("the LM's Linear layers in INT8 through PyTorch, onnxruntime and OpenVINO: speed and quality",
                         "cosyvoice_triton.bench.lm_kernels:main",
                         "bench-lm-kernels --model-dir models/cosyvoice2-demo-full --threads 2"),
    "export-onnx": ("verified fp32 ONNX of every graph", "export/export_onnx.py",
                    "export-onnx --model-dir models/cosyvoice2-demo-tiny --out build/onnx/fp32"),
    "quantize": ("INT8 / fp16 graphs calibrated on speech", "export/quantize.py",
                 "quantize --model-dir models/cosyvoice2-demo-tiny --onnx-root build/onnx"),
    "quality": ("the quality report of the quantized graphs", "export/quality_report.py",
                "quality --model-dir models/cosyvoice2-demo-tiny --onnx-root build/onnx --out build/quality"),
    "engines": ("TensorRT engines (the NGC container)", "export/build_engines.py",
                "engines --onnx-dir build/onnx --engine-dir build/engines --dry-run"),
    "convert-llm": ("the LM as a Hugging Face / TensorRT-LLM checkpoint", "export/convert_llm.py",
                    "convert-llm --model-dir models/cosyvoice2-demo-tiny --out build/llm_hf --verify"),
}


def add_passthrough(sub) -> None:
    """Register every :data:`PASSTHROUGH` command on an ``add_subparsers`` object."""
    for name, (help_, target, example) in PASSTHROUGH.items():
        p = sub.add_parser(name, help=help_, add_help=False, description=f"{help_}. Example: cosyvoice-triton "
                           f"{example}  (--help: the options of {target})")
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args, target=target, name=name: run(target, args.args, prog=name))


def run(target: str, argv: list[str], *, prog: str) -> int:
    """Call ``module:function(argv)``, or run a repository script with ``argv``; returns its exit code."""
    saved = sys.argv
    sys.argv = [f"cosyvoice-triton {prog}", *argv]
    try:
        if ":" in target:
            module, function = target.split(":")
            rc = getattr(importlib.import_module(module), function)(list(argv))
            return 0 if rc is None else int(rc)
        script = resources.path(target)
        if not script.is_file():
            print(f"cosyvoice-triton {prog}: {script} not found: this package was built without {target} (build "
                  "it from a whole clone)", file=sys.stderr)
            return 2
        runpy.run_path(str(script), run_name="__main__")
        return 0
    except SystemExit as exc:  # argparse's --help and usage errors, a script's sys.exit
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved


class _Parsed(Exception):
    """Raised in place of parsing: the parser a command line was about to parse with, and its arguments."""

    def __init__(self, parser: argparse.ArgumentParser, argv: list[str]):
        super().__init__(parser.prog)
        self.parser, self.argv = parser, argv


def command_parser(target: str, argv: Sequence[str] = (), *, prog: str = "") -> tuple[argparse.ArgumentParser,
                                                                                    list[str]]:
    """The parser a command line parses ``argv`` with, and the arguments it hands that parser, without running it.

    ``target`` is what :func:`run` takes (``module:function``, or a repository script), or a module run as
    ``python -m MODULE`` (``cosyvoice_triton`` itself: the top-level parser, or a passthrough command's own). The
    command runs up to its first ``parse_args`` / ``parse_known_args``, which raises instead of parsing, so the
    parser is the real one, built by the command's own code; a command may change its arguments before that (the
    client puts ``vc`` in front when no command is given). For checks of documented command lines
    (``tests/unit/test_docs_commands.py``)."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self, list(sys.argv[1:] if args is None else args))

    argparse.ArgumentParser.parse_known_args = capture
    saved = sys.argv
    try:
        if ":" in target or target.endswith(".py"):
            run(target, list(argv), prog=prog or target)
        else:
            sys.argv = [prog or target, *argv]
            with warnings.catch_warnings():  # runpy: "found in sys.modules" for a module imported before
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(target, run_name="__main__", alter_sys=False)
    except _Parsed as parsed:
        return parsed.parser, parsed.argv
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv = saved
    raise LookupError(f"{target} {' '.join(argv)}: no argparse command line")
