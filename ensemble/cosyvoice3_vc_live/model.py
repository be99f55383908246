"""Triton Python-backend adapter of ``cosyvoice3_vc_live`` (decoupled, sequence batcher): the tensors and session
rules of ``cosyvoice_vc_live``, each request one piece of a live stream's source audio, converted by a CosyVoice3
folder in process (``cosyvoice_triton.serving.stages.cosyvoice3_live_vc.Cv3LiveVC``). ``LiveSessions`` keeps the
sessions by correlation id, each running ``live_vc.serve_session`` in its own worker, answers on the piece's sender.
A ``speaker_id`` is fetched from the CosyVoice3 speakers model (parameter ``speakers_model``) by BLS."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.family import COSYVOICE3
from cosyvoice_triton.serving.stages.cosyvoice3 import Cv3Service
from cosyvoice_triton.serving.stages.cosyvoice3_live_vc import build_cv3_live
from cosyvoice_triton.serving.stages.live_vc import live_vc_sessions
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.speakers import BlsSpeakers


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice3_vc_live"], model=args["model_name"])
        speakers = None
        if p["speakers_model"]:
            speakers = BlsSpeakers(pb_utils, p["speakers_model"], timeout_us=p["bls_timeout_us"], family=COSYVOICE3)
        service = Cv3Service.load(p["model_dir"], tts=False, torch_threads=p["torch_threads"],
                                  flow_precision=p["flow_precision"], min_seconds=p["min_seconds"],
                                  max_seconds=p["max_seconds"], output_sample_rate=p["output_sample_rate"],
                                  wait_timeout_s=p["wait_timeout_s"], speakers=speakers)
        live = build_cv3_live(service, p)
        self.sessions = live_vc_sessions(pb_utils, live, p, args)

    def execute(self, requests):
        for request in requests:
            self.sessions.submit(request)
        return None

    def finalize(self):
        self.sessions.close()
