"""Triton Python-backend adapter of one exported graph (flavor ``local``): tensors in, one
``GraphRunner.run_items`` call for all the requests of the batch, tensors out. Requests served once more on the
fallback graph are counted in ``cosyvoice_fallbacks_total``. With ``graph_cache_mb`` > 0 (the prompt-side graphs by
default) the runner answers a repeated request from its cache of successful answers, counted in
``cosyvoice_graph_cache_total``. In a versioned repository the fallback is the version
folder's ``fallback.onnx`` when the render put one there (the fp32 graph of a reduced-precision version)."""

import os

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.graphs import GraphRunner
from cosyvoice_triton.serving.stages.metrics import FallbackMetrics, GraphCacheMetrics
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters, set_niceness


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["graph"], model=args["model_name"])
        set_niceness(p["nice"])  # tunable task_nice: before this instance starts its threads
        if p["runtime"] == "torch":
            import torch

            torch.set_num_threads(p["torch_threads"])
        onnx_path = p["onnx_path"] and os.path.join(args["model_repository"], args["model_version"], p["onnx_path"])
        fallback = os.path.join(args["model_repository"], args["model_version"], "fallback.onnx")
        self.fallbacks = FallbackMetrics(pb_utils, args["model_name"], args["model_version"], p["graph"])
        cache_mb = p["graph_cache_mb"]  # tunable graph_cache_mb: the prompt-side graphs' cache of successful answers
        self.cache_metrics = GraphCacheMetrics(pb_utils, args["model_name"], args["model_version"]) if cache_mb > 0 \
            else None
        self.runner = GraphRunner(p["graph"], onnx_path=onnx_path or None, runtime=p["runtime"],
                                  model_dir=p["model_dir"] or None, device=p["device"],
                                  intra_op_threads=p["intra_op_threads"],
                                  fallback=fallback if os.path.isfile(fallback) else "auto",
                                  on_fallback=self.fallbacks.record, cache_mb=cache_mb,
                                  on_cache=self.cache_metrics.record if self.cache_metrics else None)
        self.names = [t.name for t in self.runner.spec.inputs]

    def execute(self, requests):
        spec = self.runner.spec
        items = [triton_io.from_request(spec, triton_io.read_inputs(pb_utils, r, self.names)) for r in requests]
        results = self.runner.run_items(items)
        return triton_io.responses(pb_utils, results, lambda out: triton_io.to_request(spec, out))
