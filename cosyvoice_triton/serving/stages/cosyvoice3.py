"""CosyVoice3 served beside CosyVoice2: the models of a CosyVoice3 folder (tunable ``cosyvoice3_dir``).

:class:`Cv3Service` is one CosyVoice3 folder in a served instance, in process (the library's
:class:`~cosyvoice_triton.models.cosyvoice3.pipeline.CosyVoice3`, PyTorch on the instance's threads). It answers

- ``cosyvoice3_tts_stream`` (:meth:`Cv3Service.responses`): the tensors of ``cosyvoice_tts_stream``, chunks on the
  official CosyVoice3 streaming schedule (``stream`` true) or one answer per text segment (false, with ``speed``);
- ``cosyvoice3_vc`` (:meth:`Cv3Service.convert`): the tensors of ``cosyvoice_vc`` less ``seed`` (CosyVoice3's
  vocoder noise is its fixed buffer: nothing to seed), the official ``inference_vc``;
- ``cosyvoice3_tts_live`` (:meth:`Cv3Service.live`, through :func:`~.live_tts.serve_session`): the tensors of
  ``cosyvoice_tts_live``, the text arriving in pieces (``CosyVoice3.tts_live``: the official bistream decoding on
  CosyVoice3's layout).

``cosyvoice3_tts`` (whole answers) and ``cosyvoice3`` (the official runtime's CosyVoice3 interface, the same
tensors as its ``cosyvoice2``) are the CosyVoice2 adapters of ``cosyvoice_tts`` and ``cosyvoice2`` pointed at
``cosyvoice3_tts_stream`` by BLS.

The mode comes from the inputs as for CosyVoice2 (``instruct_text``: instruct2; ``prompt_text``: zero-shot; neither:
cross-lingual; or ``mode``). CosyVoice3's LM needs ``<|endofprompt|>`` after a system prompt: a prompt text,
instruct text or cross-lingual text without it gets the official examples' ``You are a helpful assistant.`` and
``<|endofprompt|>`` in front (:func:`~cosyvoice_triton.frontend.text.cosyvoice3.with_system_prompt`), as the
official runtime does to ``reference_text``.

A ``speaker_id`` is a speaker registered with ``cosyvoice3_speakers`` (the ``speakers`` tensors, CosyVoice3's
prompts in their own store), fetched from it by BLS (``speakers``: ``speaker_id -> SpeakerPrompt``); with no
``mode``, a speaker registered with a transcript speaks zero-shot, one without cross-lingually.

One instance computes ``concurrency`` requests at a time (tunable ``cosyvoice3_concurrency``, default 1: one copy of
the weights, each request's computation its own, their text segments decoded in one in-flight LM batch,
:class:`~.lm_engine.LMEngine`; a live TTS session holds a place while it computes, and gives it back while it waits
for its text; its LM decodes on its own, as CosyVoice2's); a request that waits longer than ``wait_timeout_s`` for a
place is refused (UNAVAILABLE). More concurrency comes from instances (tunable ``instances``); with tunable
``cosyvoice3_onnx_dir`` the flow steps of the requests computing at once, in one instance or several, run on the
served DiT estimator graphs, batched (:mod:`.cosyvoice3_graphs`). Live voice conversion (``cosyvoice3_vc_live``) is
:mod:`.cosyvoice3_live_vc`, over this service.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import TextError
from ...frontend import audio
from ...frontend.text.cosyvoice3 import resolve_mode, with_system_prompt
from ...speakers import SpeakerPrompt
from ...streaming import SCHEDULES, RuntimeSchedule, StreamSchedule
from .batching import RequestError
from .frontend import Preprocessor
from .lm_engine import BUSY, EngineBusy, JobCancelled, LMEngine
from .metrics import streaming
from .postprocess import Postprocessor
from .stream_state import DEFAULTS, MB, StateBudget
from .tts import bytes_input, registered_voice, speed_input
from .vocoder import parse_seed

__all__ = ["Cv3LiveResponses", "Cv3Service", "build_service", "stream_states"]


def _with_last(chunks: Iterable[np.ndarray]) -> Iterator[tuple[np.ndarray, bool]]:
    it = iter(chunks)
    try:
        prev = next(it)
    except StopIteration:
        return
    for chunk in it:
        yield prev, False
        prev = chunk
    yield prev, True


class Cv3Service:
    """A CosyVoice3 model (``model``: a loaded :class:`~cosyvoice_triton.models.cosyvoice3.pipeline.CosyVoice3`)
    behind the served tensors; see the module docstring."""

    def __init__(self, model, *, min_seconds: float = audio.MIN_SECONDS, max_seconds: float = audio.MAX_SECONDS,
                 output_sample_rate: int = 0, wait_timeout_s: float = 60.0,
                 speakers: Callable[[str], SpeakerPrompt] | None = None, concurrency: int = 1):
        if int(concurrency) < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.model = model
        self.speakers = speakers
        self.pre = Preprocessor(model.config.mel, sample_rate=model.sample_rate, min_seconds=min_seconds,
                                max_seconds=max_seconds)
        self.post = Postprocessor(model_sample_rate=model.sample_rate, output_sample_rate=output_sample_rate)
        self.sample_rate = self.post.output_sample_rate
        self.wait_timeout_s = float(wait_timeout_s)
        #: requests computing at once on this instance (one copy of the weights; each request's computation is its
        #: own, so concurrent answers are bit for bit those computed alone)
        self.concurrency = int(concurrency)
        self._lock = threading.BoundedSemaphore(self.concurrency)
        #: with several places, the text segments of the requests computing at once decode in one in-flight LM
        #: batch (each row with its request's seeded draws: the tokens it gets alone)
        self.engine = None
        if self.concurrency > 1 and getattr(model, "llm", None) is not None:
            self.engine = LMEngine(model.llm, max_active=self.concurrency, max_waiting=self.concurrency,
                                   wait_timeout_s=self.wait_timeout_s, name="cosyvoice3-lm")
            model.lm_submit = self.engine.stream

    def close(self) -> None:
        """Stop the LM engine's loop (if any)."""
        if self.engine is not None:
            self.engine.close()

    @classmethod
    def load(cls, model_dir: str | Path, *, tts: bool = True, lm_precision: str = "fp32", torch_threads: int = 1,
             text_limits: Mapping[str, int] | None = None, flow_precision: str = "fp32", **kw: Any) -> Cv3Service:
        """Load ``model_dir`` (a CosyVoice3 folder; another family is refused) on the CPU. ``text_limits``: the
        text front end's (``max_chars``, ``max_digit_run``, ``max_digits``; a longer text is a client error);
        ``flow_precision``: ``fp32`` or ``int8`` (:mod:`~cosyvoice_triton.models.cosyvoice3.dit_quant`)."""
        from ...models.cosyvoice3.pipeline import CosyVoice3

        model = CosyVoice3.from_pretrained(model_dir, tts=tts, lm_precision=lm_precision, threads=torch_threads,
                                           text_limits=text_limits, flow_precision=flow_precision)
        return cls(model, **kw)

    def _take(self) -> None:
        """Take one of the instance's :attr:`concurrency` places (:class:`~.lm_engine.EngineBusy` after
        ``wait_timeout_s``)."""
        if not self._lock.acquire(timeout=self.wait_timeout_s):
            raise EngineBusy(f"{BUSY}this CosyVoice3 instance was busy for {self.wait_timeout_s:g} s "
                             f"({self.concurrency} request(s) at a time per instance: add instances, or raise "
                             "cosyvoice3_concurrency)")

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        self._take()
        try:
            yield
        finally:
            self._lock.release()

    # ------------------------------------------------------------------------------------------ text to speech
    def _voice(self, t: Mapping[str, np.ndarray | None]) -> tuple[str, dict[str, Any], str | None, str | None]:
        """(mode, the voice's keywords, prompt text, instruct text) of a request's tensors."""
        prompt_text = bytes_input(t.get("prompt_text"), "prompt_text")
        instruct = bytes_input(t.get("instruct_text"), "instruct_text")
        _, speaker = registered_voice(t, prompt_text, self.speakers, speakers_name="CosyVoice3 speakers model")
        kw: dict[str, Any] = {}
        if speaker is not None:
            kw["speaker"] = speaker
        else:
            kw["prompt_wav"], kw["prompt_sr"] = self.pre.utterance("prompt", t.get("prompt_audio"),
                                                                   t.get("prompt_sample_rate"),
                                                                   t.get("prompt_audio_bytes"))
        mode = resolve_mode(bytes_input(t.get("mode"), "mode"), prompt_text, instruct,
                            speaker=speaker is not None and bool(speaker.prompt_text))
        return mode, kw, prompt_text, instruct

    @staticmethod
    def _prompts(kw: dict[str, Any], prompt_text: str | None, instruct: str | None) -> dict[str, Any]:
        if prompt_text is not None:
            kw["prompt_text"] = prompt_text
        if instruct is not None:
            kw["instruct_text"] = instruct
        return kw

    def tts_request(self, t: Mapping[str, np.ndarray | None]) -> tuple[str, dict[str, Any]]:
        """Check one request's tensors: (mode, the keywords of ``CosyVoice3.tts_stream``); a client error
        (:class:`~cosyvoice_triton.errors.CosyVoiceError`) naming what is wrong."""
        if t.get("text") is None:
            raise TextError("text: missing input (the text to speak, UTF-8)")
        text = bytes_input(t["text"], "text")
        mode, kw, prompt_text, instruct = self._voice(t)
        stream = streaming(t)
        speed = speed_input(t.get("speed"))
        if stream and speed != 1.0:
            raise RequestError("speed: only non-streaming answers change speed (cosyvoice3_tts, or stream=false), "
                               "as the official code's")
        schedule = self._schedule(t.get("stream_schedule"), stream)
        text, prompt_text, instruct = with_system_prompt(mode, text, prompt_text, instruct)
        kw.update(text=text, seed=parse_seed(t.get("seed")), stream=stream, speed=speed, schedule=schedule)
        return mode, self._prompts(kw, prompt_text, instruct)

    @staticmethod
    def _schedule(x: np.ndarray | None, stream: bool) -> StreamSchedule | RuntimeSchedule | None:
        """A request's ``stream_schedule`` (None: the model's own hops)."""
        name = bytes_input(x, "stream_schedule")
        if name is None:
            return None
        if name not in SCHEDULES:
            raise RequestError(f"stream_schedule must be one of {', '.join(SCHEDULES)}, got {name[:40]!r}")
        if not stream:
            raise RequestError("stream_schedule: only streamed answers (stream=true) have chunks")
        return SCHEDULES[name]

    def live_request(self, t: Mapping[str, np.ndarray | None]) -> tuple[str, dict[str, Any]]:
        """A live session's first tensors (the voice, ``mode``, ``seed``; not ``text``): (mode, the keywords of
        ``CosyVoice3.tts_live``). The system prompt is added as for :meth:`tts_request`; in cross-lingual mode the
        library puts it in front of the arriving text."""
        mode, kw, prompt_text, instruct = self._voice(t)
        _, prompt_text, instruct = with_system_prompt(mode, "", prompt_text, instruct)
        kw["seed"] = parse_seed(t.get("seed"))
        return mode, self._prompts(kw, prompt_text, instruct)

    def live(self, t: Mapping[str, np.ndarray | None], text_pieces: Iterable[str | bytes], *,
             cancelled: Callable[[], bool] = lambda: False, max_token_text_ratio: float = 20.0) -> Cv3LiveResponses:
        """A live session (``cosyvoice3_tts_live``): ``t`` its first tensors (see :meth:`live_request`; checked
        now), ``text_pieces`` the text as it arrives (``str`` / UTF-8 ``bytes``, possibly blocking), answered
        with the response tensors of :meth:`responses` on the streaming schedule
        (``CosyVoice3.tts_live``). The session holds the instance while it computes and gives it back while it waits
        for its text (so open sessions of one instance take turns); it raises
        :class:`~.lm_engine.JobCancelled` once ``cancelled()`` turns true."""
        mode, kw = self.live_request(t)
        return Cv3LiveResponses(self, mode, kw, text_pieces, cancelled, max_token_text_ratio)

    def responses(self, t: Mapping[str, np.ndarray | None], *, cancelled: Callable[[], bool] = lambda: False
                  ) -> Iterator[dict[str, np.ndarray]]:
        """One ``cosyvoice3_tts_stream`` request as the response tensors of each chunk (``waveform [1, n]``,
        ``sample_rate``, ``chunk_index``) at the output rate; raises :class:`~.lm_engine.JobCancelled` once
        ``cancelled()`` turns true."""
        mode, kw = self.tts_request(t)
        with self._held():
            chunks = self.model.tts_stream(mode, **kw)
            try:
                yield from self._tensors(chunks, cancelled)
            finally:
                chunks.close()

    def _tensors(self, chunks: Iterable[np.ndarray], cancelled: Callable[[], bool]
                 ) -> Iterator[dict[str, np.ndarray]]:
        """The response tensors of each chunk at the output rate (numbered from 0); raises
        :class:`~.lm_engine.JobCancelled` once ``cancelled()`` turns true."""
        rate = np.array([[self.sample_rate]], np.int32)
        for i, chunk in enumerate(self.post.stream().run(_with_last(chunks))):
            if cancelled():
                raise JobCancelled("the client went away")
            yield {"waveform": np.ascontiguousarray(chunk, np.float32)[None], "sample_rate": rate,
                   "chunk_index": np.array([[i]], np.int32)}

    # ---------------------------------------------------------------------------------------- voice conversion
    def convert(self, t: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """One ``cosyvoice3_vc`` request -> ``waveform [1, N]`` at the output rate and ``sample_rate``."""
        if t.get("seed") is not None:
            raise RequestError("seed: CosyVoice3's vocoder noise is the checkpoint's fixed buffer, there is nothing "
                               "to seed (leave seed out)")
        src, src_sr = self.pre.utterance("source", t.get("source_audio"), t.get("source_sample_rate"),
                                         t.get("source_audio_bytes"))
        prompt, prompt_sr = self.pre.utterance("prompt", t.get("prompt_audio"), t.get("prompt_sample_rate"),
                                               t.get("prompt_audio_bytes"))
        with self._held():
            wave = self.model.vc(src, prompt, source_sr=src_sr, prompt_sr=prompt_sr)
        return {"waveform": self.post.waveform(wave)[None], "sample_rate": np.array([[self.sample_rate]], np.int32)}


def build_service(pb_utils, p: Mapping[str, Any], *, tts: bool = True,
                  on_state_change: Callable[[int, int], Any] | None = None) -> Cv3Service:
    """The :class:`Cv3Service` of a served CosyVoice3 model from its parameters (``p``: read with its
    ``MODEL_PARAMS`` entry); ``tts``: load the LM and text front end. ``pb_utils`` makes the BLS calls to the speakers
    model (``speakers_model``; empty or absent: ``speaker_id`` is refused) and to the estimator graphs
    (``estimator_models``; empty: the DiT in process, :mod:`.cosyvoice3_graphs`). The streams' flow state
    (``stream_state``, ``stream_state_mb``, ``stream_state_total_mb``): :func:`stream_states`, each change told to
    ``on_state_change(streams, bytes)`` (a gauge)."""
    from ...family import COSYVOICE3
    from .cosyvoice3_graphs import bls_decoder, bls_estimator
    from .speakers import BlsSpeakers

    speakers = None
    if p.get("speakers_model"):
        speakers = BlsSpeakers(pb_utils, p["speakers_model"], timeout_us=p["bls_timeout_us"], family=COSYVOICE3)
    kw: dict[str, Any] = {}
    if tts:
        kw = {"lm_precision": p["lm_precision"], "text_limits": {
            "max_chars": p["max_text_chars"], "max_digit_run": p["max_text_digit_run"],
            "max_digits": p["max_text_digits"]}}
    service = Cv3Service.load(p["model_dir"], tts=tts, torch_threads=p["torch_threads"],
                              flow_precision=p["flow_precision"], min_seconds=p["min_seconds"],
                              max_seconds=p["max_seconds"], output_sample_rate=p["output_sample_rate"],
                              wait_timeout_s=p["wait_timeout_s"], speakers=speakers,
                              concurrency=p["concurrency"], **kw)
    service.model.flow.estimator_fn = bls_estimator(pb_utils, p, service.model.flow)
    service.model.hift.decode_fn = bls_decoder(pb_utils, p, service.model.hift)
    if tts:
        stream_states(service.model, p, on_change=on_state_change)
    return service


def stream_states(model, p: Mapping[str, Any], *, on_change: Callable[[int, int], Any] | None = None
                  ) -> StateBudget | None:
    """Give ``model`` (a :class:`~cosyvoice_triton.models.cosyvoice3.pipeline.CosyVoice3`) its streams' flow state
    as the parameters ask (``stream_state``; absent: on): each stream's
    :class:`~cosyvoice_triton.models.cosyvoice3.incremental.Flow3StreamState` holds at most ``stream_state_mb``, and
    all of them at most ``stream_state_total_mb`` (the returned :class:`~.stream_state.StateBudget`); a stream that
    would pass either recomputes from there (never refused for it). None, and the official recompute, when off."""
    p = {**DEFAULTS, **p}
    model.incremental_stream = bool(p["stream_state"])
    if not model.incremental_stream:
        return None
    budget = StateBudget(int(p["stream_state_total_mb"] * MB), on_change)
    model.stream_state = budget.flow3_states(int(p["stream_state_mb"] * MB))
    return budget


class Cv3LiveResponses(Iterator[dict[str, np.ndarray]]):
    """The response tensors of :meth:`Cv3Service.live`; once the first is asked for, :attr:`decode` is the LM's
    :class:`~cosyvoice_triton.models.bistream.LiveDecode` (tokens, :attr:`stop_reason`)."""

    def __init__(self, service: Cv3Service, mode: str, kw: dict[str, Any], text_pieces: Iterable[str | bytes],
                 cancelled: Callable[[], bool], max_token_text_ratio: float):
        self.decode = None
        self._gen = self._run(service, mode, kw, text_pieces, cancelled, max_token_text_ratio)

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    @property
    def stop_reason(self) -> str | None:
        return None if self.decode is None else self.decode.stop_reason

    def _run(self, service: Cv3Service, mode: str, kw: dict[str, Any], text_pieces: Iterable[str | bytes],
             cancelled: Callable[[], bool], max_token_text_ratio: float) -> Iterator[dict[str, np.ndarray]]:
        turn = _Turn(service)
        turn.take()
        try:
            live = service.model.tts_live(mode, _TextWithoutTheInstance(turn, text_pieces), cancelled=cancelled,
                                          max_token_text_ratio=max_token_text_ratio, **kw)
            self.decode = live.decode
            try:
                yield from service._tensors(live, lambda: cancelled() or live.stop_reason == "cancelled")
                if live.stop_reason == "cancelled":
                    raise JobCancelled("the client went away")
            finally:
                live.close()  # its chunks (and their stream state, now) and its decode
        finally:
            turn.give()


class _Turn:
    """A live session's hold on its instance: given back while the session waits for its client's text, taken
    again (within the service's ``wait_timeout_s``) before it computes; so an open session that is not speaking
    does not keep other sessions of the instance waiting."""

    def __init__(self, service: Cv3Service):
        self.service, self.holding = service, False

    def take(self) -> None:
        self.service._take()
        self.holding = True

    def give(self) -> None:
        if self.holding:
            self.holding = False
            self.service._lock.release()


class _TextWithoutTheInstance(Iterator[str | bytes]):
    """The text pieces of a live session, awaited with the instance given back (:class:`_Turn`)."""

    def __init__(self, turn: _Turn, pieces: Iterable[str | bytes]):
        self.turn, self.pieces = turn, iter(pieces)

    def __next__(self) -> str | bytes:
        self.turn.give()
        try:
            return next(self.pieces)
        finally:
            self.turn.take()
