"""The ``cosyvoice2`` model of the official CosyVoice Triton runtime (``runtime/triton_trtllm`` of
FunAudioLLM/CosyVoice), served on this project's TTS pipeline: its clients (``client_grpc.py``,
``client_http.py``) work against this server unchanged.

The interface, as the official model's config and clients have it: ``reference_wav`` FP32 ``[1, N]`` (16 kHz
samples, possibly zero-padded past ``reference_wav_len``), ``reference_wav_len`` INT32 ``[1, 1]``,
``reference_text`` and ``target_text`` BYTES ``[1, 1]`` (UTF-8); the answer ``waveform`` FP32 ``[1, M]`` at 24 kHz.
Like the official model, one model name serves both ways, chosen by the config's transaction policy (tunable
``cosyvoice2_decoupled``): decoupled (the official default), one response per streamed chunk over a gRPC stream and
an empty final response; not decoupled, one whole answer over HTTP or gRPC.

:func:`pipeline_inputs` maps a request onto the tensors of ``cosyvoice_tts`` / ``cosyvoice_tts_stream`` (checking
what the official model leaves unchecked); :class:`OfficialFront` calls them by BLS (``pb``:
``triton_python_backend_utils``, handed over by the adapter ``ensemble/cosyvoice2/model.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ...shapes import TensorSpec
from .batching import RequestError
from .triton_io import triton_error
from .tts import bytes_input, error_code, error_response

__all__ = ["INPUT_NAMES", "OFFICIAL_INPUTS", "OFFICIAL_MODEL", "OFFICIAL_OPTIONAL", "OFFICIAL_OUTPUTS",
           "OUTPUT_SAMPLE_RATE", "REFERENCE_SAMPLE_RATE", "CalleeError", "OfficialFront", "answer_error",
           "official_request", "pipeline_inputs"]

OFFICIAL_MODEL = "cosyvoice2"
#: The rate of ``reference_wav`` (the official clients resample to it; the official model assumes it).
REFERENCE_SAMPLE_RATE = 16000
#: The rate of ``waveform`` (the official clients write it at this rate without asking).
OUTPUT_SAMPLE_RATE = 24000
OFFICIAL_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("reference_wav", "float32", ("batch", "reference_samples")),
    TensorSpec("reference_wav_len", "int32", ("batch", 1)),
    TensorSpec("reference_text", "bytes", ("batch", 1)),
    TensorSpec("target_text", "bytes", ("batch", 1)),
)
#: Optional in the config, as the official one declares them (its speaker-cache mode sends ``target_text`` only);
#: a request without them is refused here, naming what is missing.
OFFICIAL_OPTIONAL = frozenset({"reference_wav", "reference_wav_len", "reference_text"})
OFFICIAL_OUTPUTS: tuple[TensorSpec, ...] = (TensorSpec("waveform", "float32", ("batch", "samples")),)
INPUT_NAMES = tuple(t.name for t in OFFICIAL_INPUTS)


def _one_int(x: np.ndarray, name: str) -> int:
    arr = np.asarray(x)
    if arr.size != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise RequestError(f"{name}: expected one integer per request, got shape {list(arr.shape)} of {arr.dtype}")
    return int(arr.reshape(-1)[0])


def pipeline_inputs(tensors: Mapping[str, np.ndarray | None], *, keep_empty_reference_text: bool = False
                    ) -> dict[str, np.ndarray]:
    """An official request's tensors -> the TTS pipeline's (``text``, ``prompt_audio`` + ``prompt_sample_rate``,
    ``prompt_text``); :class:`~.batching.RequestError` (INVALID_ARGUMENT) naming what is wrong. An empty
    ``reference_text`` is dropped (spoken without a transcript), or with ``keep_empty_reference_text`` passed on as
    an empty ``prompt_text`` (the CosyVoice3 models: zero-shot with the system prompt alone, as the official
    CosyVoice3 runtime treats it)."""
    missing = [n for n in INPUT_NAMES if tensors.get(n) is None]
    if missing:
        raise RequestError(f"missing input(s) {', '.join(missing)}: a request needs reference_wav (16 kHz samples), "
                           "reference_wav_len, reference_text and target_text (the official runtime's speaker-cache "
                           "requests, target_text alone, are not served)")
    target = bytes_input(tensors["target_text"], "target_text")
    if not target.strip():
        raise RequestError("target_text is empty: nothing to speak")
    reference = bytes_input(tensors["reference_text"], "reference_text")
    wav = np.asarray(tensors["reference_wav"])
    if wav.ndim != 2 or wav.shape[0] != 1:
        raise RequestError(f"reference_wav: expected [1, samples] per request, got shape {list(wav.shape)}")
    length = _one_int(tensors["reference_wav_len"], "reference_wav_len")
    if length < 1:
        raise RequestError(f"reference_wav_len must be at least 1, got {length}")
    if length > wav.shape[1]:
        raise RequestError(f"reference_wav_len {length} is larger than reference_wav's {wav.shape[1]} samples")
    out = {"text": np.array([[target.encode()]], object),
           "prompt_audio": np.ascontiguousarray(wav[:, :length], np.float32),
           "prompt_sample_rate": np.array([[REFERENCE_SAMPLE_RATE]], np.int32)}
    if reference.strip() or keep_empty_reference_text:  # empty: the official client's default
        out["prompt_text"] = np.array([[reference.encode()]], object)
    return out


def official_request(reference_wav: np.ndarray, reference_text: str, target_text: str) -> dict[str, np.ndarray]:
    """The tensors an official client sends for a 16 kHz ``reference_wav`` (1-D)."""
    wav = np.asarray(reference_wav, np.float32).reshape(1, -1)
    return {"reference_wav": wav, "reference_wav_len": np.array([[wav.shape[1]]], np.int32),
            "reference_text": np.array([[reference_text.encode()]], object),
            "target_text": np.array([[target_text.encode()]], object)}


class CalleeError(RuntimeError):
    """The pipeline's error answer, passed on with its code."""

    def __init__(self, message: str, code: Any):
        super().__init__(message)
        self.code = code


def answer_error(pb, exc: BaseException):
    """The ``InferenceResponse`` of a failed request: the pipeline's own code for its errors, else
    :func:`.tts.error_response` (INVALID_ARGUMENT for the client's)."""
    if isinstance(exc, CalleeError):
        return pb.InferenceResponse(error=triton_error(pb, str(exc), exc.code))
    return error_response(pb, exc)


class OfficialFront:
    """One official request through ``offline_model`` (whole answers) or ``stream_model`` (chunks) by BLS."""

    def __init__(self, pb, *, offline_model: str, stream_model: str, timeout_us: int = 0,
                 keep_empty_reference_text: bool = False, stream_schedule: str = ""):
        self.pb, self.offline_model, self.stream_model = pb, offline_model, stream_model
        self.kwargs = {"timeout": int(timeout_us)} if timeout_us else {}
        self.keep_empty_reference_text = keep_empty_reference_text
        #: sent to ``stream_model`` as its ``stream_schedule`` input (empty: not sent)
        self.stream_schedule = stream_schedule

    def _inputs(self, tensors: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        return pipeline_inputs(tensors, keep_empty_reference_text=self.keep_empty_reference_text)

    def _request(self, model: str, inputs: Mapping[str, np.ndarray]):
        pb = self.pb
        return pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(k, v) for k, v in inputs.items()],
                                   requested_output_names=["waveform", "sample_rate"], **self.kwargs)

    def _waveform(self, res) -> np.ndarray:
        rate = self.pb.get_output_tensor_by_name(res, "sample_rate")
        if rate is not None and int(rate.as_numpy().reshape(-1)[0]) != OUTPUT_SAMPLE_RATE:
            raise RuntimeError(f"the pipeline answered {int(rate.as_numpy().reshape(-1)[0])} Hz, the official "
                               f"interface is {OUTPUT_SAMPLE_RATE} Hz")
        return np.ascontiguousarray(self.pb.get_output_tensor_by_name(res, "waveform").as_numpy(),
                                    np.float32).reshape(1, -1)

    def whole(self, tensors: Mapping[str, np.ndarray | None]) -> np.ndarray:
        """The whole answer ``[1, M]`` (``offline_model``)."""
        res = self._request(self.offline_model, self._inputs(tensors)).exec()
        if res.has_error():
            err = res.error()
            raise CalleeError(err.message(), err.code() if hasattr(err, "code") else
                              error_code(self.pb, err.message()))
        return self._waveform(res)

    def chunks(self, tensors: Mapping[str, np.ndarray | None],
               cancelled: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """The streamed chunks ``[1, m]`` (``stream_model``); stops the callee's stream when ``cancelled()``."""
        inputs = {**self._inputs(tensors), "stream": np.ones((1, 1), bool)}
        if self.stream_schedule:
            inputs["stream_schedule"] = np.array([[self.stream_schedule.encode()]], object)
        responses = self._request(self.stream_model, inputs).exec(decoupled=True)
        for res in responses:
            if cancelled is not None and cancelled():
                if hasattr(responses, "cancel"):
                    responses.cancel()
                return
            if res.has_error():  # a decoupled BLS answer keeps the message, not the code
                message = res.error().message()
                raise CalleeError(message, error_code(self.pb, message))
            if self.pb.get_output_tensor_by_name(res, "waveform") is not None:
                yield self._waveform(res)
