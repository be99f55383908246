"""Triton Python-backend adapter of ``cosyvoice_vc_live`` (decoupled, sequence batcher): each request is one piece
of a live stream's source audio; ``LiveSessions`` keeps the sessions by correlation id, each running
``live_vc.serve_session`` in its own worker (BLS calls to the graphs), answers on the piece's sender."""

import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.live_vc import build_live, live_vc_sessions
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.speakers import BlsSpeakers
from cosyvoice_triton.serving.stages.stream_state import StateGauge


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice_vc_live"], model=args["model_name"])
        timeout = p["bls_timeout_us"]
        torch.set_num_threads(p["torch_threads"])  # the cached flow window's flow (tunable torch_threads)
        live = build_live(p, lambda model, graph: triton_io.BlsGraph(pb_utils, model, graph, timeout_us=timeout),
                          BlsSpeakers(pb_utils, p["speakers_model"], timeout_us=timeout),
                          on_state_change=StateGauge(pb_utils, args["model_name"], args["model_version"]))
        self.sessions = live_vc_sessions(pb_utils, live, p, args)

    def execute(self, requests):
        for request in requests:
            self.sessions.submit(request)
        return None

    def finalize(self):
        self.sessions.close()
