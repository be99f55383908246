"""Triton Python-backend adapter of ``postprocess``: tensors in, one ``Postprocessor.batch`` call, tensors out."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.metrics import SpeechMetrics
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters, set_niceness
from cosyvoice_triton.serving.stages.postprocess import Postprocessor


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["postprocess"], model=args["model_name"])
        set_niceness(p["nice"])  # tunable task_nice: before this instance starts its threads
        self.post = Postprocessor(model_sample_rate=p["model_sample_rate"],
                                  output_sample_rate=p["output_sample_rate"], loudness_lufs=p["loudness_lufs"],
                                  peak_dbfs=p["peak_dbfs"], output_format=p["output_format"])
        self.metrics = SpeechMetrics(pb_utils, args["model_name"], args["model_version"], audio_out=True,
                                     timed=False)
        self.rate = p["model_sample_rate"]

    def execute(self, requests):
        tensors = [triton_io.read_inputs(pb_utils, r, ("waveform",)) for r in requests]
        results = self.post.batch([t["waveform"] for t in tensors])
        self.metrics.results(tensors, results, lambda t, _: t["waveform"].size / self.rate)
        return triton_io.responses(pb_utils, results, lambda out: out)
