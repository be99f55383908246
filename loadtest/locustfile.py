"""Locust users of the load test; started by ``loadtest/run.py`` (``cosyvoice_triton.loadtest.runner``).

The run is described by the JSON file named in ``$LOADTEST_CONFIG`` (:class:`RunConfig`: column, protocol, URLs,
workload, target). Each user converts the workload's sources in turn, back to back (no wait). Once all users are
spawned and ``warmup_requests`` conversions have completed, no new conversion starts until those in flight are
done; with nothing in flight and the server's counters settled, the server is snapshotted (metrics + per-model
statistics) and Locust's statistics are reset, then all users go on. So the measured window starts on a quiet
boundary: a conversion is in Locust's count exactly when its requests are in the increase of Triton's counters.
After ``target_requests`` measured conversions the run stops, users finish the conversion they are in, and the
server is snapshotted again. Everything lands in ``RunConfig.out``. The logic is in
:mod:`cosyvoice_triton.loadtest`; this file wires it to Locust's events.
"""

from __future__ import annotations

import itertools
import os
import time

import gevent
import gevent.event
from locust import User, constant, events, task

from cosyvoice_triton.loadtest.recording import ENV_VAR, RunConfig, RunRecorder

CONFIG = RunConfig.load(os.environ[ENV_VAR])
if CONFIG.protocol == "grpc":  # before any channel exists: grpc's own threads would block gevent otherwise
    import grpc.experimental.gevent

    grpc.experimental.gevent.init_gevent()

from cosyvoice_triton.loadtest.callers import make_converter, outcome  # noqa: E402
from cosyvoice_triton.loadtest.metrics import settled_snapshot  # noqa: E402
from cosyvoice_triton.loadtest.workload import load_workload  # noqa: E402

WORKLOAD = load_workload(CONFIG.workload)
RECORDER = RunRecorder(CONFIG)
GATE = gevent.event.Event()  # set: users may start conversions
GATE.set()
IN_FLIGHT = [0]
_user_ids = itertools.count()


class VCUser(User):
    """One client converting back to back: the source of its turn in the voice of the workload's prompt (or, in the
    TTS column, speaking the text of its turn / streaming that conversion)."""

    wait_time = constant(0)

    def on_start(self):
        self.index = next(_user_ids) * 7  # users start at different sources
        self.converter = make_converter(CONFIG.column, CONFIG.protocol, CONFIG.url, timeout=CONFIG.timeout_s,
                                        model_dir=CONFIG.model_dir)

    def on_stop(self):
        self.converter.close()

    @task
    def convert(self):
        GATE.wait()
        item = WORKLOAD.item(self.index)
        self.index += 1
        IN_FLIGHT[0] += 1
        try:
            start, t0, error, got = time.time(), time.perf_counter(), None, outcome(0.0)
            try:
                got = outcome(self.converter.convert(item, seed=CONFIG.seed))
            except Exception as exc:
                error = exc
            latency = time.perf_counter() - t0
            self.environment.events.request.fire(request_type=CONFIG.protocol, name=CONFIG.column,
                                                 response_time=latency * 1000.0,
                                                 response_length=int(got.audio_s * 1000), exception=error, context={})
            if RECORDER.record(start, latency, got.audio_s, error, first_chunk_s=got.first_chunk_s,
                               chunks=got.chunks if error is None else 0):
                gevent.spawn(self.environment.runner.quit)  # users finish their conversion (--stop-timeout)
        finally:
            IN_FLIGHT[0] -= 1


def _begin_measuring(environment):
    while not RECORDER.warmed_up():
        gevent.sleep(0.01)
    GATE.clear()  # no new conversion; wait for those in flight
    while IN_FLIGHT[0]:
        gevent.sleep(0.002)
    snap = settled_snapshot(CONFIG.http_url, CONFIG.metrics_url)  # time.sleep is gevent's here
    environment.runner.stats.reset_all()
    RECORDER.start_measuring()
    RECORDER.set_begin(snap)
    GATE.set()


@events.spawning_complete.add_listener
def _on_spawning_complete(user_count, **_kw):
    gevent.spawn(_begin_measuring, _ENV["environment"])


_ENV: dict = {}


@events.init.add_listener
def _on_init(environment, **_kw):
    _ENV["environment"] = environment


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw):
    end = settled_snapshot(CONFIG.http_url, CONFIG.metrics_url) if RECORDER.measuring else None
    total = environment.stats.total
    errors = {f"{e.method} {e.name}: {e.error}": e.occurrences for e in environment.stats.errors.values()}
    RECORDER.result(end, locust_requests=total.num_requests, locust_failures=total.num_failures,
                    locust_errors=errors).save()
