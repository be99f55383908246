"""Triton Python-backend adapter of ``cosyvoice_tts`` (non-streaming, batched): every request of a batch is sent
on to ``cosyvoice_tts_stream`` by BLS at once (``stream`` = false: one answer per text segment; their LM work
shares the in-flight batch there), and its segments (at the output rate: resampled there as one stream) are
concatenated into one ``waveform``, loudness-normalised as a whole when configured."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.metrics import SpeechMetrics
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters, set_niceness
from cosyvoice_triton.serving.stages.postprocess import Postprocessor
from cosyvoice_triton.serving.stages.tts import error_code
from cosyvoice_triton.shapes import TTS_INPUTS, TTS_OPTIONAL_INPUTS, TTS_WHOLE_INPUTS

INPUTS = [t.name for t in (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS)]


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice_tts"], model=args["model_name"])
        set_niceness(p["nice"])  # tunable task_nice: before this instance starts its threads
        self.post = Postprocessor(model_sample_rate=p["model_sample_rate"], output_sample_rate=p["output_sample_rate"],
                                  loudness_lufs=p["loudness_lufs"], peak_dbfs=p["peak_dbfs"])
        self.stream_model, self.rate = p["stream_model"], self.post.output_sample_rate
        self.kwargs = {"timeout": p["bls_timeout_us"]} if p["bls_timeout_us"] else {}
        self.metrics = SpeechMetrics(pb_utils, args["model_name"], args["model_version"], inputs=("prompt",),
                                     audio_out=True)

    def _one(self, request):
        start = time.monotonic()
        tensors = triton_io.read_inputs(pb_utils, request, INPUTS)
        inputs = [pb_utils.Tensor(n, v) for n, v in tensors.items() if v is not None]
        inputs.append(pb_utils.Tensor("stream", np.zeros((1, 1), bool)))
        try:
            bls = pb_utils.InferenceRequest(model_name=self.stream_model, inputs=inputs,
                                            requested_output_names=["waveform", "sample_rate"], **self.kwargs)
            parts = []
            for res in bls.exec(decoupled=True):
                if res.has_error():  # the same message; the code from it (a decoupled BLS answer loses it)
                    message = res.error().message()
                    self.metrics.rejected(message)
                    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, error_code(pb_utils,
                                                                                                     message)))
                wave = pb_utils.get_output_tensor_by_name(res, "waveform")
                if wave is not None:
                    parts.append(wave.as_numpy().reshape(-1))
            wave = self.post.normalize(np.concatenate(parts) if parts else np.zeros(0, np.float32))
            self.metrics.served(tensors, out_seconds=wave.size / self.rate, elapsed_s=time.monotonic() - start)
            return pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("waveform", wave[None]),
                pb_utils.Tensor("sample_rate", np.array([[self.rate]], np.int32))])
        except Exception as exc:
            self.metrics.rejected(exc)
            return triton_io.error_response(pb_utils, exc)

    def execute(self, requests):
        return triton_io.answer_each(requests, self._one)
