"""Triton Python-backend adapter of ``hift`` (BLS): tensors in, one ``HiftRunner.run`` call for all the requests
of the batch (equal mel lengths share hift_source / hift_decoder calls), tensors out."""

import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters, set_niceness
from cosyvoice_triton.serving.stages.vocoder import HiftRunner


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["hift"], model=args["model_name"])
        set_niceness(p["nice"])  # tunable task_nice: before this instance starts its threads
        torch.set_num_threads(p["torch_threads"])
        self.default_seed = p["default_seed"]
        self.runner = HiftRunner()
        version = int(args["model_version"]) if p["pin_graph_version"] else -1
        self.source = triton_io.BlsGraph(pb_utils, p["source_model"], "hift_source", timeout_us=p["bls_timeout_us"],
                                         version=version)
        self.decoder = triton_io.BlsGraph(pb_utils, p["decoder_model"], "hift_decoder",
                                          timeout_us=p["bls_timeout_us"], version=version)

    def execute(self, requests):
        items = [{**triton_io.read_inputs(pb_utils, r, ("mel", "seed")),
                  "parameters": triton_io.request_parameters(r)} for r in requests]
        results = self.runner.run_tensors(items, self.source, self.decoder, default_seed=self.default_seed)
        return triton_io.responses(pb_utils, results, lambda wave: {"waveform": wave[None]})
