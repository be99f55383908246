"""Triton Python-backend adapter of ``cosyvoice_vc_stream`` (decoupled BLS orchestrator): each request runs in a
worker thread (``StreamWorkers``) through ``VCStreamer``: front end, tokenizer and speaker encoder, then the
chunked flow and HiFT graphs by BLS; one response per chunk on the official schedule, then the final flag."""

import torch
import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.metrics import SpeechMetrics
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.speakers import BlsSpeakers
from cosyvoice_triton.serving.stages.stream_state import StateGauge
from cosyvoice_triton.serving.stages.vc_stream import STREAM_INPUTS, StreamWorkers, build_streamer, chunk_tensors


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice_vc_stream"], model=args["model_name"])
        timeout = p["bls_timeout_us"]
        torch.set_num_threads(p["torch_threads"])  # the stream state's flow (tunable torch_threads)
        self.streamer = build_streamer(p, lambda model, graph: triton_io.BlsGraph(pb_utils, model, graph,
                                                                                  timeout_us=timeout),
                                       BlsSpeakers(pb_utils, p["speakers_model"], timeout_us=timeout),
                                       on_state_change=StateGauge(pb_utils, args["model_name"], args["model_version"]))
        rate = self.streamer.sample_rate  # the output rate (chunks resampled as one stream)
        self.metrics = SpeechMetrics(pb_utils, args["model_name"], args["model_version"], inputs=("source", "prompt"),
                                     audio_out=True, first_chunk=True)

        def stream(tensors, parameters, cancelled):
            chunks = self.streamer.stream(tensors, parameters, cancelled=cancelled)
            for i, chunk in enumerate(self.metrics.stream(chunks, tensors, sample_rate=rate)):
                yield chunk_tensors(chunk, i, rate)

        self.workers = StreamWorkers(pb_utils, stream, STREAM_INPUTS, max_streams=p["max_streams"],
                                     max_waiting=p["max_waiting"], name=args["model_name"],
                                     on_reject=self.metrics.rejected)

    def execute(self, requests):
        for request in requests:
            self.workers.submit(request)
        return None

    def finalize(self):
        self.workers.close()
