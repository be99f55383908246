"""Locust users of the rollout scenario (``python -m cosyvoice_triton.loadtest.rollout``, ``make rollout-demo``).

Each user converts the workload's sources in turn through the public ``cosyvoice_vc`` (the router of a versioned
repository), back to back, with no client retries, so that any request the rollout disturbed counts as failed. The
run is described by the JSON file in ``$ROLLOUT_LOADTEST``; at the end every request (end time, latency, error) is
written to its ``out`` file, so the scenario can count requests and failures per phase.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

from locust import User, constant, events, task

from cosyvoice_triton.clients.client import CosyVoiceClient
from cosyvoice_triton.clients.retry import NO_RETRY
from cosyvoice_triton.loadtest.workload import load_workload

CONFIG = json.loads(Path(os.environ["ROLLOUT_LOADTEST"]).read_text())
WORKLOAD = load_workload(CONFIG["workload"])
RECORDS: list[tuple[float, float, str]] = []  # (end unix time, latency s, error or "")
_ids = itertools.count()


class RouterUser(User):
    wait_time = constant(0)

    def on_start(self):
        self.index = next(_ids) * 5
        self.client = CosyVoiceClient(CONFIG["url"], retry=NO_RETRY, timeout=CONFIG["timeout_s"], concurrency=1)

    def on_stop(self):
        self.client.close()

    @task
    def convert(self):
        item = WORKLOAD.item(self.index)
        self.index += 1
        t0, error = time.perf_counter(), None
        try:
            self.client.convert(item.source, item.prompt, source_sr=item.source_sr, prompt_sr=item.prompt_sr, seed=0)
        except Exception as exc:
            error = exc
        latency = time.perf_counter() - t0
        RECORDS.append((time.time(), latency, "" if error is None else f"{type(error).__name__}: {error}"))
        self.environment.events.request.fire(request_type="http", name="cosyvoice_vc", response_time=latency * 1e3,
                                             response_length=0, exception=error, context={})


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw):
    total = environment.stats.total
    with open(CONFIG["out"], "w") as f:
        json.dump({"records": RECORDS, "locust_requests": total.num_requests, "locust_failures": total.num_failures},
                  f)
