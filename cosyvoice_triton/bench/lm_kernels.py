"""``cosyvoice-triton bench-lm-kernels``: the LM's Linear layers in INT8 through each CPU runtime, and what each
precision costs in quality.

    python -m cosyvoice_triton.bench.lm_kernels [--model-dir models/cosyvoice2-demo-full] [--threads 2]

A decode step of the Qwen2 trunk is, at batch 1 to 8, its Linear layers (q/k/v/o projections and the MLP's
gate/up/down): their weights are read once per step, the rest (norms, RoPE, attention over the cache) is a few
percent. So the runtimes are compared where they differ, on those layers: for each scheme, every trunk Linear is
built as that runtime's one-layer kernel with its own weights, and one pass through all of them in the trunk's
order is timed at each batch (the weights stream from memory as in a decode step). That is the Linear time of one
step and its ceiling on the decode rate (``batch / step time``: no attention, nothing around it, so a whole decode
runs slower). Then the quality: the LM with those kernels, teacher-forced on fp32's tokens of one bench request
against fp32 (:func:`~cosyvoice_triton.bench.tts.int8_quality`, the bar of :mod:`~cosyvoice_triton.models.lm_quant`).

Schemes (a runtime that is not installed is reported, not measured):

* ``torch-fp32``: ``nn.Linear`` as the checkpoint runs it.
* ``torch-int8``: PyTorch's dynamic INT8 Linear, the served ``lm_precision int8``.
* ``ort-fp32``: onnxruntime's MatMul, the kernel of ``lm_precision fp32-ort`` (:mod:`~cosyvoice_triton.models.lm_ort`).
* ``ort-int8``: onnxruntime's dynamic quantisation (``quantize_dynamic``: MatMulInteger, int8 weights per output
  channel, activations quantised per tensor at each call), the scheme of ``torch-int8``.
* ``ort-int8-block32``: onnxruntime's MatMulNBits with 8-bit weights in blocks of 32 along the input and
  ``accuracy_level`` 4 (activations quantised to int8 per block of 32: a finer grid than per tensor).
* ``ov-fp32`` and ``ov-int8-weights``: OpenVINO's CPU plugin, fp32 and with NNCF's INT8 weight compression
  (``nncf.compress_weights``, asymmetric per output channel). Needs ``pip install openvino nncf``.

Figures, not assertions. Run it on a quiet machine; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import LLMConfig, ModelConfig
from ..models.lm_ort import OrtKernel, OrtLinear, linear_model, ort_linears

SCHEMES = ("torch-fp32", "torch-int8", "ort-fp32", "ort-int8", "ort-int8-block32", "ov-fp32", "ov-int8-weights")
Kernel = Callable[[np.ndarray], np.ndarray]  # [rows, in] float32 -> [rows, out] float32


class Unavailable(RuntimeError):
    """A scheme whose runtime is not installed here."""


def _onnx_linear(weight: np.ndarray, bias: np.ndarray | None) -> bytes:
    """A self-contained one-layer ONNX model ``y = x @ weight.T (+ bias)`` (the quantisers and OpenVINO read it)."""
    return linear_model(weight.shape[1], weight.shape[0], bias, weight_t=weight.T)


def _ort_kernel(scheme: str, weight: np.ndarray, bias: np.ndarray | None, threads: int) -> Kernel:
    if scheme == "ort-fp32":  # the served lm_precision fp32-ort's kernel
        return OrtKernel(weight, bias, threads=threads)
    import onnx
    import onnxruntime as ort

    model = _onnx_linear(weight, bias)
    if scheme == "ort-int8":
        model = _quantize_dynamic(model)
    elif scheme == "ort-int8-block32":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
        quantizer = MatMulNBitsQuantizer(onnx.load_from_string(model), bits=8, block_size=32, is_symmetric=True,
                                         accuracy_level=4)
        quantizer.process()
        model = quantizer.model.model.SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # many sessions: none may spin
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})[0]


def _quantize_dynamic(model: bytes) -> bytes:
    import tempfile

    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as d:  # quantize_dynamic reads and writes files
        src, dst = Path(d) / "fp32.onnx", Path(d) / "int8.onnx"
        src.write_bytes(model)
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, per_channel=True)
        return dst.read_bytes()


def _ov_kernel(scheme: str, weight: np.ndarray, bias: np.ndarray | None, threads: int) -> Kernel:
    try:
        import openvino as ov
    except ImportError as exc:
        raise Unavailable(f"openvino is not installed ({exc}): pip install openvino nncf") from exc
    import tempfile

    core = ov.Core()
    with tempfile.TemporaryDirectory() as d:  # the same ONNX graph as onnxruntime's
        path = Path(d) / "linear.onnx"
        path.write_bytes(_onnx_linear(weight, bias))
        model = core.read_model(path)
    if scheme == "ov-int8-weights":
        try:
            import nncf
        except ImportError as exc:
            raise Unavailable(f"nncf is not installed ({exc}): pip install nncf") from exc
        nncf.set_log_level(logging.ERROR)  # no statistics table per layer
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return lambda x: request.infer([x])[0].copy()


def _torch_kernel(scheme: str, weight: np.ndarray, bias: np.ndarray | None, threads: int) -> Kernel:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight))
        if bias is not None:
            linear.bias.copy_(torch.from_numpy(bias))
    if scheme == "torch-int8":
        from ..models.lm_quant import quantize_linears

        linear = quantize_linears(nn.Sequential(linear))[0]
    linear.eval()

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return linear(torch.from_numpy(x)).numpy()

    return run


def kernel(scheme: str, weight: np.ndarray, bias: np.ndarray | None = None, *, threads: int = 1) -> Kernel:
    """``scheme``'s ``x -> x @ weight.T + bias`` (``weight`` [out, in] float32, as ``nn.Linear`` holds it)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    make = {"torch": _torch_kernel, "ort": _ort_kernel, "ov": _ov_kernel}[scheme.split("-")[0]]
    return make(scheme, np.asarray(weight, np.float32), None if bias is None else np.asarray(bias, np.float32),
                threads)


class KernelLinear(OrtLinear):
    """An ``nn.Linear`` computed by a scheme's kernel (inference only, CPU): the served
    :class:`~cosyvoice_triton.models.lm_ort.OrtLinear` with another kernel."""

    def __init__(self, linear: nn.Linear, scheme: str, threads: int = 1):
        bias = None if linear.bias is None else linear.bias.detach().numpy()
        super().__init__(linear, kernel=kernel(scheme, linear.weight.detach().numpy(), bias, threads=threads))
        self.scheme = scheme


def with_kernels(lm, scheme: str, *, threads: int = 1):
    """A copy of ``lm`` whose Qwen2 trunk computes every ``nn.Linear`` with ``scheme`` (the speech head stays;
    ``ort-fp32`` is ``lm_precision fp32-ort``)."""
    lm = copy.deepcopy(lm)
    ort_linears(lm.qwen, make=lambda linear: KernelLinear(linear, scheme, threads))
    return lm


def trunk_shapes(lm) -> Counter:
    """``(in, out, bias)`` -> how many of the trunk's Linear layers have that shape."""
    return Counter((m.in_features, m.out_features, m.bias is not None) for m in lm.qwen.modules()
                   if type(m) is nn.Linear)


def time_step(lm, batch: int, *, rounds: int = 5, seed: int = 0) -> float:
    """The median seconds of one pass through every :class:`KernelLinear` of ``lm``'s trunk in order, at
    ``batch`` rows: each layer with its own weights, so they stream from memory as in a decode step."""
    layers = [m for m in lm.qwen.modules() if isinstance(m, KernelLinear)]
    g = np.random.default_rng(seed)
    xs = [g.standard_normal((batch, m.in_features)).astype(np.float32) for m in layers]
    times = []
    for _ in range(rounds + 1):  # the first pass warms up
        start = time.perf_counter()
        for m, x in zip(layers, xs, strict=True):
            m.run(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench_scheme(lm, scheme: str, batches: tuple[int, ...], *, threads: int, rounds: int,
                 quality_tokens: int) -> dict:
    """Per batch the trunk's Linear seconds per decode step and the tokens/s ceiling they leave; then the LM
    with these kernels against ``lm`` (fp32) when ``quality_tokens``."""
    from .tts import int8_quality

    cand = with_kernels(lm, scheme, threads=threads)
    step_s = {b: time_step(cand, b, rounds=rounds) for b in batches}
    out = {"step_s": step_s, "tokens_per_s_ceiling": {b: b / s for b, s in step_s.items()}}
    if quality_tokens > 0 and scheme != "torch-fp32":
        out["quality"] = int8_quality(lm, cand, quality_tokens)
    return out


def _table(results: dict, batches: tuple[int, ...]) -> str:
    head = ["scheme"] + [f"Linear ms/step, batch {b}" for b in batches] + \
        [f"ceiling tok/s, batch {b}" for b in batches] + ["TV max / mean, same token", "bar"]
    rows = [head, ["---"] + ["---:"] * (len(head) - 1)]
    for scheme, r in results.items():
        if "unavailable" in r:
            rows.append([scheme] + ["-"] * (len(head) - 2) + [f"not measured: {r['unavailable']}"])
            continue
        q = r.get("quality")
        rows.append([scheme] + [f"{1e3 * r['step_s'][b]:.1f}" for b in batches]
                    + [f"{r['tokens_per_s_ceiling'][b]:.1f}" for b in batches]
                    + ([f"{q['max_tv']:.3f} / {q['mean_tv']:.3f}, {q['same_token']:.0%}",
                        "met" if q["meets_bar"] else "missed"] if q else ["reference", "-"]))
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("models/cosyvoice2-demo-full"))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2, help="threads of every runtime's kernels")
    ap.add_argument("--rounds", type=int, default=5, help="timed passes through the trunk per batch")
    ap.add_argument("--quality-tokens", type=int, default=32, help="0 skips the quality measure")
    ap.add_argument("--out-json", type=Path, default=Path("build/bench-lm-kernels.json"))
    args = ap.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    if not schemes or set(schemes) - set(SCHEMES):
        ap.error(f"--schemes: a comma list of {', '.join(SCHEMES)}")
    batches = tuple(int(b) for b in args.batches.split(","))
    torch.set_num_threads(args.threads)
    logging.getLogger("onnxruntime").setLevel(logging.WARNING)  # the quantizers log every node at INFO

    from ..models.llm import load_llm
    from .tts import ensure_model

    model_dir = ensure_model(args.model_dir)
    config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    if config.llm is None:
        config = dataclasses.replace(config, llm=LLMConfig.full())
    lm = load_llm(model_dir, config)
    shapes = trunk_shapes(lm)
    print(f"bench-lm-kernels: {model_dir}, {sum(shapes.values())} trunk Linear layers in {len(shapes)} shapes, "
          f"{args.threads} threads, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results: dict[str, dict] = {}
    for scheme in schemes:
        print(f"  {scheme}", flush=True)
        try:
            results[scheme] = bench_scheme(lm, scheme, batches, threads=args.threads, rounds=args.rounds,
                                           quality_tokens=args.quality_tokens)
        except Unavailable as exc:
            results[scheme] = {"unavailable": str(exc)}
        r = results[scheme]
        print("    " + ("not measured: " + r["unavailable"] if "unavailable" in r else
                        ", ".join(f"batch {b}: {1e3 * r['step_s'][b]:.1f} ms" for b in batches)
                        + (f"; TV mean {r['quality']['mean_tv']:.3f}" if "quality" in r else "")), flush=True)
    print(_table(results, batches))
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps({"model_dir": str(model_dir), "threads": args.threads,
                                         "shapes": {f"{i}x{o}{' +bias' if b else ''}": n
                                                    for (i, o, b), n in shapes.items()},
                                         "schemes": results}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
