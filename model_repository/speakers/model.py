"""Triton Python-backend adapter of ``speakers`` (one instance: one process owns the store): each request is one
``SpeakerService.handle`` call (register / get / list / delete); the prompt's tokens and embedding by BLS."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.batching import run_per_item
from cosyvoice_triton.serving.stages.metrics import SpeechMetrics
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.speakers import SPEAKER_INPUTS, build_service

INPUTS = [t.name for t in SPEAKER_INPUTS]


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["speakers"], model=args["model_name"])
        self.service = build_service(p, lambda model, graph: triton_io.BlsGraph(
            pb_utils, model, graph, timeout_us=p["bls_timeout_us"]))
        self.metrics = SpeechMetrics(pb_utils, args["model_name"], args["model_version"])

    def execute(self, requests):
        tensors = [triton_io.read_inputs(pb_utils, r, INPUTS) for r in requests]
        results = run_per_item(tensors, self.service.handle)
        self.metrics.results(tensors, results)
        return triton_io.responses(pb_utils, results, lambda out: {k: v[None] for k, v in out.items()})
