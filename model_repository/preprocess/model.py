"""Triton Python-backend adapter of ``preprocess``: tensors in, one ``Preprocessor.batch`` call, tensors out."""

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.config import ModelConfig
from cosyvoice_triton.prompt_cache import PromptCache
from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.frontend import Preprocessor, utterances_for
from cosyvoice_triton.serving.stages.metrics import SpeechMetrics
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters, set_niceness
from cosyvoice_triton.shapes import STAGES

INPUTS = [t.name for t in STAGES["preprocess"].inputs]


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["preprocess"], model=args["model_name"])
        set_niceness(p["nice"])  # tunable task_nice: before this instance starts its threads
        config = ModelConfig.from_yaml(f"{p['model_dir']}/cosyvoice2.yaml")
        self.pre = Preprocessor(config.mel, sample_rate=config.sample_rate, min_seconds=p["min_seconds"],
                                max_seconds=p["max_seconds"], vad_trim=p["vad_trim"],
                                denoise_prompt=p["denoise_prompt"], model_id=p["model_dir"],
                                prompt_cache=PromptCache.from_params(p["prompt_cache_entries"], p["prompt_cache_mb"]))
        self.metrics = SpeechMetrics(pb_utils, args["model_name"], args["model_version"], inputs=("source", "prompt"))

    def execute(self, requests):
        tensors = [triton_io.read_inputs(pb_utils, r, INPUTS) for r in requests]
        # speech_tokens / speaker_embedding ask for one utterance's outputs only: that one alone is needed
        needs = [utterances_for(triton_io.requested_outputs(r)) for r in requests]
        results = self.pre.batch(tensors, needs)
        self.metrics.results(tensors, results)
        return triton_io.responses(pb_utils, results, lambda features: features.tensors())
