"""Triton Python-backend adapter of ``cosyvoice2``, the official CosyVoice runtime's interface
(``cosyvoice_triton.serving.stages.official_api``): decoupled (the config's transaction policy), each request streams
its chunks from ``cosyvoice_tts_stream`` in a worker thread, then the empty FINAL response; not decoupled, each request
of a batch gets its whole answer from ``cosyvoice_tts``, all at once."""

import contextlib
import json
import threading

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.official_api import INPUT_NAMES, OfficialFront, answer_error
from cosyvoice_triton.serving.stages.params import read_parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice2"], model=args["model_name"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.front = OfficialFront(pb_utils, offline_model=p["offline_model"], stream_model=p["stream_model"],
                                   timeout_us=p["bls_timeout_us"],
                                   keep_empty_reference_text=p["keep_empty_reference_text"],
                                   stream_schedule=p["stream_schedule"])

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                inputs = triton_io.read_inputs(pb_utils, request, INPUT_NAMES)
                threading.Thread(target=self._stream, args=(inputs, request.get_response_sender()),
                                 daemon=True).start()
            return None
        return triton_io.answer_each(requests, self._whole)

    def _whole(self, request):
        try:
            wave = self.front.whole(triton_io.read_inputs(pb_utils, request, INPUT_NAMES))
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("waveform", wave)])
        except Exception as exc:
            return answer_error(pb_utils, exc)

    def _stream(self, inputs, sender):
        final = None
        try:
            for wave in self.front.chunks(inputs, cancelled=sender.is_cancelled):
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("waveform", wave)]))
        except Exception as exc:
            final = answer_error(pb_utils, exc)
        with contextlib.suppress(Exception):  # a cancelled stream may refuse it: nothing left to close
            sender.send(final, flags=FINAL)
