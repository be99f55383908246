"""The speech metrics library (``cosyvoice_triton.serving.stages.metrics``) in process, on the stand-in of Triton's
``MetricFamily`` / ``Metric`` (``tests/pb_standin.py``): families and labels, audio seconds in and out, the
real-time factor and first-chunk latency of a stream on a fake clock, rejects by reason."""

from __future__ import annotations

import io
import types

import numpy as np
import pb_standin
import pytest
import soundfile as sf

from cosyvoice_triton.errors import AudioError, LLMError, SpeakerError, TextError
from cosyvoice_triton.serving.stages import metrics as m
from cosyvoice_triton.serving.stages.batching import ItemResult, RequestError
from cosyvoice_triton.serving.stages.lm_engine import BUSY, EngineBusy, JobCancelled
from cosyvoice_triton.serving.stages.triton_io import BlsError
from cosyvoice_triton.serving.stages.vc_stream import StreamCancelled

pb = types.SimpleNamespace(MetricFamily=pb_standin.MetricFamily)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def series(sm: m.SpeechMetrics, family: m.Family, **labels) -> pb_standin.Metric:
    found = [x for x in sm.families[family.name].metrics if all(x.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (family.name, labels, [x.labels for x in sm.families[family.name].metrics])
    return found[0]


def make(**kw) -> tuple[m.SpeechMetrics, Clock]:
    clock = Clock()
    return m.SpeechMetrics(pb, "cosyvoice_vc_stream", 3, clock=clock, **kw), clock


def test_families_kinds_and_labels():
    sm, _ = make(inputs=("source", "prompt"), audio_out=True, first_chunk=True)
    assert {f.name for f in m.FAMILIES} == set(sm.families)
    for f in m.FAMILIES:
        fam = sm.families[f.name]
        assert fam.kind == f.kind.upper()
        for x in fam.metrics:
            assert set(x.labels) == set(f.labels)
            assert x.labels["model"] == "cosyvoice_vc_stream" and x.labels["version"] == "3"
            assert (x.buckets is not None) == (f.kind == "histogram")
            if x.buckets:
                assert x.buckets == sorted(x.buckets)
    assert {x.labels["reason"] for x in sm.families[m.REJECTS.name].metrics} == set(m.REASONS)
    assert {x.labels["input"] for x in sm.families[m.AUDIO_IN.name].metrics} == {"source", "prompt"}
    # a model without audio out creates only the series it records
    bare = m.SpeechMetrics(pb, "speakers", "1")
    assert bare.audio_out is None and bare.rtf is None and bare.first_chunk is None
    assert not bare.families[m.AUDIO_IN.name].metrics and len(bare.families[m.REJECTS.name].metrics) == len(m.REASONS)


def test_counter_names_follow_prometheus_conventions():
    for f in m.FAMILIES:
        assert f.name.startswith("cosyvoice_")
        assert f.name.endswith("_total") == (f.kind == "counter"), f.name
        assert "seconds" in f.name or f.kind != "histogram" or f is m.RTF


def test_audio_seconds_samples_and_encoded():
    t = {"source_audio": np.zeros((1, 36000), np.float32), "source_sample_rate": np.array([[24000]], np.int32)}
    assert m.audio_seconds(t, "source") == pytest.approx(1.5)
    buf = io.BytesIO()
    sf.write(buf, np.zeros(8000 * 3, np.float32), 8000, format="WAV")
    t = {"prompt_audio_bytes": np.array([[buf.getvalue()]], object)}
    assert m.audio_seconds(t, "prompt") == pytest.approx(3.0)
    assert m.audio_seconds({"prompt_audio_bytes": np.array([[b"not audio"]], object)}, "prompt") == 0.0
    assert m.audio_seconds({}, "source") == 0.0


@pytest.mark.parametrize(("error", "reason"), [
    (AudioError("x"), "bad_audio"), (TextError("x"), "bad_text"), (LLMError("x"), "bad_text"),
    (SpeakerError("x"), "bad_speaker"), (RequestError("x"), "bad_request"),
    (BlsError("flow", "bad", invalid_argument=True), "bad_request"), (BlsError("flow", "engine died"), "internal"),
    (EngineBusy("x"), "busy"), (JobCancelled("x"), "cancelled"), (StreamCancelled("x"), "cancelled"),
    (RuntimeError("x"), "internal"), (MemoryError(), "internal"),
    (f"{BUSY}too many", "busy"), ("cosyvoice_vc_stream: too many concurrent streams (1 running)", "busy"),
    ("internal error: RuntimeError: x", "internal"), ("text: empty", "bad_request"),
    ("the client cancelled the stream", "cancelled"), ("cosyvoice_vc_stream: cancelled by the client", "cancelled"),
    # text a client sent, quoted in a refusal, never picks the reason
    (f"unknown speaker_id '{BUSY}x'", "bad_request"),
    ("unknown speaker 'x: too many concurrent streams'", "bad_request"),
    ("text segment 'cancelled' is empty", "bad_request"),
])
def test_reject_reason(error, reason):
    assert reason in m.REASONS
    assert m.reject_reason(error) == reason
    sm, _ = make()
    assert sm.rejected(error) == reason
    counts = {x.labels["reason"]: x.value() for x in sm.families[m.REJECTS.name].metrics}
    assert counts == {r: float(r == reason) for r in m.REASONS}


def test_results_of_a_stage_batch():
    sm, _ = make(inputs=("source", "prompt"), audio_out=True, timed=False)
    ok = {"source_audio": np.zeros((1, 16000 * 2), np.float32), "source_sample_rate": np.array([[16000]]),
          "prompt_audio": np.zeros((1, 4410), np.float32), "prompt_sample_rate": np.array([[44100]])}
    sm.results([ok, ok, {}], [ItemResult(1.25), ItemResult(0.5), ItemResult(error=AudioError("silent"))],
               lambda t, value: value)
    assert series(sm, m.AUDIO_IN, input="source").value() == pytest.approx(4.0)
    assert series(sm, m.AUDIO_IN, input="prompt").value() == pytest.approx(0.2)
    assert sm.audio_out.metric.value() == pytest.approx(1.75)
    assert sm.rtf is None and not sm.families[m.RTF.name].metrics  # a stage does not know a request's wall time
    sm.served(ok, out_seconds=1.0, elapsed_s=2.0)
    assert sm.audio_out.metric.value() == pytest.approx(2.75)
    assert series(sm, m.REJECTS, reason="bad_audio").value() == 1.0
    with pytest.raises(ValueError):  # one result per request
        sm.results([ok], [])


def _chunks(clock, waves, *, fail=None):
    for i, w in enumerate(waves):
        clock.t += 0.25 if i == 0 else 0.5
        yield {"waveform": w[None], "chunk_index": np.array([[i]])}
    if fail is not None:
        raise fail


def test_stream_first_chunk_audio_out_and_rtf():
    sm, clock = make(inputs=("source",), audio_out=True, first_chunk=True)
    t = {"source_audio": np.zeros((1, 8000), np.float32), "source_sample_rate": np.array([[16000]])}
    waves = [np.zeros(12000, np.float32), np.zeros(24000, np.float32), np.zeros(6000, np.float32)]
    got = list(sm.stream(_chunks(clock, waves), t, sample_rate=24000))
    assert len(got) == 3 and got[1]["waveform"].shape == (1, 24000)
    assert sm.first_chunk.metric.observations == [pytest.approx(0.25)]
    out = sum(w.size for w in waves) / 24000
    assert sm.audio_out.metric.value() == pytest.approx(out)
    assert sm.rtf.metric.observations == [pytest.approx(1.25 / out)]
    assert series(sm, m.AUDIO_IN, input="source").value() == pytest.approx(0.5)
    assert all(x.value() == 0 for x in sm.families[m.REJECTS.name].metrics)
    # response tensors that name their own rate
    list(sm.stream(iter([{"waveform": np.zeros((1, 16000), np.float32), "sample_rate": np.array([[16000]])}]), None,
                   sample_rate=24000))
    assert sm.audio_out.metric.value() == pytest.approx(out + 1.0)
    # raw waveforms too (the VC streamer's chunks), timed from a given start; no first chunk when not streamed
    start = clock.t - 1.0
    list(sm.stream(iter([np.zeros(2400, np.float32)]), None, sample_rate=24000, start=start, first_chunk=False))
    assert len(sm.first_chunk.metric.observations) == 2
    assert sm.rtf.metric.observations[-1] == pytest.approx(1.0 / 0.1)


def test_stream_error_and_early_close_are_rejects():
    sm, clock = make(inputs=("source",), audio_out=True, first_chunk=True)
    with pytest.raises(AudioError):
        list(sm.stream(_chunks(clock, [], fail=AudioError("source too short")), {}, sample_rate=24000))
    with pytest.raises(EngineBusy):
        list(sm.stream(_chunks(clock, [np.zeros(10, np.float32)], fail=EngineBusy("full")), {}, sample_rate=24000))
    gen = sm.stream(_chunks(clock, [np.zeros(10, np.float32)] * 3), {}, sample_rate=24000)
    next(gen)
    gen.close()  # the consumer went away mid-stream
    counts = {x.labels["reason"]: x.value() for x in sm.families[m.REJECTS.name].metrics}
    assert counts == {**dict.fromkeys(m.REASONS, 0.0), "bad_audio": 1.0, "busy": 1.0, "cancelled": 1.0}
    assert sm.audio_out.metric.value() == 0 and sm.rtf.metric.observations == []
    assert len(sm.first_chunk.metric.observations) == 2  # the first chunks did arrive


def test_a_failing_metric_never_fails_the_request(caplog):
    sm, _ = make(audio_out=True)
    sm.audio_out.metric.increment = lambda v: (_ for _ in ()).throw(RuntimeError("stub gone"))
    sm.served(None, out_seconds=1.0, elapsed_s=0.5)
    sm.served(None, out_seconds=1.0, elapsed_s=0.5)
    assert len(sm.rtf.metric.observations) == 2
    assert sum("stub gone" in r.getMessage() for r in caplog.records) == 1


def test_streaming_flag():
    assert m.streaming({}) and m.streaming({"stream": np.ones((1, 1), bool)})
    assert not m.streaming({"stream": np.zeros((1, 1), bool)})


def test_standin_checks_what_triton_checks():
    fam = pb_standin.MetricFamily("x_total", "d", pb_standin.MetricFamily.COUNTER)
    c = fam.Metric(labels={"model": "a"})
    with pytest.raises(ValueError):
        c.increment(-1)
    with pytest.raises(ValueError):
        c.observe(1)
    with pytest.raises(ValueError):
        fam.Metric(labels={"model": "a"}, buckets=[1.0])
    h = pb_standin.MetricFamily("h", "d", pb_standin.MetricFamily.HISTOGRAM)
    with pytest.raises(ValueError):
        h.Metric(labels={})
