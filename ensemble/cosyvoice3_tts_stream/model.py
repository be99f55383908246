"""Triton Python-backend adapter of ``cosyvoice3_tts_stream`` (decoupled): the tensors of ``cosyvoice_tts_stream``
and ``stream_schedule`` (optional: ``official`` or ``runtime`` hops),
answered by a CosyVoice3 folder in process (``cosyvoice_triton.serving.stages.cosyvoice3.Cv3Service``). Each request
gets a worker thread that sends one response per chunk (or per text segment when ``stream`` is false), then the
FINAL flag; ``finalize()`` waits for the streams in flight. A ``speaker_id`` is fetched from the CosyVoice3 speakers
model (parameter ``speakers_model``) by BLS."""

import threading

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.cosyvoice3 import build_service
from cosyvoice_triton.serving.stages.metrics import SpeechMetrics, streaming
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.stream_state import StateGauge
from cosyvoice_triton.serving.stages.tts import send_stream
from cosyvoice_triton.shapes import (
    CV3_TTS_STREAM_EXTRA_INPUTS,
    TTS_INPUTS,
    TTS_OPTIONAL_INPUTS,
    TTS_STREAM_EXTRA_INPUTS,
    TTS_WHOLE_INPUTS,
)

INPUTS = [t.name for t in (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS, *TTS_STREAM_EXTRA_INPUTS,
                           *CV3_TTS_STREAM_EXTRA_INPUTS)]


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice3_tts_stream"], model=args["model_name"])
        self.tts = build_service(pb_utils, p, on_state_change=StateGauge(pb_utils, args["model_name"],
                                                                         args["model_version"]))
        self.speech = SpeechMetrics(pb_utils, args["model_name"], args["model_version"], inputs=("prompt",),
                                    audio_out=True, first_chunk=True)
        self.workers = set()
        self.workers_lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            inputs = triton_io.read_inputs(pb_utils, request, INPUTS)
            worker = threading.Thread(target=self._run, args=(inputs, request.get_response_sender()), daemon=True)
            with self.workers_lock:
                self.workers.add(worker)
            worker.start()
        return None

    def _run(self, inputs, sender):
        try:
            send_stream(pb_utils, sender, lambda: self.speech.stream(
                self.tts.responses(inputs, cancelled=sender.is_cancelled), inputs,
                sample_rate=self.tts.sample_rate, first_chunk=streaming(inputs)))
        finally:
            with self.workers_lock:
                self.workers.discard(threading.current_thread())

    def finalize(self):
        with self.workers_lock:
            workers = list(self.workers)
        for worker in workers:
            worker.join(timeout=60)
        self.tts.close()  # the LM engine's loop, after the streams that used it
