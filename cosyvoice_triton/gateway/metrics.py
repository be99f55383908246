"""The gateway's own Prometheus metrics (one registry per app, served at ``/metrics``), optionally followed by
Triton's, read from its metrics port (a Triton bound to loopback cannot be scraped from outside its pod)."""

from __future__ import annotations

import asyncio
import logging
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics"]

log = logging.getLogger(__name__)
TRITON_METRICS_TIMEOUT_S = 5.0
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("cosyvoice_gateway_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.refused = Counter("cosyvoice_gateway_refused", "requests refused by the gateway's limits, by reason",
                               ["reason"], registry=self.registry)
        self.in_flight = Gauge("cosyvoice_gateway_in_flight", "requests being answered", registry=self.registry)
        self.waiting = Gauge("cosyvoice_gateway_waiting", "requests waiting for their turn at the fair gate (the "
                             "service full)", registry=self.registry)
        self.latency = Histogram("cosyvoice_gateway_request_seconds", "time to the whole answer, by route",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.first_audio = Histogram("cosyvoice_gateway_first_audio_seconds",
                                     "time to the first audio bytes of a streamed answer", buckets=_LATENCY_BUCKETS,
                                     registry=self.registry)
        self.audio_seconds = Counter("cosyvoice_gateway_audio_seconds", "seconds of audio answered, by format",
                                     ["format"], registry=self.registry)
        self.sequences = Gauge("cosyvoice_gateway_sequences", "sequence ids (live sessions) the tenants have open "
                               "at the KServe entry points", registry=self.registry)
        # live sessions over WebSocket (live_ws.py), by live model
        self.live_sessions = Gauge("cosyvoice_gateway_live_sessions", "live WebSocket sessions open",
                                   ["model"], registry=self.registry)
        self.live_ended = Counter("cosyvoice_gateway_live_sessions_ended", "live WebSocket sessions ended, by how: "
                                  "done, client_gone, or the error code they were cut with", ["model", "reason"],
                                  registry=self.registry)
        self.live_first_audio = Histogram("cosyvoice_gateway_live_first_audio_seconds", "a live session's first "
                                          "piece sent to Triton -> its first audio", ["model"],
                                          buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.live_chunk_latency = Histogram("cosyvoice_gateway_live_chunk_latency_seconds", "each audio chunk's "
                                            "arrival after the piece that completed it was sent to Triton",
                                            ["model"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.live_underruns = Counter("cosyvoice_gateway_live_underruns", "audio chunks that came after the audio "
                                      "before them had played out (played from the first chunk on, back to back)",
                                      ["model"], registry=self.registry)
        self.backend_errors = Counter("cosyvoice_gateway_backend_errors", "Triton refusals and failures, by HTTP "
                                      "status they were answered with", ["status"], registry=self.registry)

        self.triton_up = Gauge("cosyvoice_gateway_triton_metrics_up", "1 when Triton's metrics were read for "
                               "this scrape, 0 when not", registry=self.registry)

    async def triton(self, url: str) -> bytes:
        """Triton's metrics text at ``url`` (empty when it cannot be read; ``triton_up`` says which)."""
        def fetch() -> bytes:
            with urllib.request.urlopen(url, timeout=TRITON_METRICS_TIMEOUT_S) as r:
                return r.read()

        try:
            text = await asyncio.to_thread(fetch)
        except OSError as exc:
            log.warning("triton metrics at %s: %s", url, exc)
            self.triton_up.set(0)
            return b""
        self.triton_up.set(1)
        return text if text.endswith(b"\n") or not text else text + b"\n"

    def render(self) -> bytes:
        return generate_latest(self.registry)
