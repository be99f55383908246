"""Load tests of the served voice conversion: the library behind ``loadtest/`` (locustfile and runner CLI).

Two columns are compared on the same machine, back to back:

* ``integrated``: one request per conversion to the ``cosyvoice_vc`` ensemble, every stage dynamically batched;
* ``plain``: the client preprocesses and calls each stage model itself, one request at a time, on a repository
  rendered without dynamic batching and with the PyTorch fp32 graphs (:mod:`cosyvoice_triton.clients.plain`).

Modules: :mod:`.metrics` (Prometheus text, Triton statistics, snapshots and deltas), :mod:`.sampler` (server RSS,
CPU and GPU memory over time), :mod:`.workload` (espeak-ng sources and prompt), :mod:`.callers` (one conversion
per column and protocol, no Locust import), :mod:`.report` (figures, tables, cross-checks), :mod:`.plots`,
:mod:`.perf` (perf_analyzer from the ``tritonclient`` wheel) and :mod:`.runner` (the whole comparison).
"""

COLUMNS = ("plain", "integrated")
PROTOCOLS = ("http", "grpc")
