"""Stand-ins for the pieces of Triton's ``triton_python_backend_utils`` that the adapters and ``triton_io`` use
(the real module exists only inside a Python-backend stub)."""

from __future__ import annotations


class Err:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code=None):
        self._m, self._c = message, code

    def message(self):
        return self._m

    def code(self):
        return self._c


class Tensor:
    def __init__(self, name, arr):
        self._name, self.arr = name, arr

    def name(self):
        return self._name

    def as_numpy(self):
        return self.arr


class Response:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self.err = list(output_tensors), error

    def has_error(self):
        return self.err is not None

    def error(self):
        return self.err


class Metric:
    """A series of :class:`MetricFamily` with the checks Triton makes (counters only grow, histograms need
    buckets and only observe)."""

    def __init__(self, family, labels, buckets=None):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise TypeError(f"labels must map str to str: {labels!r}")
        if (family.kind == MetricFamily.HISTOGRAM) != (buckets is not None):
            raise ValueError("buckets belong to histograms, and histograms need them")
        self.family, self.labels, self.buckets = family, dict(labels), buckets
        self.total, self.observations = 0.0, []

    def increment(self, value):
        if self.family.kind == MetricFamily.HISTOGRAM or (self.family.kind == MetricFamily.COUNTER and value < 0):
            raise ValueError(f"cannot increment a {self.family.kind} by {value}")
        self.total += value

    def set(self, value):
        if self.family.kind != MetricFamily.GAUGE:
            raise ValueError(f"cannot set a {self.family.kind}")
        self.total = value

    def observe(self, value):
        if self.family.kind != MetricFamily.HISTOGRAM:
            raise ValueError(f"cannot observe a {self.family.kind}")
        self.observations.append(value)

    def value(self):
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise ValueError("a histogram has no value")
        return self.total


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

    def __init__(self, name, description, kind):
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise ValueError(f"unknown kind {kind!r}")
        self.name, self.description, self.kind, self.metrics = name, description, kind, []

    def Metric(self, labels, buckets=None):
        m = Metric(self, labels, buckets)
        self.metrics.append(m)
        return m
