"""The speech side of the official front end, shared by the CosyVoice2 and CosyVoice3 classes.

:class:`PromptFrontend` turns a prompt recording into what every mode needs (speech tokens at 16 kHz through the
speech tokenizer, the 24 kHz mel, the CAM++ embedding; :meth:`PromptFrontend.prompt_features`, cached by audio in
a :class:`~.prompt_cache.PromptCache`), a voice-conversion pair into :class:`VCInputs` (the official
``frontend_vc``), and a prompt with its transcript into a :class:`~.speakers.SpeakerPrompt` (``frontend_zero_shot``:
tokens and mel cut to a common length, marked with the class's ``family``). A class using it sets ``family``
(``"cosyvoice2"`` or ``"cosyvoice3"``: which registered speakers it may use), ``config`` (``mel``, ``sample_rate``),
``tokenizer``, ``speaker``, ``prompt_cache``, ``_prompt_options`` (:func:`prompt_options`), ``speakers``,
``flow`` (``token_mel_ratio``) and ``_text()`` (its text front end).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .errors import TextError
from .frontend import audio, features
from .prompt_cache import CacheEntry, file_identity, prompt_key
from .speakers import SpeakerPrompt


def prompt_options(tokenizer, speaker, mel, sample_rate: int) -> dict:
    """What a cached prompt entry depends on besides its audio: the tokenizer and CAM++ files, the mel settings."""
    return {"model": file_identity(tokenizer.path, speaker.path), "mel": repr(mel), "sample_rate": sample_rate}


@dataclass
class StageTimer:
    """Wall-clock seconds per named stage, summed over calls (``timer.seconds["flow.encoder"]``)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def each(self, items: Iterator, name: str) -> Iterator:
        """``items`` passed through, the time each ``next`` takes counted under ``name`` (a lazy producer's work);
        closed with this iterator (a consumer that stops early stops the producer now, not when it is collected)."""
        try:
            while True:
                with self.stage(name):
                    item = next(items, None)
                if item is None:
                    return
                yield item
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()


_NO_TIMER = StageTimer()


@dataclass
class VCInputs:
    """What the official ``frontend_vc`` hands to the model, for one utterance pair (numpy, no batch axis).

    source_tokens [Ts] int32 and prompt_tokens [Tp] int32 (25 Hz), prompt_mel [Tf, 80] float32 (50 Hz,
    24 kHz CosyVoice mel), embedding [192] float32 (CAM++ of the prompt).
    """

    source_tokens: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    embedding: np.ndarray


class PromptFrontend:
    """The prompt side of the front end (module docstring); a base of the model classes."""

    def frontend_vc(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                    timer: StageTimer = _NO_TIMER) -> VCInputs:
        """Official ``frontend_vc``. ``source``/``prompt``: a path, encoded bytes, or samples with ``*_sr``.
        The prompt's part comes from :attr:`prompt_cache` when the same recording was seen before."""
        with timer.stage("frontend"):
            src16 = audio.load_audio(source, target_sr=audio.TOKENIZER_SR, sample_rate=source_sr, name="source")
        entry = self.prompt_features(prompt, prompt_sr=prompt_sr, timer=timer)
        (source_tokens,) = self._tokenize([src16], timer)
        return VCInputs(source_tokens=source_tokens, prompt_tokens=np.array(entry["prompt_tokens"]),
                        prompt_mel=np.array(entry["prompt_mel"]), embedding=np.array(entry["embedding"]))

    def _tokenize(self, waves16: Sequence[np.ndarray], timer: StageTimer) -> list[np.ndarray]:
        with timer.stage("frontend"):
            whisper, whisper_len = features.whisper_log_mel_batch(list(waves16))
        with timer.stage("tokenizer"):
            return list(self.tokenizer.tokenize(whisper, whisper_len))

    def prompt_features(self, prompt, *, prompt_sr: int | None = None, timer: StageTimer = _NO_TIMER) -> CacheEntry:
        """What the front end, the tokenizer and CAM++ give for a prompt recording (read-only arrays):
        ``prompt_tokens`` [Tp] int32, ``prompt_mel`` [Tf, 80] float32 (24 kHz mel, not cut to the tokens),
        ``embedding`` [192] float32. From :attr:`prompt_cache` when this recording (same samples and rate) was
        seen before: then the resampling, the features, the tokenizer and CAM++ are skipped."""
        with timer.stage("frontend"):
            wave, sr = audio.decode_if_encoded(prompt, prompt_sr, name="prompt")
            wave = audio.validate_audio(wave, sample_rate=sr, name="prompt")
        key = None
        if self.prompt_cache is not None:
            key = prompt_key(wave, sr, kind="prompt_features", options=self._prompt_options)
            entry = self.prompt_cache.get(key)
            if entry is not None:
                return entry
        with timer.stage("frontend"):
            p16 = audio.resample(wave, orig_sr=sr, target_sr=audio.TOKENIZER_SR)
            p24 = audio.resample(wave, orig_sr=sr, target_sr=self.config.sample_rate)
            fbank, fbank_len = features.kaldi_fbank_batch([p16])
            mel = features.cosyvoice_mel(p24, sample_rate=self.config.sample_rate, config=self.config.mel)
        (tokens,) = self._tokenize([p16], timer)
        with timer.stage("speaker_embedding"):
            embedding = self.speaker.embed(fbank, fbank_len)[0]
        entry = {"prompt_tokens": np.asarray(tokens, np.int32), "prompt_mel": np.asarray(mel, np.float32),
                 "embedding": np.asarray(embedding, np.float32)}
        return entry if key is None else self.prompt_cache.put(key, entry)

    def prompt(self, prompt_audio, *, prompt_sr: int | None = None, prompt_text: str | bytes | None = None,
               timer: StageTimer = _NO_TIMER) -> SpeakerPrompt:
        """What the official ``frontend_zero_shot`` computes from a prompt: speech tokens, 24 kHz mel and CAM++
        embedding of the audio (tokens and mel cut to a common length, 2 mel frames per token), and the
        normalised transcript's text tokens when ``prompt_text`` is given."""
        entry = self.prompt_features(prompt_audio, prompt_sr=prompt_sr, timer=timer)
        tokens, mel, embedding = entry["prompt_tokens"], entry["prompt_mel"], entry["embedding"]
        with timer.stage("frontend"):
            text_tokens = np.zeros(0, np.int32)
            if prompt_text is not None:
                text_tokens = self._text().prompt_tokens(prompt_text).astype(np.int32)
        ratio = self.flow.token_mel_ratio
        n = min(len(mel) // ratio, len(tokens))
        return SpeakerPrompt(prompt_tokens=np.asarray(tokens[:n], np.int32), prompt_mel=mel[: ratio * n],
                             embedding=np.asarray(embedding, np.float32), prompt_text_tokens=text_tokens,
                             prompt_text="" if prompt_text is None else str(prompt_text), family=self.family)

    def register_speaker(self, speaker_id: str, prompt_audio, *, prompt_sr: int | None = None,
                         prompt_text: str | None = None) -> SpeakerPrompt:
        """Compute a prompt once and keep it under ``speaker_id`` (see :class:`~.speakers.SpeakerStore`)."""
        prompt = self.prompt(prompt_audio, prompt_sr=prompt_sr, prompt_text=prompt_text)
        self.speakers.put(speaker_id, prompt)
        return prompt

    def _speaker(self, prompt_audio, prompt_sr, prompt_text, speaker_id, timer: StageTimer) -> SpeakerPrompt:
        if prompt_audio is None and speaker_id is None:
            raise TextError("prompt text without prompt audio: give the prompt audio (or a registered speaker_id)"
                            if prompt_text is not None else
                            "a voice prompt is needed: prompt audio or a registered speaker_id")
        if prompt_audio is not None and speaker_id is not None:
            raise TextError("give prompt audio or a speaker_id, not both")
        if speaker_id is not None:
            if prompt_text is not None:
                raise TextError("prompt text belongs to prompt audio: register the speaker with its text instead")
            speaker = self.speakers.get(speaker_id, family=self.family)
        else:
            speaker = self.prompt(prompt_audio, prompt_sr=prompt_sr, prompt_text=prompt_text, timer=timer)
        return speaker
