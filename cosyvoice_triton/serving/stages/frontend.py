"""``preprocess``: decode (when sent as file bytes) and validate the two utterances, resample them, and
compute the features of every graph.

Exactly what :meth:`CosyVoice2.frontend_vc <cosyvoice_triton.pipeline.CosyVoice2.frontend_vc>` computes before
its ONNX calls, per request: the source at 16 kHz (Whisper 128-bin log-mel for the tokenizer), the prompt
validated once and resampled to 16 kHz (Whisper log-mel; Kaldi fbank, mean-normalised as CAM++ wants) and to
24 kHz (the CosyVoice mel the flow is conditioned on). With a :class:`~cosyvoice_triton.prompt_cache.PromptCache`, a
prompt recording seen before (same samples, rate and options) gets its features from the cache: resampling,
VAD, denoising and the three feature extractions are skipped. Bad audio raises
:class:`~cosyvoice_triton.errors.AudioError` whose message starts with the tensor's name (``source_audio``,
``prompt_sample_rate``...), which the server answers with HTTP 400 / gRPC INVALID_ARGUMENT.

A request that asks for the outputs of one utterance only (:func:`utterances_for`: the ``speech_tokens`` ensemble
asks for the source's Whisper log-mel, ``speaker_embedding`` for the prompt's fbank) needs and gets only that one:
the other is neither required nor computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...config import MelConfig
from ...errors import AudioError
from ...frontend import audio, features
from ...prompt_cache import PromptCache, prompt_key
from ...shapes import VC_UTTERANCE_INPUTS
from .batching import ItemResult, run_per_item

__all__ = ["UTTERANCES", "UTTERANCE_OUTPUTS", "FrontendFeatures", "Preprocessor", "utterances_for"]

#: The ``preprocess`` outputs that each utterance gives.
UTTERANCE_OUTPUTS: Mapping[str, tuple[str, ...]] = {
    "source": ("source_whisper_mel", "source_whisper_mel_len"),
    "prompt": ("prompt_whisper_mel", "prompt_whisper_mel_len", "prompt_fbank", "prompt_mel"),
}
UTTERANCES = tuple(UTTERANCE_OUTPUTS)


def utterances_for(outputs: Iterable[str] | None) -> tuple[str, ...]:
    """The utterances (``source``, ``prompt``) a request needs for the ``preprocess`` outputs it asks for (an
    ensemble step asks for the outputs its ``output_map`` names); ``None`` or none of them: both."""
    if outputs is None:
        return UTTERANCES
    asked = set(outputs)
    need = tuple(u for u, names in UTTERANCE_OUTPUTS.items() if asked & set(names))
    return need or UTTERANCES


@dataclass
class FrontendFeatures:
    """One request's features, without batch axis (the adapter adds it); an utterance the request did not ask
    for has ``None``."""

    source_whisper_mel: np.ndarray | None = None  # [128, Ts] float32
    prompt_whisper_mel: np.ndarray | None = None  # [128, Tp] float32
    prompt_fbank: np.ndarray | None = None  # [Tf, 80] float32, mean over time subtracted
    prompt_mel: np.ndarray | None = None  # [Tm, 80] float32 (24 kHz CosyVoice mel)

    def tensors(self) -> dict[str, np.ndarray]:
        """The ``preprocess`` outputs of :data:`~cosyvoice_triton.shapes.STAGES` that were computed, with batch
        axis 1."""
        out = {}
        if self.source_whisper_mel is not None:
            out["source_whisper_mel"] = self.source_whisper_mel[None]
            out["source_whisper_mel_len"] = np.array([[self.source_whisper_mel.shape[1]]], np.int32)
        if self.prompt_whisper_mel is not None:
            out.update({
                "prompt_whisper_mel": self.prompt_whisper_mel[None],
                "prompt_whisper_mel_len": np.array([[self.prompt_whisper_mel.shape[1]]], np.int32),
                "prompt_fbank": self.prompt_fbank[None],
                "prompt_mel": self.prompt_mel[None],
            })
        return out


def _scalar_rate(x, name: str):
    """A ``[1, 1]`` (or ``[1]``, or scalar) sample-rate tensor -> the number, checked by the audio module."""
    arr = np.asarray(x)
    if arr.size != 1:
        raise AudioError(f"{name}: expected one sample rate per utterance, got shape {list(arr.shape)}")
    if arr.dtype.kind not in "iuf":
        raise AudioError(f"{name}: sample rate must be a number of Hz, got dtype {arr.dtype}")
    return arr.reshape(()).item()


def _encoded(x, name: str) -> bytes:
    """A ``[1, 1]`` BYTES tensor (numpy object array) or bytes -> the file's bytes."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    arr = np.asarray(x, dtype=object)
    if arr.size != 1:
        raise AudioError(f"{name}: expected one encoded file per request, got shape {list(arr.shape)}")
    item = arr.reshape(-1)[0]
    if not isinstance(item, (bytes, bytearray)):
        raise AudioError(f"{name}: expected the bytes of a wav/flac/ogg file, got {type(item).__name__}")
    return bytes(item)


def _samples(x, name: str) -> np.ndarray:
    """A ``[1, N]`` request tensor (batch 1) or ``[N]`` -> ``[N]``."""
    arr = np.asarray(x)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise AudioError(f"{name}: expected one mono waveform [1, N] per request, got shape {list(arr.shape)}")
    return arr


class Preprocessor:
    """The front end of the served pipeline.

    Args:
        mel: the model's mel settings (``ModelConfig.mel``).
        sample_rate: the model's output / prompt-mel rate (``ModelConfig.sample_rate``, 24 kHz).
        min_seconds, max_seconds: accepted duration of each utterance (the tokenizer's limit is 30 s).
        vad_trim: cut non-speech at both ends of source and prompt (Silero VAD, :mod:`.enhance`).
        denoise_prompt: stationary spectral gating of the prompt (:func:`.enhance.spectral_gate`).
        prompt_cache: keeps the features of prompts seen before (``None``: none); :func:`.speakers.compute_prompt`
            keeps whole prompts (tokens, mel, embedding) in it too.
        model_id: what identifies the model in the cache keys (the model folder, the graphs' models), so that a
            cache shared between models never mixes them.
    """

    def __init__(self, mel: MelConfig, *, sample_rate: int = audio.MEL_SR, min_seconds: float = audio.MIN_SECONDS,
                 max_seconds: float = audio.MAX_SECONDS, vad_trim: bool = False, denoise_prompt: bool = False,
                 prompt_cache: PromptCache | None = None, model_id: str = ""):
        if not 0 < min_seconds <= max_seconds <= audio.MAX_SECONDS:
            raise ValueError(f"need 0 < min_seconds <= max_seconds <= {audio.MAX_SECONDS:g}, got "
                             f"{min_seconds}, {max_seconds}")
        self.mel, self.sample_rate = mel, int(sample_rate)
        self.min_seconds, self.max_seconds = float(min_seconds), float(max_seconds)
        self.vad = None
        if vad_trim:
            from .enhance import VadTrimmer

            self.vad = VadTrimmer()
        self.denoise_prompt = bool(denoise_prompt)
        self.prompt_cache = prompt_cache
        #: everything besides the audio that changes a prompt's features (the cache keys hash it)
        self.options = {"model": str(model_id), "mel": repr(mel), "sample_rate": self.sample_rate,
                        "min_seconds": self.min_seconds, "max_seconds": self.max_seconds, "vad_trim": vad_trim,
                        "denoise_prompt": self.denoise_prompt}
        features.mel_basis(mel)  # build the filter banks now, not in the first request
        features.whisper_mel_filters(128)

    def _utterance(self, which: str, samples, rate, encoded) -> tuple[np.ndarray, int]:
        """One utterance from samples + rate or from encoded bytes: (validated mono float32, its rate)."""
        a, r, b = VC_UTTERANCE_INPUTS[which]
        limits = {"min_seconds": self.min_seconds, "max_seconds": self.max_seconds}
        if encoded is not None:
            given = [n for n, v in ((a, samples), (r, rate)) if v is not None]
            if given:
                raise AudioError(f"{which}: send either {a} with {r}, or {b}; got {b} and {', '.join(given)}")
            y, sr = audio.decode_audio(_encoded(encoded, b), name=b, max_seconds=self.max_seconds)
            return audio.validate_audio(y, sample_rate=sr, name=b, **limits), sr
        missing = [n for n, v in ((a, samples), (r, rate)) if v is None]
        if missing:
            raise AudioError(f"{which}: missing input {' and '.join(missing)}: send {a} with {r}, or {b}")
        sr = audio.validate_sample_rate(_scalar_rate(rate, r), name=r)
        return audio.validate_audio(_samples(samples, a), sample_rate=sr, name=a, **limits), sr

    def one(self, source_audio=None, source_sample_rate=None, prompt_audio=None, prompt_sample_rate=None, *,
            source_audio_bytes=None, prompt_audio_bytes=None, need: Iterable[str] = UTTERANCES) -> FrontendFeatures:
        """Features of one request from its tensors (``[1, N]`` float audio with ``[1, 1]`` rates, or ``[1, 1]``
        encoded files); ``need``: the utterances to validate and compute (:func:`utterances_for`), the other is
        ignored."""
        need = set(need)
        unknown = need - set(UTTERANCES)
        if unknown or not need:
            raise ValueError(f"need: some of {UTTERANCES}, got {sorted(need)}")
        limits = {"min_seconds": self.min_seconds, "max_seconds": self.max_seconds}
        src = None
        if "source" in need:
            src, src_sr = self._utterance("source", source_audio, source_sample_rate, source_audio_bytes)
        if "prompt" in need:
            prompt, p_sr = self._utterance("prompt", prompt_audio, prompt_sample_rate, prompt_audio_bytes)
        if src is not None and self.vad is not None:  # optional clean-up (off by default), then the limits again
            src = audio.validate_audio(self.vad.trim(src, src_sr, name="source_audio"), sample_rate=src_sr,
                                       name="source_audio (speech found by VAD)", **limits)
        if "prompt" not in need:
            return FrontendFeatures(source_whisper_mel=self.source_features(src, src_sr))
        key = None
        if self.prompt_cache is not None:
            key = prompt_key(prompt, p_sr, kind="prompt_front_end", options=self.options)
            entry = self.prompt_cache.get(key)
        if key is None or entry is None:
            entry = dict(zip(("prompt_whisper_mel", "prompt_fbank", "prompt_mel"),
                             self.prompt_features(self._clean_prompt(prompt, p_sr), p_sr), strict=True))
            if key is not None:
                entry = self.prompt_cache.put(key, entry)
        return FrontendFeatures(source_whisper_mel=None if src is None else self.source_features(src, src_sr),
                                **entry)

    def _clean_prompt(self, prompt: np.ndarray, sr: int) -> np.ndarray:
        """The optional clean-up of a validated prompt (VAD trim, denoising), then the length limits again."""
        limits = {"min_seconds": self.min_seconds, "max_seconds": self.max_seconds}
        if self.vad is not None:
            prompt = audio.validate_audio(self.vad.trim(prompt, sr, name="prompt_audio"), sample_rate=sr,
                                          name="prompt_audio (speech found by VAD)", **limits)
        if self.denoise_prompt:
            from .enhance import spectral_gate

            prompt = audio.validate_audio(spectral_gate(prompt, sr), sample_rate=sr,
                                          name="prompt_audio (denoised)", **limits)
        return prompt

    def utterance(self, which: str, samples=None, rate=None, encoded=None) -> tuple[np.ndarray, int]:
        """One utterance (``which``: source or prompt) from its request tensors, validated: (mono float32, rate)."""
        return self._utterance(which, samples, rate, encoded)

    def source_features(self, wave: np.ndarray, sample_rate: int) -> np.ndarray:
        """Whisper log-mel ``[128, T]`` of a validated source (16 kHz)."""
        whisper, n = features.whisper_log_mel_batch([audio.resample(wave, orig_sr=sample_rate,
                                                                    target_sr=audio.TOKENIZER_SR)])
        return np.ascontiguousarray(whisper[0, :, : int(n[0])])

    def prompt_features(self, wave: np.ndarray, sample_rate: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whisper log-mel ``[128, T]``, mean-normalised Kaldi fbank ``[Tf, 80]`` and 24 kHz mel ``[Tm, 80]`` of a
        validated prompt. The fbank's mean is subtracted here and once more by ``SpeakerEncoder.embed`` in process
        (harmless, but it rounds): done the same way for parity."""
        p16 = audio.resample(wave, orig_sr=sample_rate, target_sr=audio.TOKENIZER_SR)
        p24 = audio.resample(wave, orig_sr=sample_rate, target_sr=self.sample_rate)
        whisper, n = features.whisper_log_mel_batch([p16])
        fbank, fbank_len = features.kaldi_fbank_batch([p16])
        fbank = fbank[0, : int(fbank_len[0])]
        fbank = fbank - fbank.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32)
        mel = features.cosyvoice_mel(p24, sample_rate=self.sample_rate, config=self.mel)
        if mel.shape[0] < 1:
            raise AudioError("prompt_audio: too short for one mel frame")
        return (np.ascontiguousarray(whisper[0, :, : int(n[0])]), np.ascontiguousarray(fbank, dtype=np.float32),
                np.ascontiguousarray(mel, dtype=np.float32))

    def batch(self, requests: Sequence[Mapping[str, np.ndarray | None]],
              needs: Sequence[Iterable[str]] | None = None) -> list[ItemResult[FrontendFeatures]]:
        """Each request: its input tensors by name (absent ones None); ``needs``: per request, the utterances it
        needs (:func:`utterances_for` of the outputs it asks for; default both). A bad request fails alone."""
        names = [n for group in VC_UTTERANCE_INPUTS.values() for n in group]
        needs = list(needs) if needs is not None else [UTTERANCES] * len(requests)
        if len(needs) != len(requests):
            raise ValueError(f"batch: {len(requests)} requests but {len(needs)} needs")
        items = [(req, need) for req, need in zip(requests, needs, strict=True)]
        return run_per_item(items, lambda item: self.one(**{n: item[0].get(n) for n in names}, need=item[1]))
