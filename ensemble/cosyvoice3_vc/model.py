"""Triton Python-backend adapter of ``cosyvoice3_vc``: the tensors of ``cosyvoice_vc`` (less ``seed``), each request
of a batch (at most the service's ``concurrency``) converted in its own thread by a CosyVoice3 folder in process
(``cosyvoice_triton.serving.stages.cosyvoice3.Cv3Service``); a bad request gets its own error response."""

import time

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.cosyvoice3 import build_service
from cosyvoice_triton.serving.stages.metrics import SpeechMetrics
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.tts import error_response
from cosyvoice_triton.shapes import CV3_VC_INPUTS

INPUTS = [t.name for t in CV3_VC_INPUTS] + ["seed"]  # seed: refused with its reason when sent


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice3_vc"], model=args["model_name"])
        self.vc = build_service(pb_utils, p, tts=False)
        self.metrics = SpeechMetrics(pb_utils, args["model_name"], args["model_version"],
                                     inputs=("source", "prompt"), audio_out=True)

    def _one(self, request):
        start = time.monotonic()
        try:
            tensors = triton_io.read_inputs(pb_utils, request, INPUTS)
            out = self.vc.convert(tensors)
        except Exception as exc:  # this request's own error (UNAVAILABLE when the instance stayed busy)
            self.metrics.rejected(exc)
            return error_response(pb_utils, exc)
        self.metrics.served(tensors, out_seconds=out["waveform"].size / self.vc.sample_rate,
                            elapsed_s=time.monotonic() - start)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()])

    def execute(self, requests):
        return triton_io.answer_each(requests, self._one)
