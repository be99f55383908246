"""Triton Python-backend adapter of ``flow`` (BLS): tensors in, one ``FlowSolver.run_tensors`` call for all the
requests of the batch (one flow_encoder call, one flow_estimator call per Euler step), tensors out."""

import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.config import ModelConfig
from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.flow import FlowSolver
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters, set_niceness
from cosyvoice_triton.shapes import STAGES

INPUTS = [t.name for t in STAGES["flow"].inputs]


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["flow"], model=args["model_name"])
        set_niceness(p["nice"])  # tunable task_nice: before this instance starts its threads
        torch.set_num_threads(p["torch_threads"])
        config = ModelConfig.from_yaml(f"{p['model_dir']}/cosyvoice2.yaml")
        self.solver = FlowSolver(config.flow.cfm, token_mel_ratio=config.token_mel_ratio,
                                 n_timesteps=p["n_timesteps"] or None)
        version = int(args["model_version"]) if p["pin_graph_version"] else -1
        self.encoder = triton_io.BlsGraph(pb_utils, p["encoder_model"], "flow_encoder", timeout_us=p["bls_timeout_us"],
                                          version=version)
        self.estimator = triton_io.BlsGraph(pb_utils, p["estimator_model"], "flow_estimator",
                                            timeout_us=p["bls_timeout_us"], version=version)

    def execute(self, requests):
        tensors = [triton_io.read_inputs(pb_utils, r, INPUTS) for r in requests]
        results = self.solver.run_tensors(tensors, self.encoder, self.estimator)
        return triton_io.responses(pb_utils, results, lambda mel: {"mel": mel[None]})
