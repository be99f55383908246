"""Live text to speech: the text arrives in pieces (as an LLM writes it), audio leaves as soon as the LM has its
speech tokens. What ``cosyvoice_tts_live`` serves, one session per stream (:class:`~.live.LiveSessions` with
``advance="arrival"``, ``on_idle="end"``).

A session is one :meth:`TTSService.live <.tts.TTSService.live>` over the stream's text pieces: the first request
sets the voice (``speaker_id``, or prompt audio + ``prompt_text``; ``mode`` / ``instruct_text`` as for
``cosyvoice_tts_stream``) and the seed, and every request (the first included) carries one piece of ``text``
(UTF-8 bytes; a character may be split between pieces: one incremental decoder per stream). The LM pulls the
pieces as it needs text and waits for the next one while it has none; a chunk goes on the sender of the newest
piece when it is computed (``text_pieces``: the pieces received then, the END request included), and after the END
the last sender carries the rest. Text that stops arriving for ``text_timeout_s`` ends the text with what it has:
the audio is finished on the last piece's sender. Bad text (invalid UTF-8, unknown tags, too long, only
whitespace) fails the session with INVALID_ARGUMENT on the newest piece's sender.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from ...errors import TextError
from ...shapes import TTS_INPUTS, TTS_OPTIONAL_INPUTS, TTS_STREAM_OUTPUTS, TensorSpec
from .vc_stream import StreamCancelled

__all__ = ["LIVE_TTS_INPUTS", "LIVE_TTS_MODEL", "LIVE_TTS_OUTPUTS", "live_tts_sessions", "serve_session"]

LIVE_TTS_MODEL = "cosyvoice_tts_live"
#: ``cosyvoice_tts_live`` (one request per text piece; the voice, mode and seed on the first)
LIVE_TTS_INPUTS: tuple[TensorSpec, ...] = (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS)
LIVE_TTS_OUTPUTS: tuple[TensorSpec, ...] = (*TTS_STREAM_OUTPUTS, TensorSpec("text_pieces", "int32", ("batch", 1)))
_FIRST_ONLY = tuple(t.name for t in TTS_OPTIONAL_INPUTS)


def _texts(ctx) -> Iterator[bytes]:
    """The text of each piece of a session (``ctx``: a :class:`~.live.LiveContext`), as bytes."""
    from .tts import bytes_input

    for k, (tensors, end) in enumerate(ctx.pieces()):
        if k:
            extra = [n for n in _FIRST_ONLY if tensors.get(n) is not None]
            if extra:
                raise TextError(f"{', '.join(extra)}: only the first piece of a live stream sets the voice")
        text = tensors.get("text")
        if text is None:
            if not end:
                raise TextError("text: missing; every piece but the last (END) carries text")
            continue
        yield bytes_input(text, "text", text=False)


def serve_session(tts, ctx, *, max_token_text_ratio: float) -> None:
    """Run one served session (``tts``: a :class:`~.tts.TTSService` or a CosyVoice3
    :class:`~.cosyvoice3.Cv3Service`; ``ctx``: a :class:`~.live.LiveContext`): see
    the module docstring. A cancelled stream (the client went away, the model unloads) stops the LM."""
    from .lm_engine import JobCancelled

    def cancelled() -> bool:
        return ctx.ended_by in ("cancelled", "closed") or ctx.cancelled()

    first: Mapping[str, np.ndarray | None] = {n: ctx.first.get(n) for n in _FIRST_ONLY}
    try:
        for out in tts.live(first, _texts(ctx), cancelled=cancelled, max_token_text_ratio=max_token_text_ratio):
            ctx.send(out, received_as="text_pieces")
    except JobCancelled as exc:
        raise StreamCancelled(str(exc)) from None


def live_tts_sessions(pb_utils, tts, p: Mapping, args: Mapping):
    """The :class:`~.live.LiveSessions` of a served live TTS model (``cosyvoice_tts_live``, ``cosyvoice3_tts_live``):
    each session runs :func:`serve_session` on ``tts`` (a service with a ``live`` method), with the model's
    parameters ``p`` (``max_sessions``, ``max_queued``, ``text_timeout_s``, ``max_token_text_ratio``) and Triton's
    ``initialize`` arguments ``args`` (its live-session gauge)."""
    from .live import LiveSessions, SessionGauge

    ratio = p["max_token_text_ratio"]
    return LiveSessions(pb_utils, lambda ctx: serve_session(tts, ctx, max_token_text_ratio=ratio),
                        [t.name for t in LIVE_TTS_INPUTS], max_sessions=p["max_sessions"],
                        max_queued=p["max_queued"], idle_timeout_s=p["text_timeout_s"], advance="arrival",
                        on_idle="end", name=args["model_name"],
                        on_change=SessionGauge(pb_utils, args["model_name"], args["model_version"]))
