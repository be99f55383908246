"""``make bench-cv3-graphs``: one Euler step of CosyVoice3's DiT estimator in PyTorch and on its ONNX graph, alone
and in padded batches, at full dims.

    python -m cosyvoice_triton.bench.cv3_graphs --model-dir models/cosyvoice3-demo-full --frames 500

What the served estimator graph (tunable ``cosyvoice3_onnx_dir``: ``flow3_estimator`` behind Triton's dynamic
batcher) costs against the DiT in process: the graph is exported from the folder's ``flow.pt`` (or read from
``--onnx-dir``), then for 1, 2 and 4 utterances (2, 4 and 8 CFG rows; the utterances ``--frames`` long and 7 frames
shorter each, zero-padded as the served graph pads them) the median time of one step (``--rounds`` after a warm-up)
on ``--threads`` threads: PyTorch (the library's DiT, ``streaming=False``) and onnxruntime
(:class:`~cosyvoice_triton.serving.stages.graphs.GraphRunner`, the served code). Per utterance: the step's time over
the utterances it carried (a request's flow takes 10 steps). The two outputs' relative difference is printed as a
check. Figures, not assertions; the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from .. import resources
from . import load_average, write_result

ROOT = resources.checkout() or Path.cwd()
DEFAULT_MODEL_DIR = ROOT / "models" / "cosyvoice3-demo-full"


def step_inputs(utterances: int, frames: int, *, seed: int = 0) -> tuple[dict[str, np.ndarray], list[int]]:
    """The graph's feeds for ``utterances`` padded to ``frames`` (lengths ``frames - 7 i``), CFG rows
    ``[cond..., uncond...]`` as the solver stacks them, and the lengths."""
    rng = np.random.default_rng(seed)
    lengths = [max(4, frames - 7 * i) for i in range(utterances)]
    rows = 2 * utterances
    mask = np.zeros((rows, 1, frames), np.float32)
    for i, n in enumerate(lengths * 2):
        mask[i, :, :n] = 1.0
    feeds = {"x": rng.standard_normal((rows, 80, frames), np.float32),
             "mask": mask, "mu": rng.standard_normal((rows, 80, frames), np.float32) * mask,
             "t": np.full(rows, 0.3, np.float32), "spks": rng.standard_normal((rows, 80), np.float32),
             "cond": rng.standard_normal((rows, 80, frames), np.float32) * mask}
    feeds["mu"][utterances:] = 0.0  # the unconditional rows
    feeds["cond"][utterances:] = 0.0
    feeds["spks"][utterances:] = 0.0
    return feeds, lengths


def _median_s(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def format_report(result: dict) -> str:
    meta = result["meta"]
    lines = [f"CosyVoice3 DiT estimator, one Euler step, {meta['frames']} frames, {meta['threads']} threads; commit "
             f"{meta['commit']}; {meta['machine']}; load average at the end {meta['load_end']}", "",
             "| utterances (CFG rows) | PyTorch s / step | onnxruntime s / step | PyTorch s / step / utterance | "
             "onnxruntime s / step / utterance | rel. difference |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        n = r["utterances"]
        lines.append(f"| {n} ({2 * n}) | {r['torch_s']:.3f} | {r['ort_s']:.3f} | {r['torch_s'] / n:.3f} | "
                     f"{r['ort_s'] / n:.3f} | {r['rel_diff']:.1e} |")
    return "\n".join(lines)


def run_bench(model_dir: str | Path = DEFAULT_MODEL_DIR, *, onnx_dir: str | Path | None = None, frames: int = 500,
              utterances: tuple[int, ...] = (1, 2, 4), threads: int = 2, rounds: int = 3,
              out_dir: str | Path = "build/bench-cv3-graphs") -> dict:
    import torch

    from ..export.onnx_export3 import export_onnx3, load_source_models3
    from ..loadtest.live import commit
    from ..loadtest.setup import machine
    from ..serving.stages.graphs import GraphRunner

    torch.set_num_threads(threads)
    out = Path(out_dir)
    meta = {"commit": commit(), "machine": machine(), "threads": threads, "frames": frames, "rounds": rounds,
            "model_dir": str(model_dir), "load_start": load_average()}
    print(f"bench-cv3-graphs: {model_dir}, {frames} frames, {threads} threads; {meta['machine']}; load average "
          f"{meta['load_start']}", flush=True)
    if onnx_dir is None:
        t = time.perf_counter()
        onnx_dir = out / "onnx"
        export_onnx3(model_dir, onnx_dir, graphs=["flow3_estimator"], verify=False, threads=threads)
        print(f"  exported flow3_estimator in {time.perf_counter() - t:.1f} s", flush=True)
    runner = GraphRunner("flow3_estimator", onnx_path=Path(onnx_dir) / "flow3_estimator.onnx",
                         intra_op_threads=threads)
    dit = load_source_models3(model_dir, hift=False).flow.decoder.estimator
    rows = []
    for n in utterances:
        feeds, lengths = step_inputs(n, frames)
        tensors = [torch.from_numpy(feeds[k]) for k in ("x", "mask", "mu", "t", "spks", "cond")]

        def on_torch(tensors=tensors):
            with torch.inference_mode():
                return dit(*tensors, False).numpy()

        def on_ort(feeds=feeds):
            return runner.run(feeds)["estimator_out"]

        want, got = on_torch(), on_ort()
        valid = feeds["mask"].astype(bool).repeat(80, axis=1)
        rel = float(np.max(np.abs(got - want)[valid]) / max(np.max(np.abs(want[valid])), 1e-30))
        row = {"utterances": n, "lengths": lengths, "torch_s": _median_s(on_torch, rounds),
               "ort_s": _median_s(on_ort, rounds), "rel_diff": rel}
        rows.append(row)
        print(f"  {n} utterance(s): PyTorch {row['torch_s']:.3f} s, onnxruntime {row['ort_s']:.3f} s per step "
              f"(rel. difference {rel:.1e})", flush=True)
    meta["load_end"] = load_average()
    result = {"meta": meta, "rows": rows}
    write_result(out, result, format_report(result))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cosyvoice-triton bench-cv3-graphs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--onnx-dir", default=None, help="a folder with flow3_estimator.onnx (default: export it)")
    p.add_argument("--frames", type=int, default=500, help="mel frames of the longest utterance (50 per second)")
    p.add_argument("--utterances", default="1,2,4", help="comma-separated batch sizes in utterances")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-dir", default="build/bench-cv3-graphs")
    ns = p.parse_args(argv)
    try:
        utterances = tuple(int(x) for x in ns.utterances.split(",") if x)
    except ValueError:
        p.error(f"--utterances: comma-separated integers, got {ns.utterances!r}")
    if not utterances or min(utterances) < 1 or max(utterances) > 16 or not 4 <= ns.frames <= 3000 \
            or ns.threads < 1 or ns.rounds < 1:
        p.error("utterances within 1..16 (32 CFG rows), frames within 4..3000, threads and rounds >= 1")
    run_bench(ns.model_dir, onnx_dir=ns.onnx_dir, frames=ns.frames, utterances=utterances, threads=ns.threads,
              rounds=ns.rounds, out_dir=ns.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
