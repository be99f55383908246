"""Triton Python-backend adapter of ``postprocess``: tensors in, one ``Postprocessor.batch`` call, tensors out."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving import triton_io
from cosyvoice_triton.serving.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.params import read_parameters
from cosyvoice_triton.serving.postprocess import Postprocessor


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["postprocess"], model=args["model_name"])
        self.post = Postprocessor(model_sample_rate=p["model_sample_rate"],
                                  output_sample_rate=p["output_sample_rate"], loudness_lufs=p["loudness_lufs"],
                                  peak_dbfs=p["peak_dbfs"], output_format=p["output_format"])

    def execute(self, requests):
        waves = [triton_io.read_inputs(pb_utils, r, ("waveform",))["waveform"] for r in requests]
        return triton_io.responses(pb_utils, self.post.batch(waves), lambda out: out)
