"""Live voice conversion of CosyVoice3 (``cosyvoice3_vc_live``): the source in pieces, converted chunks out as soon as
they can be computed, over a :class:`~.cosyvoice3.Cv3Service`.

The session is CosyVoice2's (:class:`~.live_vc.LiveSession`: soxr resampling across pieces, tokenizer windows
aligned with the whole utterance's tokens, chunks of ``chunk_tokens`` on the flow's 25-token blocks, the same
tunables and algorithmic latency) with CosyVoice3's pieces: ``speech_tokenizer_v3`` for the windows and
:class:`~cosyvoice_triton.models.cosyvoice3.window.Token2Wav3Window` for the audio (the DiT flow on the prompt and
the last ``flow_context_tokens`` source tokens, the causal vocoder on a bounded window whose samples equal the
whole-stream call's). Memory and time per chunk stay bounded however long the session runs.

The prompt is the first piece's ``prompt_audio`` + ``prompt_sample_rate``, ``prompt_audio_bytes`` (the official
``frontend_vc`` features) or a ``speaker_id`` registered with ``cosyvoice3_speakers``. ``seed`` is refused: the
vocoder's noise is CosyVoice3's fixed buffer. Each piece holds the instance while it is converted (one piece of
one session at a time per instance, sessions interleave between pieces); a piece that waits longer than the
service's ``wait_timeout_s`` is refused (UNAVAILABLE).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from ...models.cosyvoice3.window import Token2Wav3Window
from ...shapes import CV3_VC_LIVE_MODEL
from ...speakers import SpeakerPrompt
from .batching import RequestError
from .cosyvoice3 import Cv3Service
from .live_vc import LiveSession, LiveSettings, LiveVC
from .tts import registered_voice

__all__ = ["CV3_VC_LIVE_MODEL", "Cv3LiveVC", "build_cv3_live"]


class Cv3LiveVC(LiveVC):
    """Live conversion over a CosyVoice3 :class:`~.cosyvoice3.Cv3Service` (module docstring); the pieces' checks,
    :meth:`piece` and :meth:`responses` are :class:`~.live_vc.LiveVC`'s."""

    def __init__(self, service: Cv3Service, settings: LiveSettings | None = None):
        self.service = service
        self.settings = settings or LiveSettings()
        self.sample_rate = service.sample_rate

    def prompt(self, t: Mapping[str, np.ndarray | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt tokens, prompt mel, embedding) of the first piece's voice."""
        _, speaker = registered_voice(t, None, self.service.speakers, speakers_name="CosyVoice3 speakers model")
        if speaker is not None:
            return _speaker_prompt(speaker)
        wave, sr = self.service.pre.utterance("prompt", t.get("prompt_audio"), t.get("prompt_sample_rate"),
                                              t.get("prompt_audio_bytes"))
        with self.service._held():
            entry = self.service.model.prompt_features(wave, prompt_sr=sr)
        return np.array(entry["prompt_tokens"]), np.array(entry["prompt_mel"]), np.array(entry["embedding"])

    def open(self, tensors: Mapping[str, np.ndarray | None], parameters: Mapping | None = None) -> LiveSession:
        """A session from the first piece's tensors: ``source_sample_rate`` and the voice (module docstring)."""
        sr = self.first_rate(tensors)
        if tensors.get("seed") is not None:
            raise RequestError("seed: CosyVoice3's vocoder noise is the checkpoint's fixed buffer, there is nothing "
                               "to seed (leave seed out)")
        tokens, mel, embedding = self.prompt(tensors)
        state = Token2Wav3Window(self.service.model.token2wav_model, tokens, mel, embedding)
        return LiveSession(self.settings, tokens=self._tokens, state=state, post=self.service.post.stream(),
                           sample_rate=self.sample_rate, prompt_tokens=len(tokens), source_sample_rate=sr)

    def _tokens(self, whisper: np.ndarray) -> np.ndarray:
        return self.service.model.tokenizer.tokenize(whisper[None])[0]

    def piece(self, session: LiveSession, tensors: Mapping[str, np.ndarray | None], *, first: bool, last: bool,
              cancelled: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """:meth:`LiveVC.piece` holding the instance while the piece is converted."""
        chunks = super().piece(session, tensors, first=first, last=last, cancelled=cancelled)
        with self.service._held():
            yield from chunks


def _speaker_prompt(speaker: SpeakerPrompt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array(speaker.prompt_tokens), np.array(speaker.prompt_mel), np.array(speaker.embedding)


def build_cv3_live(service: Cv3Service, params: Mapping) -> Cv3LiveVC:
    """The live converter of a ``cosyvoice3_vc_live`` model from its config parameters (the live tunables of
    ``cosyvoice_vc_live``)."""
    return Cv3LiveVC(service, LiveSettings.from_params(params))
