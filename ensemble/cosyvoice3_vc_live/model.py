"""Triton Python-backend adapter of ``cosyvoice3_vc_live`` (decoupled, sequence batcher): the tensors and session
rules of ``cosyvoice_vc_live``, each request one piece of a live stream's source audio, converted by a CosyVoice3
folder in process (``cosyvoice_triton.serving.stages.cosyvoice3_live_vc.Cv3LiveVC``). ``LiveSessions`` keeps the
sessions by correlation id, each running ``live_vc.serve_session`` in its own worker, answers on the piece's sender.
A ``speaker_id`` is fetched from the CosyVoice3 speakers model (parameter ``speakers_model``) by BLS."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages.cosyvoice3 import build_service
from cosyvoice_triton.serving.stages.cosyvoice3_live_vc import build_cv3_live
from cosyvoice_triton.serving.stages.live_vc import live_vc_sessions
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice3_vc_live"], model=args["model_name"])
        live = build_cv3_live(build_service(pb_utils, p, tts=False), p)
        self.sessions = live_vc_sessions(pb_utils, live, p, args)

    def execute(self, requests):
        for request in requests:
            self.sessions.submit(request)
        return None

    def finalize(self):
        self.sessions.close()
