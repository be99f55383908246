"""Served text-to-speech: what ``ensemble/cosyvoice_tts_stream`` (and through it ``cosyvoice_tts``) runs per request.

:class:`TTSService` does what :meth:`CosyVoice2.tts_stream <cosyvoice_triton.pipeline.CosyVoice2.tts_stream>`
does, with the served pieces:

- the request's tensors are checked (:meth:`TTSService.prepare`): text (UTF-8, :class:`~...text.TextFrontend`
  rules), mode, the prompt as audio (samples + rate or an encoded file) or a registered ``speaker_id``;
- prompt features: the 16 kHz Whisper log-mel and Kaldi fbank and the 24 kHz mel computed here (as
  ``CosyVoice2.prompt``), the speech tokens and CAM++ embedding from the ``speech_tokenizer`` and
  ``speaker_encoder`` graphs (callables: BLS in Triton); a ``speaker_id`` is fetched from the ``speakers`` model;
- the LM: each text segment joins the ONE in-flight batch of :class:`~.lm_engine.LMEngine` (seeded draws shared by
  the segments of a request, as in process);
- token to wav: non-streaming, the ``flow`` and ``hift`` stages (callables: BLS) on the whole segment;
  streaming, the official chunk schedule (:meth:`CosyVoice2.stream_chunk_ends`) over the tokens as they arrive,
  each chunk through :class:`~.flow.FlowSolver` with the chunk's streaming flag and look-ahead (graphs
  ``flow_encoder`` / ``flow_estimator``) and HiFT with the previous chunk's mel / source cache, continued NSF
  noise and the Hamming crossfade (graphs ``hift_source`` / ``hift_decoder``);
- the answer's chunks (or segments) post-processed as one stream (:meth:`.postprocess.Postprocessor.stream`: the
  configured output rate, resampled continuously across chunks and segments; loudness normalisation, which needs
  the whole utterance, is left to ``cosyvoice_tts``).

Live requests (:meth:`TTSService.live`: the text arrives in pieces while audio is answered) decode with
:class:`~...models.bistream.LiveDecode` in the caller's thread, outside the engine's batch, and stream their chunks the
same way.

The stages keep no per-request state, which a stream needs (the HiFT cache, the noise generator, the chunk
offsets): that state lives here, and the graphs it calls still batch across requests (dynamic batching).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import ModelConfig
from ...errors import CosyVoiceError, LLMError, TextError, shown
from ...frontend.text.frontend import MAX_DIGIT_RUN, MAX_DIGITS
from ...models.llm import MAX_TOKEN_TEXT_RATIO, MIN_TOKEN_TEXT_RATIO, QWEN_DIR, LMRequest, Qwen2LM, load_llm
from ...models.speed import change_speed, check_speed
from ...pipeline import lm_prompt
from ...prompt_cache import PromptCache
from ...shapes import GRAPHS, flow_token_room
from ...speaker_state import SpeakerState
from ...speakers import SpeakerPrompt
from ...streaming import StreamSchedule
from .batching import RequestError
from .flow import FlowItem, FlowSolver, GraphFn
from .frontend import Preprocessor
from .lm_engine import BUSY, EngineBusy, JobCancelled, LMEngine
from .postprocess import Postprocessor
from .speakers import compute_prompt
from .stream_state import IncrementalFlow
from .vc_stream import StreamCancelled, StreamingToken2Wav, StreamPrompt, stream_postprocessor
from .vocoder import parse_seed

log = logging.getLogger(__name__)

__all__ = ["LiveResponses", "TTSPlan", "TTSService", "build_service", "bytes_input", "registered_voice",
           "service_from_params"]

#: ``flow(item) -> mel [80, T]`` (the ``flow`` stage) and ``hift(mel, seed) -> waveform`` (the ``hift`` stage).
FlowFn = Callable[[FlowItem], np.ndarray]
HiftFn = Callable[[np.ndarray, int], np.ndarray]
SpeakerFn = Callable[[str], SpeakerPrompt]


def bytes_input(x, name: str, *, text: bool = True) -> str | bytes | None:
    """One ``[1, 1]`` BYTES tensor -> ``str`` (UTF-8 checked, ``text=True``) or ``bytes``; None stays None."""
    if x is None:
        return None
    if isinstance(x, (bytes, bytearray)):
        item = bytes(x)
    else:
        arr = np.asarray(x, dtype=object)
        if arr.size != 1:
            raise RequestError(f"{name}: expected one value per request, got shape {list(arr.shape)}")
        item = arr.reshape(-1)[0]
        if isinstance(item, str):
            item = item.encode()
        if not isinstance(item, (bytes, bytearray)):
            raise RequestError(f"{name}: expected BYTES, got {type(item).__name__}")
        item = bytes(item)
    if not text:
        return item
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TextError(f"{name}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


@dataclass
class TTSPlan:
    """One checked request: the segments' text tokens, the LM prompt, the flow prompt, the seed."""

    segments: list[tuple[str, np.ndarray]]
    lm_prompt_text_tokens: np.ndarray
    lm_prompt_speech_tokens: np.ndarray
    prompt: SpeakerPrompt
    seed: int
    mode: str
    speaker_id: str | None = None
    max_speech_tokens: int | None = None  # the flow's room beside the prompt: the LM stops there
    speed: float = 1.0  # the final mel's stretch (non-streaming answers only: models/speed.py)

    def stream_prompt(self) -> StreamPrompt:
        """The flow's prompt of the streamed chunks (a registered speaker's shares its settled frames)."""
        return StreamPrompt.from_speaker(self.prompt, registered=self.speaker_id is not None)


def speed_input(value: np.ndarray | None) -> float:
    """The ``speed`` input (one float; absent: 1.0), checked (:func:`~...models.speed.check_speed`)."""
    if value is None:
        return 1.0
    value = np.asarray(value)
    if value.size != 1 or value.dtype.kind != "f":
        raise RequestError(f"speed: expected one float, got {value.dtype} of shape {list(value.shape)}")
    return check_speed(value.reshape(()).item())



def registered_voice(t: Mapping[str, np.ndarray | None], prompt_text: str | None,
                     speakers: SpeakerFn | None, *, speakers_name: str = "speakers model"
                     ) -> tuple[str | None, SpeakerPrompt | None]:
    """A TTS request's voice: ``(speaker_id, its prompt by speakers(speaker_id))``, or ``(None, None)`` when the
    voice is the prompt audio. Refused (:class:`TextError`): neither, both, a ``prompt_text`` beside a
    ``speaker_id`` (it belongs to the audio), a ``speaker_id`` where there are no ``speakers`` (the
    ``speakers_name`` that is missing)."""
    speaker_id = bytes_input(t.get("speaker_id"), "speaker_id")
    has_audio = any(t.get(n) is not None for n in ("prompt_audio", "prompt_sample_rate", "prompt_audio_bytes"))
    if not has_audio and speaker_id is None:
        raise TextError("prompt_text without prompt audio: send prompt_audio with prompt_sample_rate, or "
                        "prompt_audio_bytes (or a registered speaker_id)" if prompt_text is not None else
                        "a voice prompt is needed: prompt_audio with prompt_sample_rate, prompt_audio_bytes, or "
                        "a registered speaker_id")
    if has_audio and speaker_id is not None:
        raise TextError("give prompt audio or a speaker_id, not both")
    if speaker_id is None:
        return None, None
    if prompt_text is not None:
        raise TextError("prompt_text belongs to prompt audio: register the speaker with its text instead")
    if speakers is None:
        raise TextError(f"speaker_id: this server has no {speakers_name}")
    return speaker_id, speakers(speaker_id)

class TTSService:
    """The served TTS of one model folder (see the module docstring).

    Args:
        model_dir: the CosyVoice2 folder (``llm.pt``, ``CosyVoice-BlankEN/``, ``cosyvoice2.yaml``).
        graphs: callables of ``speech_tokenizer``, ``speaker_encoder``, ``flow_encoder``, ``flow_estimator``,
            ``hift_source``, ``hift_decoder`` (numpy dicts named as :data:`~...shapes.GRAPHS`).
        flow, hift: the non-streaming stages (None: :class:`FlowSolver` / HiFT on ``graphs`` here).
        speakers: ``speaker_id -> SpeakerPrompt`` (None: ``speaker_id`` is refused).
        max_active, max_waiting, wait_timeout_s: the LM engine's queue policy.
        max_text_chars: longest accepted text; max_digit_run, max_digits: the longest run of digits and the most
            digits in it (refused before number normalisation, whose cost grows with them).
        min_seconds, max_seconds: accepted prompt duration.
        prompt_cache: a prompt recording seen before skips the front end and both graphs (:func:`.compute_prompt`).
        output: the output options, as config parameters (``output_sample_rate``, ``loudness_lufs``,
            ``peak_dbfs``; None: the model's rate): the answers get what applies to a stream (the rate).
        lm_precision: ``fp32``, ``int8`` or ``fp32-ort`` (:mod:`~...models.lm_quant`).
        stream_schedule: the streaming hops (:class:`~...streaming.StreamSchedule`; None: the official ones).
        lm_prefix_cache_mb: a registered speaker's requests share the LM's KV cache of sos + its transcript
            (:class:`~...speaker_state.SpeakerState`, keyed by the tokens: never stale; 0: off).
        incremental: the streams' flow state (:class:`~.stream_state.IncrementalFlow`; None: every streamed chunk
            runs the flow graphs over every frame).
    """

    def __init__(self, model_dir: str | Path, graphs: Mapping[str, GraphFn], *, flow: FlowFn | None = None,
                 hift: HiftFn | None = None, speakers: SpeakerFn | None = None, max_active: int = 8,
                 max_waiting: int = 16, wait_timeout_s: float = 60.0, max_text_chars: int = 2000,
                 max_digit_run: int = MAX_DIGIT_RUN, max_digits: int = MAX_DIGITS, n_timesteps: int | None = None,
                 min_seconds: float = 0.1, max_seconds: float = 30.0,
                 prompt_cache: PromptCache | None = None,
                 device: str = "cpu", output: Mapping[str, Any] | None = None, lm_precision: str = "fp32",
                 stream_schedule: StreamSchedule | None = None, lm_prefix_cache_mb: float = 64.0,
                 incremental: IncrementalFlow | None = None):
        from ...frontend.text import TextFrontend

        model_dir = Path(model_dir)
        self.config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
        self.post = (stream_postprocessor(output, self.config.sample_rate) if output is not None else
                     Postprocessor(model_sample_rate=self.config.sample_rate))
        #: the rate of the answered chunks (the output rate)
        self.sample_rate = self.post.output_sample_rate
        self.text = TextFrontend(model_dir / QWEN_DIR, max_chars=max_text_chars, max_digit_run=max_digit_run,
                                 max_digits=max_digits)
        self.lm = load_llm(model_dir, self.config, device=device, precision=lm_precision)
        self.engine = LMEngine(self.lm, max_active=max_active, max_waiting=max_waiting, wait_timeout_s=wait_timeout_s)
        self.prefixes = SpeakerState(int(lm_prefix_cache_mb * (1 << 20))) if lm_prefix_cache_mb > 0 else None
        self.pre = Preprocessor(self.config.mel, sample_rate=self.config.sample_rate, min_seconds=min_seconds,
                                max_seconds=max_seconds, prompt_cache=prompt_cache, model_id=str(model_dir.resolve()))
        self.graphs = graphs
        self.solver = FlowSolver(self.config.flow.cfm, token_mel_ratio=self.config.token_mel_ratio,
                                 n_timesteps=n_timesteps, max_batch=1)
        self.flow = flow or self._flow_here
        self.hift = hift or self._hift_here
        self.speakers = speakers
        self.ratio = self.config.token_mel_ratio
        self.lookahead = self.config.flow.pre_lookahead_len
        if stream_schedule is not None:  # aligned to this model's attention chunk (checked again)
            stream_schedule = replace(stream_schedule, chunk=self.config.flow.encoder.static_chunk_size)
        self.streamer = StreamingToken2Wav(self.solver, graphs, lookahead=self.lookahead, schedule=stream_schedule,
                                           incremental=incremental)
        self.stats = {"streams_started": 0, "streams_finished": 0, "streams_cancelled": 0}
        self._lock = threading.Lock()

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------------------------ the request

    def prepare(self, t: Mapping[str, np.ndarray | None]) -> TTSPlan:
        """Check one request's tensors and compute its prompt: :class:`TTSPlan`, or a client error
        (:class:`~...errors.CosyVoiceError`: TextError, AudioError, RequestError, SpeakerError)."""
        if t.get("text") is None:
            raise TextError("text: missing input (the text to speak, UTF-8)")
        text = self.text.check(bytes_input(t["text"], "text"))
        plan = self.prepare_live(t)
        plan.segments = [(s, np.asarray(ids, np.int32)) for s, ids in self.text.tts_segments(text)]
        plan.speed = speed_input(t.get("speed"))
        plan.max_speech_tokens = speech_token_room(plan)
        return plan

    def prepare_live(self, t: Mapping[str, np.ndarray | None]) -> TTSPlan:
        """:meth:`prepare` without the text (a live request's text comes in pieces): the prompt, the mode, the
        seed; ``segments`` is empty."""
        prompt_text = bytes_input(t.get("prompt_text"), "prompt_text")
        instruct = bytes_input(t.get("instruct_text"), "instruct_text")
        mode = bytes_input(t.get("mode"), "mode")
        seed = parse_seed(t.get("seed"))
        speaker_id, speaker = registered_voice(t, prompt_text, self.speakers)
        if speaker is None:
            speaker = self.prompt(t, prompt_text)
        mode, lm_text, lm_speech = lm_prompt(self.text, speaker, mode=mode, instruct=instruct)
        return TTSPlan([], lm_text, lm_speech, speaker, seed, mode, speaker_id)

    def prompt(self, t: Mapping[str, np.ndarray | None], prompt_text: str | None) -> SpeakerPrompt:
        """``CosyVoice2.prompt`` with the graphs: tokens, mel (cut to 2 frames per token), embedding, transcript."""
        text_tokens = None if prompt_text is None else self.text.prompt_tokens(prompt_text)
        return compute_prompt(self.pre, self.graphs,
                              (t.get("prompt_audio"), t.get("prompt_sample_rate"), t.get("prompt_audio_bytes")),
                              token_mel_ratio=self.ratio, prompt_text=prompt_text, prompt_text_tokens=text_tokens)

    def synthesize(self, plan: TTSPlan, *, stream: bool, cancelled: Callable[[], bool] = lambda: False
                   ) -> Iterator[np.ndarray]:
        """float32 chunks at the model's rate (24 kHz): the official streaming schedule (``stream=True``) or one
        per segment. The LM jobs leave the batch when ``cancelled()`` turns true or the consumer stops
        iterating."""
        return (chunk for chunk, _ in self._chunks(plan, stream=stream, cancelled=cancelled))

    def _chunks(self, plan: TTSPlan, *, stream: bool, cancelled: Callable[[], bool]
                ) -> Iterator[tuple[np.ndarray, bool]]:
        """:meth:`synthesize` as ``(chunk, last)`` pairs: the answer's last chunk says so when it comes."""
        draws = torch.Generator().manual_seed(plan.seed)
        for n, (text, ids) in enumerate(plan.segments, 1):
            last_segment = n == len(plan.segments)
            prefix = None
            if plan.speaker_id is not None and self.prefixes is not None:
                prefix = self.prefixes.lm_prefix(self.lm, plan.lm_prompt_text_tokens)
            job = self.engine.submit(LMRequest(ids, plan.lm_prompt_text_tokens, plan.lm_prompt_speech_tokens,
                                               draws=draws, prefix=prefix,
                                               max_token_text_ratio=capped_ratio(ids.size, plan.max_speech_tokens)),
                                     cancelled=cancelled)
            try:
                tokens = job.tokens()
                if stream:
                    for chunk, final in self.streamer.chunks(plan.stream_prompt(), tokens,
                                                             seed=plan.seed):
                        yield chunk, final and last_segment
                else:
                    got = np.asarray(list(tokens), np.int32)
                    if not got.size:
                        raise LLMError(f"the LM produced no speech token for {text!r}")
                    yield self.token2wav(plan.prompt, got, seed=plan.seed, speed=plan.speed), last_segment
            finally:
                job.cancel()  # a no-op once it has finished; frees its row if the consumer stopped early
            if job.hit_max_len:
                log.warning("the LM reached its maximum number of speech tokens without end-of-speech for %r", text)

    def responses(self, t: Mapping[str, np.ndarray | None], *, cancelled: Callable[[], bool] = lambda: False
                  ) -> Iterator[dict[str, np.ndarray]]:
        """One request of ``cosyvoice_tts_stream``, as the response tensors of each chunk (``stream`` input
        absent or true: the chunk schedule; false: one per segment), at the output rate (one streaming
        resampler over the whole answer). Raises :class:`~.lm_engine.JobCancelled` once ``cancelled()`` turns
        true."""
        plan = self.prepare(t)
        stream = t.get("stream") is None or bool(np.asarray(t["stream"]).reshape(-1)[0])
        if stream and plan.speed != 1.0:
            raise RequestError("speed: only non-streaming answers change speed (cosyvoice_tts, or stream=false), "
                               "as the official code's; a stream's chunks are vocoded before the whole mel exists")
        rate = np.array([[self.sample_rate]], np.int32)
        self._count("streams_started")
        try:
            chunks = self.post.stream().run(self._chunks(plan, stream=stream, cancelled=cancelled))
            for i, chunk in enumerate(chunks):
                if cancelled():
                    raise JobCancelled("the client went away")
                yield {"waveform": chunk[None], "sample_rate": rate, "chunk_index": np.array([[i]], np.int32)}
        except JobCancelled:
            self._count("streams_cancelled")
            raise
        self._count("streams_finished")

    def live(self, t: Mapping[str, np.ndarray | None], text_pieces: Iterable[str | bytes], *,
             cancelled: Callable[[], bool] = lambda: False, max_token_text_ratio: float = 20.0) -> LiveResponses:
        """A live request: the text arrives as ``text_pieces`` (``str`` / UTF-8 ``bytes``, possibly blocking; a
        :class:`~...frontend.text.live.LiveText` ends with what it has) while audio is answered, as the response
        tensors of :meth:`responses` on the streaming schedule (``t``: its inputs without ``text``).

        The pieces are tokenized one by one, not normalised, as the official front end does with a text
        generator; the LM decodes them live (:class:`~...models.bistream.LiveDecode`: the official
        ``inference_bistream`` with a step limit of ``max_token_text_ratio`` speech tokens per text token, and
        at most what the flow takes beside the prompt's tokens; a stop reason, :attr:`LiveResponses.stop_reason`).
        That decode runs in the calling thread on its own KV cache, outside the engine's in-flight batch (the
        batch takes whole texts). Raises :class:`~.lm_engine.JobCancelled` once ``cancelled()`` turns true; bad
        pieces raise :class:`~...errors.TextError` when they are read."""
        from ...frontend.text.live import piece_tokens
        from ...models.bistream import live_decode

        plan = self.prepare_live(t)
        tokens = piece_tokens(self.text.tokenizer, text_pieces, max_chars=self.text.max_chars,
                              strict_tags=self.text.strict_tags)
        decode = live_decode(self.lm, tokens, plan.lm_prompt_text_tokens, plan.lm_prompt_speech_tokens,
                             draws=torch.Generator().manual_seed(plan.seed), cancelled=cancelled,
                             max_token_text_ratio=max_token_text_ratio, max_tokens=flow_room(plan.prompt))
        return LiveResponses(self._live(plan, decode, cancelled), decode)

    def _live(self, plan: TTSPlan, decode, cancelled: Callable[[], bool]) -> Iterator[dict[str, np.ndarray]]:

        rate = np.array([[self.sample_rate]], np.int32)
        self._count("streams_started")

        def stop() -> bool:
            return decode.stop_reason == "cancelled" or cancelled()

        try:
            pairs = self.streamer.chunks(plan.stream_prompt(), decode, seed=plan.seed,
                                         cancelled=stop)
            for i, chunk in enumerate(self.post.stream().run(pairs)):
                if stop():
                    raise JobCancelled("the client went away")
                yield {"waveform": chunk[None], "sample_rate": rate, "chunk_index": np.array([[i]], np.int32)}
        except StreamCancelled:
            self._count("streams_cancelled")
            raise JobCancelled("the client went away") from None
        except JobCancelled:
            self._count("streams_cancelled")
            raise
        finally:
            decode.close()
        self._count("streams_finished")

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def snapshot(self) -> dict[str, int]:
        """The LM engine's counters (:meth:`.lm_engine.LMEngine.snapshot`) and the streams': started, finished,
        cancelled (by the client, before their end)."""
        with self._lock:
            return {**self.engine.snapshot(), **self.stats}

    # -------------------------------------------------------------------------------- token to wav

    def _item(self, prompt: SpeakerPrompt, tokens: np.ndarray, *, streaming: bool, lookahead: int) -> FlowItem:
        return FlowItem(np.asarray(tokens, np.int32), np.array(prompt.prompt_tokens), np.array(prompt.prompt_mel),
                        np.array(prompt.embedding), streaming=streaming, lookahead=lookahead)

    def _flow_here(self, item: FlowItem) -> np.ndarray:
        return self.solver.run([item], self.graphs["flow_encoder"], self.graphs["flow_estimator"])[0].unwrap()

    def _hift_here(self, mel: np.ndarray, seed: int) -> np.ndarray:
        from .vocoder import HiftRunner

        return HiftRunner().run([mel], [seed], self.graphs["hift_source"], self.graphs["hift_decoder"])[0].unwrap()

    def token2wav(self, prompt: SpeakerPrompt, tokens: np.ndarray, *, seed: int, speed: float = 1.0) -> np.ndarray:
        """Non-streaming (``CosyVoice2.token2wav``): the ``flow`` then the ``hift`` stage, the mel stretched by
        ``speed`` between them (:func:`~...models.speed.change_speed`)."""
        mel = change_speed(self.flow(self._item(prompt, tokens, streaming=False, lookahead=0)), speed)
        return np.asarray(self.hift(mel, seed), np.float32).reshape(-1)


class LiveResponses(Iterator[dict[str, np.ndarray]]):
    """The response tensors of :meth:`TTSService.live`; after the last, :attr:`stop_reason` says why the LM
    stopped (:data:`~...models.bistream.STOP_REASONS`) and :attr:`decode` holds its tokens."""

    def __init__(self, responses: Iterator[dict[str, np.ndarray]], decode):
        self._responses, self.decode = responses, decode

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._responses)

    @property
    def stop_reason(self) -> str | None:
        return self.decode.stop_reason

    def close(self) -> None:
        self._responses.close()


def flow_room(prompt: SpeakerPrompt) -> int:
    """How many speech tokens the flow takes beside ``prompt``'s (:func:`~cosyvoice_triton.shapes.flow_token_room`)."""
    return flow_token_room(prompt.prompt_tokens.size)


def speech_token_room(plan: TTSPlan) -> int:
    """The most speech tokens one segment's LM may make: the flow takes at most ``tokens`` (its graph's axis) with
    the prompt's. Checked before the LM runs: a segment whose least number of tokens (the official
    ``min_token_text_ratio``, 2 per text token) cannot fit is refused naming it; the LM of any other stops where
    the flow's room ends (the official LM would go on to 20 per text token, for a flow that refuses them)."""
    room = flow_room(plan.prompt)
    for n, (text, ids) in enumerate(plan.segments, 1):
        least = Qwen2LM.length_bounds(int(ids.size), MIN_TOKEN_TEXT_RATIO, 0)[0]
        if least > room:
            raise TextError(
                f"text segment {n} ({text[:40]!r}...) has {ids.size} text tokens: the LM makes at least {least} "
                f"speech tokens for it, and with the prompt's {plan.prompt.prompt_tokens.size} that is more than "
                f"the flow's {GRAPHS['flow_encoder'].axes['tokens'].max}; shorten it (or end its sentences) or "
                f"use a shorter prompt")
    return room


def capped_ratio(text_tokens: int, room: int | None) -> float:
    """The LM's ``max_token_text_ratio`` for a segment: the official 20, or less where that many speech tokens
    would not fit the flow's ``room`` (``int(n * ratio)`` in float32 stays <= ``room``)."""
    if room is None or text_tokens * MAX_TOKEN_TEXT_RATIO <= room:
        return MAX_TOKEN_TEXT_RATIO
    return room / text_tokens


#: How the messages start that :func:`error_code` reads as other than the client's (lm_engine.BUSY's text).
_RESERVED = ("internal error: ", BUSY)


def error_response(pb, exc: BaseException):
    """:func:`.triton_io.error_response`, with UNAVAILABLE for a full LM queue (:class:`~.lm_engine.EngineBusy`)."""
    from .triton_io import error_response as base
    from .triton_io import triton_error as base_error

    if isinstance(exc, EngineBusy):
        message = str(exc) if str(exc).startswith(BUSY) else f"{BUSY}{exc}"
        return pb.InferenceResponse(error=base_error(pb, message, pb.TritonError.UNAVAILABLE))
    client = isinstance(exc, CosyVoiceError) or getattr(exc, "invalid_argument", False)
    if client and str(exc).startswith(_RESERVED):  # never read back as another code (error_code)
        return pb.InferenceResponse(error=base_error(pb, f"bad request: {exc}", pb.TritonError.INVALID_ARG))
    return base(pb, exc)


def send_stream(pb, sender, responses: Callable[[], Iterable[Mapping[str, np.ndarray]]]) -> None:
    """The responses of a decoupled TTS stream (``responses()``: each one's tensors) through ``sender``, then the
    FINAL flag: alone when the stream ended or the client cancelled it (:class:`~.lm_engine.JobCancelled`), with
    :func:`error_response` when it failed."""
    import contextlib

    final = None
    try:
        for tensors in responses():
            sender.send(pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in tensors.items()]))
    except JobCancelled:
        final = None
    except Exception as exc:
        final = error_response(pb, exc)
    with contextlib.suppress(Exception):  # a cancelled stream may refuse it: nothing left to close
        sender.send(final, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def error_code(pb, message: str):
    """The ``TritonError`` code of a message that :func:`error_response` wrote (a decoupled BLS response carries
    the message but not the code in Triton 2.51): INTERNAL for ours (``internal error: ...``), UNAVAILABLE for
    a full LM queue (:data:`~.lm_engine.BUSY`), INVALID_ARG for the client's. Only how the message starts counts,
    which :func:`error_response` decides by the error's type: text of the client's quoted inside a message (an
    unknown tag, a speaker id) never changes the code."""
    if message.startswith(_RESERVED[0]):
        return pb.TritonError.INTERNAL
    return pb.TritonError.UNAVAILABLE if message.startswith(BUSY) else pb.TritonError.INVALID_ARG


def bls(pb, model: str, tensors: Mapping[str, np.ndarray], outputs: Iterable[str], *, timeout_us: int = 0
        ) -> dict[str, np.ndarray]:
    """One BLS call of a (non-decoupled) model; its error raised as :class:`.triton_io.BlsError` (a client error
    when the callee answered INVALID_ARG)."""
    from .triton_io import BlsError, _InvalidBls

    kwargs = {"timeout": int(timeout_us)} if timeout_us else {}
    req = pb.InferenceRequest(model_name=model, inputs=[pb.Tensor(k, np.ascontiguousarray(v)) if np.asarray(v).dtype
                                                        != object else pb.Tensor(k, np.asarray(v, dtype=object))
                                                        for k, v in tensors.items()],
                              requested_output_names=list(outputs), **kwargs)
    res = req.exec()
    if res.has_error():
        err = res.error()
        invalid = hasattr(err, "code") and err.code() in (pb.TritonError.INVALID_ARG, pb.TritonError.NOT_FOUND)
        raise (_InvalidBls if invalid else BlsError)(model, err.message(), invalid)
    out = {}
    for name in outputs:
        t = pb.get_output_tensor_by_name(res, name)
        if t is None:
            raise BlsError(model, f"response has no output {name!r}")
        out[name] = t.as_numpy()
    return out


def stage_callables(pb, *, flow_model: str = "flow", hift_model: str = "hift", speakers_model: str = "speakers",
                    timeout_us: int = 0) -> tuple[FlowFn, HiftFn, SpeakerFn]:
    """The ``flow`` / ``hift`` stages and the ``speakers`` model as :class:`TTSService` callables (BLS)."""
    from ...errors import SpeakerError
    from .triton_io import BlsError

    def flow(item: FlowItem) -> np.ndarray:
        out = bls(pb, flow_model, {"source_speech_tokens": item.source_tokens[None],
                                   "prompt_speech_tokens": item.prompt_tokens[None],
                                   "prompt_mel": item.prompt_mel[None].astype(np.float32),
                                   "speaker_embedding": item.embedding[None].astype(np.float32)}, ["mel"],
                  timeout_us=timeout_us)
        return out["mel"][0]

    def hift(mel: np.ndarray, seed: int) -> np.ndarray:
        out = bls(pb, hift_model, {"mel": np.ascontiguousarray(mel[None], np.float32),
                                   "seed": np.array([[seed]], np.int64)}, ["waveform"], timeout_us=timeout_us)
        return out["waveform"][0]

    def speaker(speaker_id: str) -> SpeakerPrompt:
        names = ("prompt_tokens", "prompt_mel", "embedding", "prompt_text_tokens", "prompt_text")
        try:
            out = bls(pb, speakers_model, {"action": np.array([[b"get"]], object),
                                           "speaker_id": np.array([[speaker_id.encode()]], object)}, names,
                      timeout_us=timeout_us)
        except BlsError as exc:
            raise SpeakerError(f"speaker_id {shown(speaker_id)}: {exc}") from None
        text = out["prompt_text"].reshape(-1)[0]
        return SpeakerPrompt(prompt_tokens=out["prompt_tokens"].reshape(-1), prompt_mel=out["prompt_mel"][0],
                             embedding=out["embedding"].reshape(-1),
                             prompt_text_tokens=out["prompt_text_tokens"].reshape(-1),
                             prompt_text=text.decode() if isinstance(text, bytes) else str(text))

    return flow, hift, speaker


def build_service(pb, p: Mapping[str, Any], *, on_state_change: Callable[[int, int], object] | None = None
                  ) -> TTSService:
    """The :class:`TTSService` of a served TTS model from its config parameters (``MODEL_PARAMS``' TTS service
    keys): the graphs, ``flow`` / ``hift`` and the speakers model by BLS (``pb``: ``triton_python_backend_utils``),
    the instance's niceness and torch threads set first (before it starts its threads); ``on_state_change(streams,
    bytes)``: told of the streams' flow state (a gauge; :mod:`.stream_state`)."""
    from ...shapes import GRAPHS
    from .params import set_niceness
    from .triton_io import BlsGraph

    set_niceness(p["nice"])
    torch.set_num_threads(p["torch_threads"])
    sfx, timeout = p["stage_suffix"], p["bls_timeout_us"]  # task_isolation: the TTS task's own copies
    graphs = {g: BlsGraph(pb, g + sfx, g, timeout_us=timeout) for g in GRAPHS}
    flow, hift, speakers = stage_callables(pb, flow_model="flow" + sfx, hift_model="hift" + sfx,
                                           speakers_model=p["speakers_model"], timeout_us=timeout)
    return service_from_params(p, graphs, flow=flow, hift=hift, speakers=speakers, on_state_change=on_state_change)


def service_from_params(p: Mapping[str, Any], graphs: Mapping[str, GraphFn], *, flow: FlowFn | None = None,
                        hift: HiftFn | None = None, speakers: SpeakerFn | None = None,
                        on_state_change: Callable[[int, int], object] | None = None) -> TTSService:
    """The :class:`TTSService` of a TTS model's config parameters with these graphs, stages and speakers (the
    served model's by BLS: :func:`build_service`; in process: :class:`~.graphs.GraphRunner` s, None for the
    stages). The caller sets the torch threads (``torch_threads``)."""
    from .stream_state import build_incremental
    from .vc_stream import stream_schedule

    return TTSService(p["model_dir"], graphs, flow=flow, hift=hift, speakers=speakers,
                      max_active=p["max_active_requests"], max_waiting=p["max_waiting_requests"],
                      wait_timeout_s=p["wait_timeout_s"], max_text_chars=p["max_text_chars"],
                      max_digit_run=p["max_text_digit_run"], max_digits=p["max_text_digits"],
                      n_timesteps=p["n_timesteps"] or None, min_seconds=p["min_seconds"],
                      max_seconds=p["max_seconds"], output=p, lm_precision=p["lm_precision"],
                      stream_schedule=stream_schedule(p), lm_prefix_cache_mb=p["lm_prefix_cache_mb"],
                      incremental=build_incremental(p, p["model_dir"], ModelConfig.from_yaml(
                          Path(p["model_dir"]) / "cosyvoice2.yaml"), on_change=on_state_change),
                      prompt_cache=PromptCache.from_params(p["prompt_cache_entries"], p["prompt_cache_mb"]))
