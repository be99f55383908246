"""Triton Python-backend adapter of ``cosyvoice_tts_live`` (decoupled, sequence batcher): each request is one piece
of a live stream's text; ``LiveSessions`` keeps the sessions by correlation id, each running
``live_tts.serve_session`` (``TTSService.live``: the LM in the session's worker, BLS calls to the graphs and
stages) in its own worker; a chunk goes on the newest piece's sender, the END's sender (or the last) gets the rest.

Tensors (lower_snake). In, every request: ``text`` BYTES [1, 1] (UTF-8; a character may be split between pieces;
may be empty on the END request); first request only: ``speaker_id`` BYTES [1, 1], or ``prompt_audio`` FP32
[1, m] + ``prompt_sample_rate`` INT32 [1, 1] or ``prompt_audio_bytes`` BYTES [1, 1], with ``prompt_text`` BYTES
[1, 1]; optional ``instruct_text`` / ``mode`` BYTES [1, 1], ``seed`` INT64 [1, 1]. Out, per response:
``waveform`` FP32 [1, k], ``sample_rate`` INT32 [1, 1], ``chunk_index`` INT32 [1, 1] (0, 1, ... across the
session), ``text_pieces`` INT32 [1, 1] (pieces received when the chunk was computed). Errors start with the gRPC
code's name (``INVALID_ARGUMENT: ...``)."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages.live_tts import live_tts_sessions
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.stream_state import StateGauge
from cosyvoice_triton.serving.stages.tts import build_service

CLOSE_WAIT_S = 30.0  # finalize(): how long the streams in flight may take to stop and close their senders


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice_tts_live"], model=args["model_name"])
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
