"""The "plain separate calls" client: the baseline a team that just wraps the official code would deploy.

The client does what the ``cosyvoice_vc`` ensemble does inside the server, itself: it runs the front end
in-process (:class:`~cosyvoice_triton.serving.stages.frontend.Preprocessor`: validation, resampling, Whisper log-mel,
Kaldi fbank, prompt mel), then calls the stage models over the network one request at a time, in order, and
runs the post-processing in-process (:class:`~cosyvoice_triton.serving.stages.postprocess.Postprocessor`):

    speech_tokenizer(source)  ->  speech_tokenizer(prompt)  ->  speaker_encoder(prompt fbank)
        ->  flow(tokens, prompt mel, embedding)  ->  hift(mel, seed)

Serve it from the ``plain`` profile (:data:`cosyvoice_triton.serving.repository.PLAIN_TUNABLES`: no dynamic batching,
the graphs as the checkpoint's PyTorch fp32 modules)::

    python model_repository/render.py --profile plain --out build/model_repository_plain
    with PlainPipeline("127.0.0.1:8000") as plain:                      # one connection, reused
        wave, rate = plain.convert(source, 16000, prompt, 22050, seed=0)

It works against any repository of this project (the stage models are in every flavor). It is synchronous and
starts no threads, so it runs under gevent (Locust): ``tritonclient.http`` is gevent based; for
``protocol="grpc"`` call ``grpc.experimental.gevent.init_gevent()`` before creating it. One instance serves one
caller at a time (a thread or greenlet each).

Errors: bad input found by the front end raises :class:`~cosyvoice_triton.errors.AudioError` (a ``ValueError``)
before anything is sent; a request the server refuses or fails raises :class:`~cosyvoice_triton.clients.client.VCError`
with the stage's name, the server's message and its status (``"400"`` / ``"StatusCode.INVALID_ARGUMENT"`` for
bad input).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..frontend import audio
from ..serving.stages.frontend import Preprocessor
from ..serving.stages.postprocess import Postprocessor
from ..serving.stages.vocoder import parse_seed
from ..shapes import GRAPHS, STAGES
from .wire import DEFAULT_URLS, PROTOCOLS, VCError, connect, inference_statistics

__all__ = ["PLAIN_MODELS", "PlainPipeline"]

#: The stage models the plain client calls, in order (``speech_tokenizer`` twice: source, then prompt).
PLAIN_MODELS = ("speech_tokenizer", "speaker_encoder", "flow", "hift")
#: Each model's input and output tensor names, from the one shape spec.
_IO = {name: ([t.name for t in spec.inputs], [t.name for t in spec.outputs])
       for name, spec in (*((g, GRAPHS[g]) for g in PLAIN_MODELS[:2]), *((s, STAGES[s]) for s in PLAIN_MODELS[2:]))}


def _model_config(model_dir: str | os.PathLike | ModelConfig | None) -> ModelConfig:
    if model_dir is None:
        return ModelConfig()  # CosyVoice2-0.5B: the official mel settings and 24 kHz (the demo folders share them)
    if isinstance(model_dir, ModelConfig):
        return model_dir
    path = Path(model_dir)
    return ModelConfig.from_yaml(path if path.suffix in (".yaml", ".yml") else path / "cosyvoice2.yaml")


class PlainPipeline:
    """Voice conversion with the stages called one by one over HTTP or gRPC (``tritonclient``).

    Args:
        url: ``host:port`` of the server's HTTP (default 8000) or gRPC (default 8001) endpoint.
        protocol: ``"http"`` or ``"grpc"``.
        model_dir: the CosyVoice2 folder (or its ``cosyvoice2.yaml``, or a
            :class:`~cosyvoice_triton.config.ModelConfig`) whose mel settings and sample rate the front end uses;
            None: CosyVoice2-0.5B's (the official ones).
        timeout_s: connection / network timeout (HTTP) or per-call deadline (gRPC), in seconds.
        min_seconds, max_seconds: accepted duration of each utterance (the served ``preprocess`` defaults).
        postprocessor: the post-processing (default: the model's rate, no loudness change, as the served default).
        verbose: ``tritonclient``'s verbose flag.

    After each :meth:`convert`, :attr:`timings` holds the seconds of each step of that conversion
    (``preprocess``, ``speech_tokenizer_source``, ``speech_tokenizer_prompt``, ``speaker_encoder``, ``flow``,
    ``hift``, ``postprocess``, ``total``).
    """

    def __init__(self, url: str | None = None, *, protocol: str = "http",
                 model_dir: str | os.PathLike | ModelConfig | None = None, timeout_s: float = 300.0,
                 min_seconds: float = audio.MIN_SECONDS, max_seconds: float = audio.MAX_SECONDS,
                 postprocessor: Postprocessor | None = None, verbose: bool = False):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be http or grpc, got {protocol!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.protocol, self.timeout_s = protocol, float(timeout_s)
        self.url = url or DEFAULT_URLS[protocol]
        self.config = _model_config(model_dir)
        self.pre = Preprocessor(self.config.mel, sample_rate=self.config.sample_rate, min_seconds=min_seconds,
                                max_seconds=max_seconds)
        self.post = postprocessor or Postprocessor(model_sample_rate=self.config.sample_rate)
        self.timings: dict[str, float] = {}
        # one connection: the calls are sequential
        self._module, self._client = connect(self.url, protocol, timeout=self.timeout_s, concurrency=1,
                                             verbose=verbose)
        from tritonclient.utils import np_to_triton_dtype

        self._dtype = np_to_triton_dtype
        self._closed = False

    # ------------------------------------------------------------------------------------------ basics

    def is_ready(self) -> bool:
        """The server is ready and so is every model this client calls."""
        try:
            return bool(self._client.is_server_ready()) and all(self._client.is_model_ready(m) for m in PLAIN_MODELS)
        except Exception:
            return False

    def statistics(self, model: str = "") -> dict:
        """Triton's per-model statistics (all models when ``model`` is empty), as a dict."""
        return inference_statistics(self._client, self.protocol, model)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> PlainPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ calls

    def infer(self, model: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request to one stage model (``tensors`` with their batch axis of 1): its outputs by name.
        Raises :class:`~.client.VCError` naming the model when the server refuses or fails it."""
        outputs = _IO[model][1] if model in _IO else []
        inputs = []
        for name, arr in tensors.items():
            arr = np.ascontiguousarray(arr)
            t = self._module.InferInput(name, list(arr.shape), self._dtype(arr.dtype))
            t.set_data_from_numpy(arr)
            inputs.append(t)
        requested = [self._module.InferRequestedOutput(n) for n in outputs] or None
        try:
            if self.protocol == "http":
                res = self._client.infer(model, inputs, outputs=requested)
            else:
                res = self._client.infer(model, inputs, outputs=requested, client_timeout=self.timeout_s)
        except Exception as exc:
            err = VCError.from_exception(exc)
            msg = err.message if err.message.startswith(f"{model}:") else f"{model}: {err.message}"
            raise VCError(msg, err.status) from exc
        out = {}
        for name in outputs:
            value = res.as_numpy(name)
            if value is None:
                raise VCError(f"{model}: the server's answer has no output {name!r}")
            out[name] = value
        return out

    def convert(self, source_audio: np.ndarray, source_sample_rate: int, prompt_audio: np.ndarray,
                prompt_sample_rate: int, *, seed: int = 0) -> tuple[np.ndarray, int]:
        """Speak the content of ``source_audio`` in the voice of ``prompt_audio`` (PCM arrays: float in [-1, 1] or
        int16/int32, mono or ``[C, N]`` / ``[N, C]``, at their rates). ``seed``: HiFT's NSF noise, as the
        ensemble's ``seed`` input. Returns ``(waveform float32 [N], its sample rate)``."""
        t_start = time.perf_counter()
        timings: dict[str, float] = {}
        self.timings = timings

        def timed(key, fn, *args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                timings[key] = time.perf_counter() - t0

        def front():
            seed_value = parse_seed(seed)
            src = audio.to_mono_float32(source_audio, name="source_audio")
            prm = audio.to_mono_float32(prompt_audio, name="prompt_audio")
            return seed_value, self.pre.one(src, source_sample_rate, prm, prompt_sample_rate).tensors()

        seed_value, feats = timed("preprocess", front)
        tokens = {}
        for which in ("source", "prompt"):
            tokens[which] = timed(f"speech_tokenizer_{which}", self.infer, "speech_tokenizer", {
                "whisper_mel": feats[f"{which}_whisper_mel"],
                "whisper_mel_len": feats[f"{which}_whisper_mel_len"].astype(np.int32)})["speech_tokens"]
        embedding = timed("speaker_encoder", self.infer, "speaker_encoder",
                          {"fbank": feats["prompt_fbank"]})["speaker_embedding"]
        mel = timed("flow", self.infer, "flow", {
            "source_speech_tokens": tokens["source"].astype(np.int32),
            "prompt_speech_tokens": tokens["prompt"].astype(np.int32),
            "prompt_mel": feats["prompt_mel"], "speaker_embedding": embedding.astype(np.float32)})["mel"]
        wave = timed("hift", self.infer, "hift", {"mel": mel.astype(np.float32),
                                                  "seed": np.array([[seed_value]], np.int64)})["waveform"]
        out = timed("postprocess", self.post.waveform, wave)
        timings["total"] = time.perf_counter() - t_start
        return out, self.post.output_sample_rate
