"""Streaming token-to-wav and streaming voice conversion over the graphs: what ``cosyvoice_vc_stream`` serves.

:class:`StreamingToken2Wav` is :meth:`CosyVoice2.tokens2wav_stream
<cosyvoice_triton.pipeline.CosyVoice2.tokens2wav_stream>` with the four token-to-wav graphs as callables
(:data:`~.flow.GraphFn`: BLS calls in Triton, :class:`~.graphs.GraphRunner` in process): the official chunk
schedule (hops of 25, 50, then 100 tokens, the first padded so that prompt + chunk is a multiple of 25, 3
look-ahead tokens), each chunk through :class:`~.flow.FlowSolver` as a streaming item (chunk-causal encoder and
estimator), then HiFT with the 8-frame mel cache, the 3840-sample source cache and the Hamming crossfade. The
NSF noise of every HiFT call comes from one generator seeded with ``seed``, drawn as ``HiFTGenerator.draw_noise``
draws it, so the chunks equal the in-process ones (within float rounding of onnxruntime against torch). It takes
speech tokens as an iterable, so streaming TTS can feed it the LM's tokens as they are sampled.

:class:`VCStreamer` is the voice-conversion front of it: the request's tensors (the ``cosyvoice_vc`` inputs, or
``speaker_id`` instead of the prompt), the :class:`~.frontend.Preprocessor` features, the ``speech_tokenizer`` and
``speaker_encoder`` graphs, then the chunks, post-processed as a stream (:meth:`.postprocess.Postprocessor.stream`:
the configured output rate, resampled continuously across chunks). With the
:class:`~cosyvoice_triton.prompt_cache.PromptCache` of its :class:`~.frontend.Preprocessor`, a prompt recording seen
before (same samples, rate and options) takes its tokens, mel and embedding from the cache: no prompt features and
no tokenizer / CAM++ call for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import CosyVoiceError
from ...models.hift import draw_nsf_noise
from ...prompt_cache import PromptCache, prompt_key
from ...shapes import (
    GRAPHS,
    MAX_LOOKAHEAD,
    NSF_HARMONICS,
    SAMPLES_PER_MEL_FRAME,
    VC_INPUTS,
    VC_OPTIONAL_INPUTS,
    VC_OUTPUTS,
    TensorSpec,
)
from ...speakers import SpeakerPrompt
from ...streaming import MEL_CACHE, StreamSchedule, stream_chunks
from .batching import RequestError
from .flow import FlowItem, FlowSolver, GraphFn
from .frontend import Preprocessor
from .postprocess import Postprocessor
from .speakers import bytes_scalar
from .stream_state import IncrementalFlow, StreamFlow
from .vocoder import parse_seed

__all__ = ["STREAM_INPUTS", "VC_STREAM_INPUTS", "VC_STREAM_MODEL", "VC_STREAM_OUTPUTS", "StreamCancelled",
           "StreamPrompt", "StreamingToken2Wav", "Token2WavState", "VCStreamer", "build_streamer", "chunk_tensors",
           "stream_postprocessor", "stream_schedule"]

#: Inputs of ``cosyvoice_vc_stream``: the ``cosyvoice_vc`` ones and ``speaker_id`` (a registered prompt).
STREAM_INPUTS = ("source_audio", "source_sample_rate", "source_audio_bytes", "prompt_audio", "prompt_sample_rate",
                 "prompt_audio_bytes", "speaker_id", "seed")



class StreamCancelled(Exception):
    """The client cancelled the stream (or went away): the work stops before the next graph call."""


@dataclass(frozen=True)
class StreamPrompt:
    """The flow's prompt: tokens [Tp] int32, 24 kHz mel [Tf, 80] float32, CAM++ embedding [192] float32."""

    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    embedding: np.ndarray
    #: a registered speaker's prompt: streams share its settled flow frames (:mod:`.stream_state`)
    registered: bool = False

    @classmethod
    def from_speaker(cls, speaker: SpeakerPrompt, *, registered: bool = True) -> StreamPrompt:
        return cls(np.array(speaker.prompt_tokens), np.array(speaker.prompt_mel), np.array(speaker.embedding),
                   registered)


class StreamingToken2Wav:
    """Speech tokens to 24 kHz float32 chunks on the official streaming schedule (see the module docstring).

    ``graphs``: ``flow_encoder``, ``flow_estimator``, ``hift_source``, ``hift_decoder`` -> :data:`~.flow.GraphFn`;
    ``incremental``: the streams' flow state (:class:`~.stream_state.IncrementalFlow`; None: every chunk runs the
    flow graphs over every frame).
    """

    def __init__(self, solver: FlowSolver, graphs: Mapping[str, GraphFn], *, lookahead: int = MAX_LOOKAHEAD,
                 schedule: StreamSchedule | None = None, incremental: IncrementalFlow | None = None):
        missing = sorted({"flow_encoder", "flow_estimator", "hift_source", "hift_decoder"} - set(graphs))
        if missing:
            raise ValueError(f"StreamingToken2Wav: no callable for graph(s) {', '.join(missing)}")
        self.solver, self.graphs, self.lookahead = solver, graphs, int(lookahead)
        self.incremental = incremental
        self.schedule = schedule  # the hops of chunks() (None: the official ones)
        self.ratio = solver.token_mel_ratio
        self.source_cache = MEL_CACHE * SAMPLES_PER_MEL_FRAME
        self.fade = np.hamming(2 * self.source_cache)
        self.min_frames = max(GRAPHS["hift_source"].axes["mel_frames"].min,
                              GRAPHS["hift_decoder"].axes["mel_frames"].min)

    def stream(self, prompt: StreamPrompt, tokens: Iterable[int], *, seed: int = 0,
               cancelled: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Float32 chunks; a chunk runs as soon as its hop plus the look-ahead tokens have arrived, the last when
        ``tokens`` ends. ``cancelled()`` is asked before each chunk: True raises :class:`StreamCancelled`."""
        return (speech for speech, _ in self.chunks(prompt, tokens, seed=seed, cancelled=cancelled))

    def chunks(self, prompt: StreamPrompt, tokens: Iterable[int], *, seed: int = 0,
               cancelled: Callable[[], bool] | None = None) -> Iterator[tuple[np.ndarray, bool]]:
        """:meth:`stream` as ``(chunk, final)`` pairs: the last chunk says so when it comes (a streaming
        resampler flushes on it)."""
        state = self.open(prompt, seed=seed, incremental=True)
        try:
            for chunk in stream_chunks(tokens, len(prompt.prompt_tokens), lookahead=self.lookahead,
                                       schedule=self.schedule):
                self._check(cancelled)
                yield state.step(chunk.tokens, chunk.offset, final=chunk.final), chunk.final
        finally:  # the end, a cancel, a failure or a consumer that stopped: the flow state goes now
            state.close()

    def open(self, prompt: StreamPrompt, *, seed: int = 0, incremental: bool = False,
             window_tokens: int | None = None) -> Token2WavState:
        """The flow + HiFT state of one stream, for a caller with its own chunk schedule (live conversion).
        ``incremental``: keep the flow state (:mod:`.stream_state`) when this streamer has one: for steps whose
        tokens start at the first source token and grow (the official schedule), or, with ``window_tokens``, for
        live conversion's sliding flow window of that many tokens (:meth:`Token2WavState.step`'s ``first``)."""
        return Token2WavState(self, prompt, seed, incremental=incremental, window_tokens=window_tokens)

    @staticmethod
    def _check(cancelled: Callable[[], bool] | None) -> None:
        if cancelled is not None and cancelled():
            raise StreamCancelled("the client cancelled the stream")

    def _flow(self, prompt: StreamPrompt, tokens: np.ndarray, lookahead: int) -> np.ndarray:
        item = FlowItem(np.asarray(tokens, np.int32), np.asarray(prompt.prompt_tokens, np.int32),
                        np.asarray(prompt.prompt_mel, np.float32), np.asarray(prompt.embedding, np.float32),
                        streaming=lookahead > 0, lookahead=lookahead)
        (res,) = self.solver.run([item], self.graphs["flow_encoder"], self.graphs["flow_estimator"])
        return res.unwrap()  # [80, T] without the prompt frames

    def _hift(self, mel: np.ndarray, cache: dict | None, generator: torch.Generator, *, final: bool):
        if cache is not None:
            mel = np.concatenate([cache["mel"], mel], axis=1)
        frames = mel.shape[1]
        noise = draw_nsf_noise(1, frames, upsample=SAMPLES_PER_MEL_FRAME, harmonics=NSF_HARMONICS,
                               generator=generator).numpy()
        feed = mel
        if frames < self.min_frames:  # below the graphs' minimum: pad, and drop what the padding produced
            feed = np.pad(mel, ((0, 0), (0, self.min_frames - frames)), mode="edge")
            noise = np.pad(noise, ((0, 0), (0, (self.min_frames - frames) * SAMPLES_PER_MEL_FRAME), (0, 0)))
        feed = np.ascontiguousarray(feed[None], dtype=np.float32)
        source = np.array(self.graphs["hift_source"]({"mel": feed, "nsf_noise": noise})["source"], np.float32)
        if cache is not None:
            source[:, :, : cache["source"].shape[-1]] = cache["source"]
        wave = self.graphs["hift_decoder"]({"mel": feed, "source": source})["waveform"]
        n = frames * SAMPLES_PER_MEL_FRAME
        speech = np.asarray(wave, np.float32)[0, :n].astype(np.float64)
        source = source[:, :, :n]
        if cache is not None:  # crossfade with the held-back tail of the previous chunk
            c = self.source_cache
            speech[:c] = speech[:c] * self.fade[:c] + cache["speech"] * self.fade[c:]
        new_cache = None
        if not final:
            new_cache = {"mel": mel[:, -MEL_CACHE:], "source": source[:, :, -self.source_cache:],
                         "speech": speech[-self.source_cache:]}
            speech = speech[: -self.source_cache]
        return speech.astype(np.float32), new_cache


class Token2WavState:
    """One stream of :class:`StreamingToken2Wav`: its prompt, the NSF noise generator and HiFT's caches.

    :meth:`step` is one chunk: the flow on ``tokens`` (every token the flow sees, look-ahead included unless
    ``final``), the mel from token ``offset`` on, then HiFT with the caches of the previous step. Both the official
    schedule (:meth:`StreamingToken2Wav.chunks`) and live conversion (:mod:`.live_vc`, a sliding window) use it.
    With ``incremental`` (the official schedule only), a non-final step's mel comes from the stream's flow state
    (:class:`~.stream_state.StreamFlow`); :meth:`close` frees it.
    """

    def __init__(self, token2wav: StreamingToken2Wav, prompt: StreamPrompt, seed: int, *, incremental: bool = False,
                 window_tokens: int | None = None):
        self.token2wav, self.prompt = token2wav, prompt
        self.generator = torch.Generator().manual_seed(int(seed))
        self.cache: dict | None = None
        self.finished = False
        inc = token2wav.incremental if incremental else None
        self.flow_state: StreamFlow | None = None if inc is None else inc.open(
            prompt, registered=prompt.registered, window_tokens=window_tokens)

    def step(self, tokens: np.ndarray, offset: int, *, final: bool) -> np.ndarray:
        """Float32 speech of the chunk (without the held-back tail when not ``final``): its mel from token
        ``offset`` of ``tokens`` on. With a live window's flow state, ``tokens[offset:]`` are the chunk's new tokens
        (and the look-ahead), the earlier ones the window the graphs would recompute."""
        if self.finished:
            raise ValueError("Token2WavState.step: the stream's final chunk has run")
        t2w = self.token2wav
        lookahead = 0 if final else t2w.lookahead
        mel = None
        if self.flow_state is not None and not final:
            window = self.flow_state.window_tokens is not None
            mel = self.flow_state.chunk(tokens[int(offset):] if window else tokens)
            if mel is not None and window:
                offset = 0  # the state's mel starts at the new tokens
        if final:
            self.close()
        if mel is None:
            mel = t2w._flow(self.prompt, tokens, lookahead)
        mel = mel[:, int(offset) * t2w.ratio:]
        speech, self.cache = t2w._hift(mel, self.cache, self.generator, final=final)
        self.finished = bool(final)
        return speech

    def close(self) -> None:
        """Free the stream's flow state (idempotent; HiFT's caches are a few KB and go with this object)."""
        if self.flow_state is not None:
            self.flow_state.close()


class VCStreamer:
    """Streaming voice conversion of one request: front end, tokenizer and speaker encoder, then the chunks.

    ``graphs``: the six graphs as :data:`~.flow.GraphFn`; ``speakers``: ``speaker_id -> SpeakerPrompt`` (the
    ``speakers`` model by BLS in Triton), needed only for requests that name a registered speaker; ``post``: the
    served output options (None: the model's rate, as the graphs give it).
    """

    def __init__(self, pre: Preprocessor, solver: FlowSolver, graphs: Mapping[str, GraphFn], *,
                 speakers: Callable[[str], SpeakerPrompt] | None = None, default_seed: int = 0,
                 post: Postprocessor | None = None, schedule: StreamSchedule | None = None,
                 incremental: IncrementalFlow | None = None):
        self.pre, self.graphs, self.speakers = pre, graphs, speakers
        self.token2wav = StreamingToken2Wav(solver, graphs, schedule=schedule, incremental=incremental)
        self.default_seed = int(default_seed)
        self.post = post or Postprocessor(model_sample_rate=pre.sample_rate)
        #: the rate of the served chunks
        self.sample_rate = self.post.output_sample_rate

    def tokens(self, whisper: np.ndarray) -> np.ndarray:
        """The ``speech_tokenizer`` graph on one Whisper log-mel ``[128, T]``: int32 tokens ``[ceil(T / 4)]``."""
        out = self.graphs["speech_tokenizer"]({"whisper_mel": whisper[None],
                                               "whisper_mel_len": np.array([whisper.shape[1]], np.int32)})
        return np.asarray(out["speech_tokens"], np.int32).reshape(-1)

    def prepare(self, tensors: Mapping[str, np.ndarray | None], parameters: Mapping | None = None
                ) -> tuple[StreamPrompt, np.ndarray, int]:
        """(prompt, source tokens, seed) of one request; raises a :class:`CosyVoiceError` naming what is wrong."""
        t = {k: tensors.get(k) for k in STREAM_INPUTS}
        seed = self.request_seed(t, parameters)
        src, src_sr = self.pre.utterance("source", t["source_audio"], t["source_sample_rate"],
                                         t["source_audio_bytes"])
        return self.request_prompt(t), self.tokens(self.pre.source_features(src, src_sr)), seed

    def request_seed(self, tensors: Mapping[str, np.ndarray | None], parameters: Mapping | None = None) -> int:
        """The NSF seed of a request: its ``seed`` input, else its ``seed`` parameter, else the default."""
        if tensors.get("seed") is not None:
            return parse_seed(tensors["seed"])
        if parameters and "seed" in parameters:
            return parse_seed(parameters["seed"], name="parameter seed")
        return self.default_seed

    def request_prompt(self, tensors: Mapping[str, np.ndarray | None]) -> StreamPrompt:
        """The flow's prompt of a request: its ``speaker_id`` (registered), or its prompt audio / file."""
        t = {k: tensors.get(k) for k in ("prompt_audio", "prompt_sample_rate", "prompt_audio_bytes", "speaker_id")}
        if t["speaker_id"] is not None:
            given = [n for n in ("prompt_audio", "prompt_sample_rate", "prompt_audio_bytes") if t[n] is not None]
            if given:
                raise RequestError(f"send either speaker_id or the prompt audio, not both (got speaker_id and "
                                   f"{', '.join(given)})")
            if self.speakers is None:
                raise RequestError("speaker_id: this model has no speaker store")
            return StreamPrompt.from_speaker(self.speakers(bytes_scalar(t["speaker_id"], "speaker_id")))
        wave, sr = self.pre.utterance("prompt", t["prompt_audio"], t["prompt_sample_rate"], t["prompt_audio_bytes"])
        return self.prompt(wave, sr)

    def prompt(self, wave: np.ndarray, sample_rate: int) -> StreamPrompt:
        """The flow's prompt of a validated recording: its features, the ``speech_tokenizer`` and
        ``speaker_encoder`` graphs; from ``pre.prompt_cache`` when the recording was seen before."""

        def compute() -> dict[str, np.ndarray]:
            whisper, fbank, mel = self.pre.prompt_features(wave, sample_rate)
            embedding = self.graphs["speaker_encoder"]({"fbank": fbank[None]})["speaker_embedding"]
            return {"prompt_tokens": self.tokens(whisper), "prompt_mel": mel,
                    "embedding": np.asarray(embedding, np.float32).reshape(-1)}

        cache = self.pre.prompt_cache
        if cache is None:
            entry = compute()
        else:
            key = prompt_key(wave, sample_rate, kind="vc_stream_prompt", options=self.pre.options)
            entry = cache.get_or_compute(key, compute)
        return StreamPrompt(np.array(entry["prompt_tokens"]), np.array(entry["prompt_mel"]),
                            np.array(entry["embedding"]))

    def stream(self, tensors: Mapping[str, np.ndarray | None], parameters: Mapping | None = None, *,
               cancelled: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Float32 chunks of one request at :attr:`sample_rate` (errors: :class:`CosyVoiceError` for bad
        input)."""
        prompt, tokens, seed = self.prepare(tensors, parameters)
        if tokens.size < 1:
            raise CosyVoiceError("source_audio: no speech tokens (too short)")
        chunks = self.token2wav.chunks(prompt, tokens.tolist(), seed=seed, cancelled=cancelled)
        yield from self.post.stream().run(chunks)

    def responses(self, tensors: Mapping[str, np.ndarray | None], parameters: Mapping | None = None, *,
                  cancelled: Callable[[], bool] | None = None) -> Iterator[dict[str, np.ndarray]]:
        """:meth:`stream` as the response tensors of each chunk (:func:`chunk_tensors`)."""
        for i, chunk in enumerate(self.stream(tensors, parameters, cancelled=cancelled)):
            yield chunk_tensors(chunk, i, self.sample_rate)


VC_STREAM_MODEL = "cosyvoice_vc_stream"
#: ``cosyvoice_vc_stream``: the ``cosyvoice_vc`` inputs and ``speaker_id`` (instead of the prompt audio), all optional
#: in the config (the request is checked here); one response per chunk, then an empty final response.
VC_STREAM_INPUTS: tuple[TensorSpec, ...] = (*VC_INPUTS, *VC_OPTIONAL_INPUTS,
                                            TensorSpec("speaker_id", "bytes", ("batch", 1)))
VC_STREAM_OUTPUTS: tuple[TensorSpec, ...] = (*VC_OUTPUTS, TensorSpec("chunk_index", "int32", ("batch", 1)))


def chunk_tensors(chunk: np.ndarray, index: int, sample_rate: int) -> dict[str, np.ndarray]:
    """One streamed response's outputs (batch 1)."""
    return {"waveform": np.ascontiguousarray(chunk, np.float32)[None],
            "sample_rate": np.array([[sample_rate]], np.int32), "chunk_index": np.array([[index]], np.int32)}


def build_streamer(params: Mapping, graph_fn: Callable[[str, str], GraphFn],
                   speakers: Callable[[str], SpeakerPrompt] | None, *,
                   on_state_change: Callable[[int, int], object] | None = None) -> VCStreamer:
    """The streamer of a ``cosyvoice_vc_stream`` model from its config parameters
    (``MODEL_PARAMS["cosyvoice_vc_stream"]``); ``graph_fn(model, graph)`` as in :func:`.speakers.build_service`;
    ``on_state_change(streams, bytes)``: told of the streams' flow state (a gauge; :mod:`.stream_state`)."""
    from pathlib import Path

    from ...config import ModelConfig
    from .stream_state import build_incremental

    model_dir = Path(params["model_dir"])
    config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    pre = Preprocessor(config.mel, sample_rate=config.sample_rate, min_seconds=params["min_seconds"],
                       max_seconds=params["max_seconds"],
                       prompt_cache=PromptCache.from_params(params.get("prompt_cache_entries", 0),
                                                            params.get("prompt_cache_mb", 0)),
                       model_id=f"{model_dir.resolve()}|speech_tokenizer|speaker_encoder")
    solver = FlowSolver(config.flow.cfm, token_mel_ratio=config.token_mel_ratio,
                        n_timesteps=params["n_timesteps"] or None)
    graphs = {g: graph_fn(g, g) for g in GRAPHS}
    return VCStreamer(pre, solver, graphs, speakers=speakers, default_seed=params["default_seed"],
                      post=stream_postprocessor(params, config.sample_rate), schedule=stream_schedule(params, config),
                      incremental=build_incremental(params, model_dir, config, on_change=on_state_change))


def stream_schedule(params: Mapping, config=None) -> StreamSchedule:
    """The :class:`~...streaming.StreamSchedule` of the ``stream_*`` config parameters (absent: the official hops),
    aligned to the flow's attention chunk of ``config`` (a :class:`~...config.ModelConfig`; None: 25 tokens)."""
    chunk = 25 if config is None else config.flow.encoder.static_chunk_size
    return StreamSchedule(int(params.get("stream_first_hop", 25)), int(params.get("stream_hop_growth", 2)),
                          int(params.get("stream_max_hop", 100)), chunk=chunk)


def stream_postprocessor(params: Mapping, model_sample_rate: int) -> Postprocessor:
    """The output options of a streaming model's config parameters (``output_sample_rate``, ``loudness_lufs``,
    ``peak_dbfs``: the ``postprocess`` stage's), logging those that streamed chunks do not get."""
    import logging

    post = Postprocessor(model_sample_rate=model_sample_rate, output_sample_rate=params["output_sample_rate"],
                         loudness_lufs=params["loudness_lufs"], peak_dbfs=params["peak_dbfs"])
    if post.not_streamed:
        logging.getLogger(__name__).warning(
            "streamed chunks are not loudness-normalised (%s applies to whole answers only: its gain needs the "
            "whole utterance)", ", ".join(post.not_streamed))
    return post


class StreamWorkers:
    """Serve streams of a decoupled Python model from worker threads, so that ``execute()`` returns at once and
    streams run side by side.

    ``pb``: ``triton_python_backend_utils``; ``stream(tensors, parameters, cancelled) -> iterator of chunk
    tensors``. At most ``max_streams`` run at once and ``max_waiting`` wait for a worker; a request beyond that
    is answered at once with UNAVAILABLE (retry later) on its stream. A bad request gets INVALID_ARG, a failure
    INTERNAL, a cancelled stream (``is_cancelled()``, checked before each chunk) CANCELLED; each as its stream's
    final response, nothing hangs. ``on_reject(error)``: told of each request answered here, before any stream
    ran (refused, unreadable inputs), with its message or exception (the speech metrics count it).
    """

    def __init__(self, pb, stream: Callable[..., Iterator[Mapping[str, np.ndarray]]], input_names: Iterable[str], *,
                 max_streams: int, max_waiting: int, name: str = "stream",
                 on_reject: Callable[[BaseException | str], object] | None = None):
        from concurrent.futures import ThreadPoolExecutor
        from threading import Lock

        if max_streams < 1 or max_waiting < 0:
            raise ValueError(f"need max_streams >= 1 and max_waiting >= 0, got {max_streams}, {max_waiting}")
        self.pb, self.stream, self.inputs, self.name = pb, stream, list(input_names), name
        self.on_reject = on_reject or (lambda error: None)
        self.max_streams, self.max_waiting = int(max_streams), int(max_waiting)
        self.pool = ThreadPoolExecutor(self.max_streams, thread_name_prefix=name)
        self.lock, self.pending = Lock(), 0
        self.counts = {"started": 0, "finished": 0, "refused": 0, "cancelled": 0, "failed": 0}

    def submit(self, request) -> None:
        """Take one request of ``execute()``: run it in a worker, or refuse it at once."""
        from . import triton_io

        pb = self.pb
        sender = request.get_response_sender()
        with self.lock:
            busy = self.pending >= self.max_streams + self.max_waiting
            if not busy:
                self.pending += 1
            else:
                self.counts["refused"] += 1
        if busy:
            msg = (f"{self.name}: too many concurrent streams ({self.max_streams} running, {self.max_waiting} "
                   "waiting, the configured maximum); retry later")
            self.on_reject(msg)
            sender.send(pb.InferenceResponse(error=triton_io.triton_error(pb, msg, pb.TritonError.UNAVAILABLE)),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        try:
            tensors = triton_io.read_inputs(pb, request, self.inputs)
            params = triton_io.request_parameters(request)
        except Exception as exc:
            self._done("failed")
            self.on_reject(exc)
            sender.send(triton_io.error_response(pb, exc), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        self.pool.submit(self._run, request, sender, tensors, params)

    def _done(self, what: str) -> None:
        with self.lock:
            self.pending -= 1
            self.counts[what] += 1

    def _run(self, request, sender, tensors, params) -> None:
        from . import triton_io

        pb, final = self.pb, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        outcome = "finished"

        def cancelled() -> bool:
            return bool(sender.is_cancelled() if hasattr(sender, "is_cancelled") else request.is_cancelled())

        try:
            with self.lock:
                self.counts["started"] += 1
            for out in self.stream(tensors, params, cancelled=cancelled):
                sender.send(pb.InferenceResponse(output_tensors=[pb.Tensor(k, np.ascontiguousarray(v))
                                                                 for k, v in out.items()]))
            sender.send(flags=final)
        except StreamCancelled as exc:
            outcome = "cancelled"
            sender.send(pb.InferenceResponse(error=triton_io.triton_error(pb, str(exc), pb.TritonError.CANCELLED)),
                        flags=final)
        except Exception as exc:
            outcome = "finished" if isinstance(exc, CosyVoiceError) else "failed"
            sender.send(triton_io.error_response(pb, exc), flags=final)
        finally:
            self._done(outcome)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
