"""Triton Python-backend adapter of ``cosyvoice_tts_stream`` (decoupled BLS orchestrator): each request gets a
worker thread that runs ``TTSService.prepare`` + ``synthesize`` and sends one response per audio chunk (or per
text segment when ``stream`` is false) at the configured output rate, then the FINAL flag; ``execute`` returns at
once. The instance holds ONE in-flight LM decode loop (``cosyvoice_triton.serving.stages.lm_engine``); its counters are
Triton custom metrics."""

import threading

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.stages import triton_io
from cosyvoice_triton.serving.stages.metrics import METRIC_LOCK, SpeechMetrics, streaming
from cosyvoice_triton.serving.stages.model_params import MODEL_PARAMS
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.serving.stages.stream_state import StateGauge
from cosyvoice_triton.serving.stages.tts import build_service, send_stream
from cosyvoice_triton.shapes import TTS_INPUTS, TTS_OPTIONAL_INPUTS, TTS_STREAM_EXTRA_INPUTS, TTS_WHOLE_INPUTS

INPUTS = [t.name for t in (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS, *TTS_STREAM_EXTRA_INPUTS)]


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], MODEL_PARAMS["cosyvoice_tts_stream"], model=args["model_name"])
        # tunables task_nice, task_isolation, torch_threads; the streams' flow state on a gauge
        self.tts = build_service(pb_utils, p, on_state_change=StateGauge(pb_utils, args["model_name"],
                                                                         args["model_version"]))
        self.family = family = pb_utils.MetricFamily(  # kept: it must outlive its metrics
            name="cosyvoice_llm", description="in-flight LM engine and streams of cosyvoice_tts_stream (counts since "
            "load; label what)", kind=pb_utils.MetricFamily.GAUGE)
        self.metrics = {k: family.Metric(labels={"model": args["model_name"], "instance": args["model_instance_name"],
                                                 "what": k}) for k in self.tts.snapshot()}
        self.speech = SpeechMetrics(pb_utils, args["model_name"], args["model_version"], inputs=("prompt",),
                                    audio_out=True, first_chunk=True)
        self.stop = threading.Event()
        threading.Thread(target=self._report, daemon=True).start()

    def _report(self):
        while not self.stop.wait(0.1):
            with METRIC_LOCK:
                for k, v in self.tts.snapshot().items():
                    self.metrics[k].set(float(v))

    def execute(self, requests):
        for request in requests:
            inputs = triton_io.read_inputs(pb_utils, request, INPUTS)
            sender = request.get_response_sender()
            threading.Thread(target=self._run, args=(inputs, sender), daemon=True).start()
        return None

    def _run(self, inputs, sender):
                send_stream(pb_utils, sender, lambda: self.speech.stream(
            self.tts.responses(inputs, cancelled=sender.is_cancelled), inputs, sample_rate=self.tts.sample_rate,
            first_chunk=streaming(inputs)))

    def finalize(self):
        self.stop.set()
        self.tts.close()
