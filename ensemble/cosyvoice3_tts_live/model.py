"""Triton Python-backend adapter of ``cosyvoice3_tts_live`` (decoupled, sequence batcher): the tensors and session
rules of ``cosyvoice_tts_live``, answered by a CosyVoice3 folder in process
(``cosyvoice_triton.serving.stages.cosyvoice3.Cv3Service.live``). ``LiveSessions`` keeps the sessions by correlation
id, each running ``live_tts.serve_session`` in its own worker; a chunk goes on the newest piece's sender, the END's
sender (or the last) gets the rest. A ``speaker_id`` is fetched from the CosyVoice3 speakers model (parameter
``speakers_model``) by BLS. Errors start with the gRPC code's name (``INVALID_ARGUMENT: ...``)."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages.cosyvoice3 import build_service
from cosyvoice_triton.serving.stages.live_tts import live_tts_sessions
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.stream_state import StateGauge

CLOSE_WAIT_S = 30.0  # finalize(): how long the streams in flight may take to stop and close their senders


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice3_tts_live"], model=args["model_name"])
        self.tts = build_service(pb_utils, p, on_state_change=StateGauge(pb_utils, args["model_name"],
                                                                         args["model_version"]))
        self.sessions = live_tts_sessions(pb_utils, self.tts, p, args)

    def execute(self, requests):
        for request in requests:
            self.sessions.submit(request)
        return None

    def finalize(self):
        self.sessions.close(wait_s=CLOSE_WAIT_S)
        self.tts.close()
