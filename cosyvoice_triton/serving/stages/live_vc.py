"""Live voice conversion: the source arrives in pieces (a microphone, a call), converted audio leaves as soon as it
can be computed. What ``cosyvoice_vc_live`` serves, one :class:`LiveVCSession` per stream.

A session resamples each piece to 16 kHz with one soxr ``ResampleStream`` (state kept across pieces, flushed at
the end), and converts in chunks of ``chunk_tokens`` speech tokens (25 Hz: 640 samples at 16 kHz per token):

* **tokens**: the speech tokenizer was trained on whole utterances, so each chunk tokenizes a sliding window: up to
  ``tokenizer_context_tokens`` tokens of audio before the first new token, the new tokens, and
  ``tokenizer_lookahead_tokens`` tokens of audio after them; it keeps the new tokens only (committed: never
  recomputed). Windows start on a token boundary (a multiple of 640 samples, 4 Whisper frames), so window token
  ``i`` is the same 40 ms of audio as whole-utterance token ``start + i`` (the tokenizer's ``T -> ceil(T / 4)``
  frame alignment); only the window edges (reflect padding, the log-mel's max-8 floor, the model's context) differ.
* **flow and HiFT**: :class:`~.vc_stream.Token2WavState` (the official streaming machinery: chunk-causal flow with
  3 look-ahead tokens, HiFT's 8-frame mel / source caches and crossfade), fed a sliding window of at most
  ``flow_context_tokens`` source tokens before the chunk (the state stays bounded however long the stream is).
  The flow encoder's and estimator's chunk-causal masks use static chunks of 25 tokens (50 mel frames) counted from
  the first prompt token: a chunk that ends on such a boundary (prompt + chunk end a multiple of 25) leaves every
  earlier frame exactly as a longer input would compute it. So the first chunk is padded to that boundary (as the
  official schedule does), ``chunk_tokens`` should be a multiple of 25 (another value works; the frames before an
  unaligned end are then computed without the rest of their block), and the flow window starts on a multiple of 25
  source tokens. When the streamer keeps stream state (:mod:`.stream_state`, the served default), the window is
  cached instead of recomputed (:func:`~cosyvoice_triton.models.incremental.window_chunk`): each non-final chunk
  computes only its new frames, against the prompt's chunks and the window's keys kept from earlier chunks; the
  last chunk recomputes the window with the graphs, as without it. An unaligned chunk falls back to recomputing.

**Algorithmic latency** (audio that must have arrived before a piece of output can be answered; compute comes on
top): a chunk ending at token ``E`` runs once the audio of ``E + 3 + tokenizer_lookahead_tokens`` tokens has
arrived and the 16 kHz resampler has passed it on (soxr VHQ holds back a few ms); its audio ends 8 mel frames
(160 ms) before token ``E`` (HiFT's held-back tail, sent with the next chunk). The newest output sample therefore
lags the newest input by ``(3 + tokenizer_lookahead_tokens) * 40 ms + 160 ms`` at best, and the oldest sample of a
chunk waits ``chunk_tokens * 40 ms`` more: with the defaults (25, look-ahead 5) 0.48 s to 1.48 s. The first chunk is
longer by the prompt's padding (up to 24 tokens). The end of the stream (``finish``) flushes everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import soxr

from ...errors import AudioError, CosyVoiceError
from ...frontend import audio, features
from ...shapes import GRAPHS, MAX_LOOKAHEAD, TensorSpec
from ...streaming import TOKEN_HOP
from .batching import RequestError
from .vc_stream import STREAM_INPUTS, VC_STREAM_OUTPUTS, StreamCancelled, StreamPrompt, VCStreamer

__all__ = ["LIVE_VC_INPUTS", "LIVE_VC_MODEL", "LIVE_VC_OUTPUTS", "SAMPLES_PER_TOKEN", "LiveSession", "LiveSettings",
           "LiveVC", "LiveVCSession", "build_live", "convert_pieces", "live_vc_sessions", "serve_session"]

#: 16 kHz samples per speech token (25 Hz).
SAMPLES_PER_TOKEN = audio.TOKENIZER_SR // 25
_WHISPER_FRAMES_PER_TOKEN = SAMPLES_PER_TOKEN // features.WHISPER_HOP

LIVE_VC_MODEL = "cosyvoice_vc_live"
#: ``cosyvoice_vc_live`` (one request per source piece; the prompt / speaker and the source rate on the first)
LIVE_VC_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("source_audio", "float32", ("batch", "source_samples")),
    TensorSpec("source_sample_rate", "int32", ("batch", 1)),
    TensorSpec("prompt_audio", "float32", ("batch", "prompt_samples")),
    TensorSpec("prompt_sample_rate", "int32", ("batch", 1)),
    TensorSpec("prompt_audio_bytes", "bytes", ("batch", 1)),
    TensorSpec("speaker_id", "bytes", ("batch", 1)),
    TensorSpec("seed", "int64", ("batch", 1)),
)
LIVE_VC_OUTPUTS: tuple[TensorSpec, ...] = (*VC_STREAM_OUTPUTS, TensorSpec("source_seconds", "float32", ("batch", 1)))
_PROMPT_INPUTS = ("prompt_audio", "prompt_sample_rate", "prompt_audio_bytes", "speaker_id", "seed")


@dataclass(frozen=True)
class LiveSettings:
    """The tunables of live conversion (see the module docstring)."""

    chunk_tokens: int = 25
    tokenizer_context_tokens: int = 75
    tokenizer_lookahead_tokens: int = 5
    flow_context_tokens: int = 100
    #: longest accepted piece (a bigger one is refused: the client should send what it records as it records it)
    max_piece_seconds: float = 5.0

    def __post_init__(self):
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.tokenizer_context_tokens < 0 or self.tokenizer_lookahead_tokens < 0 or self.flow_context_tokens < 0:
            raise ValueError("tokenizer_context_tokens, tokenizer_lookahead_tokens and flow_context_tokens must be "
                             f">= 0, got {self}")
        if not 0 < self.max_piece_seconds <= 60:
            raise ValueError(f"max_piece_seconds must be in (0, 60], got {self.max_piece_seconds}")
        # the most new tokens of one chunk: the first one's padding, the look-ahead, and at the end the tail that
        # did not make a whole chunk
        new = self.chunk_tokens + TOKEN_HOP + MAX_LOOKAHEAD + self.tokenizer_lookahead_tokens
        window = self.tokenizer_context_tokens + new
        most = GRAPHS["speech_tokenizer"].axes["whisper_frames"].max // _WHISPER_FRAMES_PER_TOKEN
        if window > most:
            raise ValueError(f"tokenizer window of up to {window} tokens (context, chunk, padding, look-ahead) "
                             f"exceeds the tokenizer's {most}")
        flow_most = GRAPHS["flow_encoder"].axes["tokens"].max - 750  # beside a 30 s prompt's tokens
        flow = self.flow_context_tokens + TOKEN_HOP + new
        if flow > flow_most:
            raise ValueError(f"flow window of up to {flow} source tokens (context, chunk, padding, look-ahead) "
                             f"exceeds the {flow_most} left beside a 30 s prompt")

    @classmethod
    def from_params(cls, params: Mapping) -> LiveSettings:
        """The settings of a live model's config parameters (its tunables of the same names)."""
        return cls(**{f: params[f] for f in ("chunk_tokens", "tokenizer_context_tokens", "tokenizer_lookahead_tokens",
                                             "flow_context_tokens", "max_piece_seconds")})

    @property
    def latency_seconds(self) -> tuple[float, float]:
        """(best, worst) algorithmic latency of an output sample in seconds, after the first chunk."""
        best = (MAX_LOOKAHEAD + self.tokenizer_lookahead_tokens) * 0.04 + 0.16
        return best, best + self.chunk_tokens * 0.04


class LiveSession:
    """One live stream of either family: :meth:`feed` each piece as it arrives, :meth:`finish` at the end; both
    yield the converted chunks (float32 at :attr:`sample_rate`) that the audio received so far allows.

    The family comes in as three pieces: ``tokens(whisper_log_mel [128, T]) -> int32 tokens`` (its speech
    tokenizer), ``state`` (its token-to-wav over a window: ``step(tokens, offset, final=) -> float32 audio``,
    ``close()``), and ``post`` (the output's streaming post-processing: ``post(audio, last=) -> audio``).
    """

    def __init__(self, settings: LiveSettings, *, tokens: Callable[[np.ndarray], np.ndarray], state, post,
                 sample_rate: int, prompt_tokens: int, source_sample_rate: int):
        self.s, self.tokens_of, self.state, self.post = settings, tokens, state, post
        self.source_sample_rate = int(source_sample_rate)
        self.sample_rate = int(sample_rate)
        self.resampler = None
        if self.source_sample_rate != audio.TOKENIZER_SR:
            self.resampler = soxr.ResampleStream(self.source_sample_rate, audio.TOKENIZER_SR, 1, dtype="float32",
                                                 quality=audio.RESAMPLE_QUALITY)
        n_prompt = int(prompt_tokens)
        self.next_end = self.s.chunk_tokens + (-n_prompt % TOKEN_HOP)  # first chunk: prompt + end on a boundary
        self.done_end = 0  # source tokens whose audio has been answered
        self.received = 0  # source samples received (at the source rate)
        self.wave = np.zeros(0, np.float32)  # 16 kHz audio from sample wave_base on
        self.wave_base = 0
        self.tokens = np.zeros(0, np.int32)  # committed source tokens from token tokens_base on
        self.tokens_base = 0
        self.chunks = 0  # flow + HiFT steps
        self.emitted = 0  # responses numbered
        self.tokenizer_calls = 0
        self.ended = False

    # ------------------------------------------------------------------------------------------ public
    @property
    def received_seconds(self) -> float:
        return self.received / self.source_sample_rate

    @property
    def committed(self) -> int:
        return self.tokens_base + len(self.tokens)

    def feed(self, samples, *, cancelled: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Take one piece (mono float samples at the stream's rate); yield the chunks it completes."""
        self._take(samples, last=False)
        return self._run(final=False, cancelled=cancelled)

    def finish(self, samples=None, *, cancelled: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """The end of the source (with its last piece, if any): yield every chunk left, the last one flushed."""
        self._take(np.zeros(0, np.float32) if samples is None else samples, last=True)
        if self.tokens_base + len(self.tokens) == 0 and len(self.wave) + self.wave_base < 10 * features.WHISPER_HOP:
            raise AudioError(f"source_audio: {self.received_seconds:.3f} s received in all, too short for one "
                             "speech token")
        return self._run(final=True, cancelled=cancelled)

    # ------------------------------------------------------------------------------------------ steps
    def check_piece(self, samples, *, last: bool) -> np.ndarray:
        """The piece as mono float32, or an :class:`~cosyvoice_triton.errors.AudioError` naming what is wrong."""
        if self.ended:
            raise RequestError("source_audio: the stream has ended; no more pieces are taken")
        arr = np.asarray(samples)
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.ndim != 1:
            raise AudioError(f"source_audio: expected one mono piece [1, n], got shape {list(np.shape(samples))}")
        if arr.dtype.kind != "f":
            raise AudioError(f"source_audio: expected float samples in [-1, 1], got dtype {arr.dtype}")
        if arr.size == 0 and not last:
            raise AudioError("source_audio: an empty piece (0 samples); only the last piece (END) may be empty")
        most = int(self.s.max_piece_seconds * self.source_sample_rate)
        if arr.size > most:
            raise AudioError(f"source_audio: a piece of {arr.size / self.source_sample_rate:.2f} s is longer than "
                             f"the {self.s.max_piece_seconds:g} s accepted per piece; send the audio as it is "
                             "recorded, in smaller pieces")
        if not np.isfinite(arr).all():
            raise AudioError("source_audio: NaN/Inf samples; audio must be finite")
        return np.ascontiguousarray(arr, np.float32)

    def _take(self, samples, *, last: bool) -> None:
        piece = self.check_piece(samples, last=last)
        self.received += piece.size
        y = piece if self.resampler is None else self.resampler.resample_chunk(piece, last=last)
        self.wave = np.concatenate([self.wave, np.asarray(y, np.float32)])
        if last:
            self.ended = True

    def _run(self, *, final: bool, cancelled) -> Iterator[np.ndarray]:
        s = self.s
        lookahead = MAX_LOOKAHEAD
        while self._available_tokens() >= self.next_end + lookahead + s.tokenizer_lookahead_tokens:
            self._check(cancelled)
            self._commit(self.next_end + lookahead)
            yield from self._chunk(final=False)
        if final:
            self._check(cancelled)
            self._commit(None)
            yield from self._chunk(final=True)

    @staticmethod
    def _check(cancelled) -> None:
        if cancelled is not None and cancelled():
            raise StreamCancelled("the client cancelled the stream")

    def _available_tokens(self) -> int:
        """Whole tokens of 16 kHz audio received."""
        return (self.wave_base + len(self.wave)) // SAMPLES_PER_TOKEN

    def _commit(self, upto: int | None) -> None:
        """Tokenize the window around tokens ``committed .. upto`` (None: to the end of the audio) and keep those."""
        s, start = self.s, self.committed
        if upto is not None and upto <= start:
            return
        first = max(0, start - s.tokenizer_context_tokens)
        lo = first * SAMPLES_PER_TOKEN - self.wave_base
        hi = None if upto is None else (upto + s.tokenizer_lookahead_tokens) * SAMPLES_PER_TOKEN - self.wave_base
        window = self.wave[lo:hi]
        if len(window) >= 10 * features.WHISPER_HOP:  # the tokenizer's shortest input (10 frames)
            whisper, n = features.whisper_log_mel_batch([window])
            got = self.tokens_of(np.ascontiguousarray(whisper[0, :, : int(n[0])]))
            self.tokenizer_calls += 1
            new = got[start - first: None if upto is None else upto - first]
        else:  # the end of a stream whose tail is shorter than the tokenizer takes: nothing more to commit
            new = np.zeros(0, np.int32)
        self.tokens = np.concatenate([self.tokens, np.asarray(new, np.int32)])
        # what later windows need: audio from (committed - context) tokens on
        keep = max(0, self.committed - s.tokenizer_context_tokens) * SAMPLES_PER_TOKEN
        if keep > self.wave_base:
            self.wave = self.wave[keep - self.wave_base:]
            self.wave_base = keep

    def _chunk(self, *, final: bool) -> Iterator[np.ndarray]:
        s = self.s
        start = max(0, (self.done_end - s.flow_context_tokens) // TOKEN_HOP * TOKEN_HOP)  # on a 25-token boundary
        lo = start - self.tokens_base
        if final:  # every committed token; at least the 3 look-ahead tokens of the last chunk are new
            tokens, end = self.tokens[lo:], self.committed
        else:
            end = self.next_end
            tokens = self.tokens[lo: end + MAX_LOOKAHEAD - self.tokens_base]
        speech = self.state.step(tokens, self.done_end - start, final=final)
        out = self.post(speech, last=final)
        self.done_end, self.next_end = end, end + s.chunk_tokens
        keep = max(0, (self.done_end - s.flow_context_tokens) // TOKEN_HOP * TOKEN_HOP)  # the next flow window's
        if keep > self.tokens_base:
            self.tokens = self.tokens[keep - self.tokens_base:]
            self.tokens_base = keep
        self.chunks += 1
        if out.size:
            yield out

    def close(self) -> None:
        """Free the session's flow state (idempotent; the end of the stream frees it too)."""
        self.state.close()

    def tensors(self, chunk: np.ndarray) -> dict[str, np.ndarray]:
        """One response's outputs (batch 1); numbers the chunks of the session 0, 1, 2, ..."""
        index, self.emitted = self.emitted, self.emitted + 1
        return {"waveform": np.ascontiguousarray(chunk, np.float32)[None],
                "sample_rate": np.array([[self.sample_rate]], np.int32),
                "chunk_index": np.array([[index]], np.int32),
                "source_seconds": np.array([[self.received_seconds]], np.float32)}


class LiveVCSession(LiveSession):
    """A CosyVoice2 live stream over a :class:`LiveVC`'s streamer: HiFT's caches and the flow window of
    :class:`~.vc_stream.Token2WavState` (cached when the streamer keeps stream state: models/incremental.py
    ``window_chunk``)."""

    def __init__(self, live: LiveVC, prompt: StreamPrompt, source_sample_rate: int, *, seed: int = 0):
        self.live, self.prompt = live, prompt
        state = live.streamer.token2wav.open(prompt, seed=seed, incremental=True,
                                             window_tokens=live.settings.flow_context_tokens)
        super().__init__(live.settings, tokens=live.streamer.tokens, state=state, post=live.streamer.post.stream(),
                         sample_rate=live.sample_rate, prompt_tokens=len(prompt.prompt_tokens),
                         source_sample_rate=source_sample_rate)


class LiveVC:
    """Live conversion over the graphs of a :class:`~.vc_stream.VCStreamer` (its front end, prompt handling, speaker
    store, token-to-wav and output options)."""

    def __init__(self, streamer: VCStreamer, settings: LiveSettings | None = None):
        self.streamer = streamer
        self.settings = settings or LiveSettings()
        self.sample_rate = streamer.sample_rate

    def open(self, tensors: Mapping[str, np.ndarray | None], parameters: Mapping | None = None) -> LiveSession:
        """A session from the first request's tensors: ``source_sample_rate`` and the prompt (``prompt_audio`` +
        ``prompt_sample_rate``, ``prompt_audio_bytes`` or ``speaker_id``), optional ``seed``."""
        sr = self.first_rate(tensors)
        t = {k: tensors.get(k) for k in STREAM_INPUTS}
        prompt = self.streamer.request_prompt(t)
        return LiveVCSession(self, prompt, sr, seed=self.streamer.request_seed(t, parameters))

    @classmethod
    def first_rate(cls, tensors: Mapping[str, np.ndarray | None]) -> int:
        """The first piece's ``source_sample_rate`` (required there)."""
        rate = tensors.get("source_sample_rate")
        if rate is None:
            raise RequestError("source_sample_rate: required on the first piece of a live stream")
        return cls.source_rate(rate)

    @staticmethod
    def source_rate(x) -> int:
        arr = np.asarray(x)
        if arr.size != 1 or arr.dtype.kind not in "iu":
            raise AudioError(f"source_sample_rate: expected one integer [1, 1], got {arr.dtype} of shape "
                             f"{list(arr.shape)}")
        return audio.validate_sample_rate(int(arr.reshape(())), name="source_sample_rate")

    def piece(self, session: LiveSession, tensors: Mapping[str, np.ndarray | None], *, first: bool, last: bool,
              cancelled: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """One request of a live stream: its checks, then the session's chunks (see :meth:`LiveVCSession.feed`)."""
        if not first:
            extra = [n for n in _PROMPT_INPUTS if tensors.get(n) is not None]
            if extra:
                raise RequestError(f"{', '.join(extra)}: only the first piece of a live stream sets the prompt")
        rate = tensors.get("source_sample_rate")
        if rate is not None and self.source_rate(rate) != session.source_sample_rate:
            raise AudioError(f"source_sample_rate: this piece says {self.source_rate(rate)} Hz but the stream "
                             f"started at {session.source_sample_rate} Hz; one stream has one rate")
        samples = tensors.get("source_audio")
        if samples is None:
            if not last:
                raise RequestError("source_audio: missing; every piece but the last (END) carries audio")
            samples = np.zeros((1, 0), np.float32)
        if last:
            return session.finish(samples, cancelled=cancelled)
        return session.feed(samples, cancelled=cancelled)

    def responses(self, session: LiveSession, tensors: Mapping[str, np.ndarray | None], *, first: bool,
                  last: bool, cancelled: Callable[[], bool] | None = None) -> Iterator[dict[str, np.ndarray]]:
        """:meth:`piece` as the response tensors of each chunk."""
        for chunk in self.piece(session, tensors, first=first, last=last, cancelled=cancelled):
            yield session.tensors(chunk)


def convert_pieces(live: LiveVC, tensors: Mapping[str, np.ndarray | None], pieces, *,
                   cancelled: Callable[[], bool] | None = None) -> list[np.ndarray]:
    """In process: one session over ``pieces`` (arrays of samples at the first request's rate; the last one
    ends the stream), every chunk in order. What the served model answers for the same pieces."""
    pieces = list(pieces)
    if not pieces:
        raise CosyVoiceError("convert_pieces: no pieces")
    session = live.open(tensors)
    out = []
    try:
        for i, p in enumerate(pieces):
            last = i == len(pieces) - 1
            out.extend(live.piece(session, {"source_audio": np.asarray(p, np.float32)[None]}, first=i == 0,
                                  last=last, cancelled=cancelled))
    finally:
        session.close()
    return out


def serve_session(live: LiveVC, ctx) -> None:
    """Run one served session (``ctx``: a :class:`~.live.LiveContext`): the first piece opens it (a bad prompt or
    rate fails the session), each piece's chunks go on its sender; a bad piece is refused alone (the session goes
    on, its state untouched), the END piece flushes the tail. A session freed for idleness answers nothing more."""
    session = None
    try:
        for tensors, end in ctx.pieces():
            first = session is None
            if first:
                session = live.open(tensors, ctx.parameters)
            try:
                for out in live.responses(session, tensors, first=first, last=end, cancelled=ctx.cancelled):
                    ctx.send(out)
            except (AudioError, RequestError) as exc:
                ctx.reject(exc)
    finally:  # ended, cancelled, idle, failed: the flow state goes now
        if session is not None:
            session.close()


def live_vc_sessions(pb_utils, live: LiveVC, p: Mapping, args: Mapping):
    """The :class:`~.live.LiveSessions` of a served live VC model (``cosyvoice_vc_live``, ``cosyvoice3_vc_live``):
    each session runs :func:`serve_session` on ``live``, with the model's parameters ``p`` (``max_sessions``,
    ``max_queued``, ``idle_timeout_s``) and Triton's ``initialize`` arguments ``args`` (its live-session gauge)."""
    from .live import LiveSessions, SessionGauge

    return LiveSessions(pb_utils, lambda ctx: serve_session(live, ctx), [t.name for t in LIVE_VC_INPUTS],
                        max_sessions=p["max_sessions"], max_queued=p["max_queued"],
                        idle_timeout_s=p["idle_timeout_s"], advance="pull", on_idle="close", name=args["model_name"],
                        on_change=SessionGauge(pb_utils, args["model_name"], args["model_version"]))


def build_live(params: Mapping, graph_fn, speakers, *, on_state_change=None) -> LiveVC:
    """The live converter of a ``cosyvoice_vc_live`` model from its config parameters
    (``MODEL_PARAMS["cosyvoice_vc_live"]``); ``graph_fn(model, graph)`` and ``on_state_change`` as in
    :func:`.vc_stream.build_streamer`."""
    from .vc_stream import build_streamer

    return LiveVC(build_streamer(params, graph_fn, speakers, on_state_change=on_state_change),
                  LiveSettings.from_params(params))
