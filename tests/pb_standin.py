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
