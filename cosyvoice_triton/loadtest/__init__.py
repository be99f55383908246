"""Load tests of the served voice conversion: the library behind ``loadtest/`` (locustfile and runner CLI).

Two columns are compared on the same machine, back to back:

* ``integrated``: one request per conversion to the ``cosyvoice_vc`` ensemble, every stage dynamically batched;
* ``plain``: the client preprocesses and calls each stage model itself, one request at a time, on a repository
  rendered without dynamic batching and with the PyTorch fp32 graphs (:mod:`cosyvoice_triton.clients.plain`).

``--mode tts`` measures the TTS column instead: streaming TTS (``cosyvoice_tts_stream``: first-chunk latency and
RTF), offline TTS (``cosyvoice_tts``) and streaming VC (``cosyvoice_vc_stream``) at concurrency 1, 2 and 4 over
gRPC, with perf_analyzer's streaming mode beside Locust (:func:`.runner.run_tts`).

Modules: :mod:`.metrics` (Prometheus text, Triton statistics, snapshots and deltas), :mod:`.sampler` (server RSS,
CPU and GPU memory over time), :mod:`.workload` (espeak-ng sources and prompt), :mod:`.callers` (one conversion
per column and protocol, no Locust import), :mod:`.report` (figures, tables, cross-checks), :mod:`.plots`,
:mod:`.perf` (perf_analyzer from the ``tritonclient`` wheel) and :mod:`.runner` (the whole comparison).
"""

COLUMNS = ("plain", "integrated")
#: The TTS column (``--mode tts``): streaming TTS, offline TTS and streaming VC on one integrated server.
TTS_COLUMNS = ("tts_stream", "tts", "vc_stream")
PROTOCOLS = ("http", "grpc")
