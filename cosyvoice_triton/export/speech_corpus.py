"""Real speech on demand: espeak-ng utterances in several languages, voices, speeds and lengths.

INT8 calibration and the quality report need speech that the project may not ship in bulk. This module
stores the *recipe* (texts, voices, prosody), not the audio: :func:`utterances` synthesises a deterministic,
split-aware list with libespeak-ng from the ``espeakng-loader`` wheel (a dependency: no system package needed;
the ``espeak-ng`` command is the fallback). The ``calibration`` and
``heldout`` splits never share a sentence, so quality is measured on speech the calibrator never heard.
"""

from __future__ import annotations

import importlib.util
import io
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from ..errors import CosyVoiceError

# Our own sentences; plain content in the languages CosyVoice2 serves plus a few espeak speaks well.
TEXTS: dict[str, tuple[str, ...]] = {
    "en": (
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "Please call me back when you have finished reading the report.",
        "We measured the latency of every stage before changing anything.",
        "A cup of tea in the morning makes the whole day feel calmer.",
        "The train to the airport leaves every twenty minutes from platform four.",
        "Could you tell me how far it is to the nearest pharmacy?",
        "Numbers like three hundred and forty two are read out in full.",
        "She sells sea shells by the sea shore on sunny afternoons.",
        "Thank you for waiting; your call is important to us.",
        "The weather will turn colder later this week, with rain on Thursday.",
        "Open the window, then turn off the lights, and close the door quietly.",
        "Voice conversion keeps the words and changes who seems to speak them.",
    ),
    "fr": (
        "Le petit chat dort sur le canapé depuis ce matin.",
        "Nous partirons demain à huit heures pour éviter les embouteillages.",
        "Pouvez-vous répéter la question plus lentement, s'il vous plaît?",
    ),
    "de": (
        "Heute Abend gehen wir ins Kino und danach essen wir Pizza.",
        "Der Zug hat leider zehn Minuten Verspätung.",
        "Bitte schließen Sie die Tür, wenn Sie den Raum verlassen.",
    ),
    "es": (
        "Mañana vamos a visitar a mis abuelos en el campo.",
        "¿Sabes dónde está la estación de autobuses más cercana?",
        "El concierto empieza a las nueve de la noche.",
    ),
    "cmn": (
        "今天天气很好，我们去公园散步吧。",
        "请问去火车站怎么走？",
        "这个问题我们明天再讨论。",
    ),
    "ja": ("今日はとても良い天気ですね。", "駅までどのくらいかかりますか。"),
    "ko": ("오늘 날씨가 정말 좋네요.", "내일 다시 연락드리겠습니다."),
}
VOICES: dict[str, tuple[str, ...]] = {
    "en": ("en-us", "en-gb-x-rp", "en-us+f3", "en-us+m3", "en-gb-x-rp+f2", "en-us+f4"),
    "fr": ("fr-fr", "fr-fr+f2"),
    "de": ("de", "de+f3"),
    "es": ("es", "es+f4"),
    "cmn": ("cmn", "cmn+f2"),
    "ja": ("ja",),
    "ko": ("ko",),
}
SPLITS = ("calibration", "heldout")


@dataclass(frozen=True)
class Utterance:
    """One synthesised utterance: float32 mono ``wave`` at ``sample_rate`` Hz, and how it was made."""

    wave: np.ndarray
    sample_rate: int
    text: str
    voice: str
    speed_wpm: int
    pitch: int

    @property
    def seconds(self) -> float:
        return len(self.wave) / self.sample_rate


def _wheel_available() -> bool:
    return importlib.util.find_spec("espeakng_loader") is not None


def espeak_available() -> bool:
    """Whether speech can be synthesised: the ``espeakng-loader`` wheel (a dependency) or an ``espeak-ng`` binary."""
    return _wheel_available() or shutil.which("espeak-ng") is not None


def synthesize(text: str, *, voice: str = "en-us", speed_wpm: int = 160, pitch: int = 50) -> tuple[np.ndarray, int]:
    """Speak ``text``: (float32 [N] in [-1, 1], sample rate in Hz, 22050).

    Uses libespeak-ng from the ``espeakng-loader`` wheel in a fresh process (:mod:`.espeak_worker`); the
    ``espeak-ng`` command only where that wheel is missing.
    """
    if _wheel_available():
        proc = subprocess.run([sys.executable, "-m", "cosyvoice_triton.export.espeak_worker", voice,
                               str(int(speed_wpm)), str(int(pitch))],
                              input=text.encode("utf-8"), capture_output=True, check=False, timeout=60)
        if proc.returncode != 0 or len(proc.stdout) <= 4:
            raise CosyVoiceError(f"espeak-ng failed for voice {voice!r}: {proc.stderr.decode(errors='replace')[-200:]}")
        rate = int.from_bytes(proc.stdout[:4], "little")
        return np.frombuffer(proc.stdout[4:], dtype="<i2").astype(np.float32) / 32768.0, rate
    if shutil.which("espeak-ng") is None:
        raise CosyVoiceError("espeak-ng is unavailable: install the espeakng-loader wheel (a dependency of this "
                             "package) or the espeak-ng system package")
    proc = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(speed_wpm), "-p", str(pitch), "--stdout", text],
        capture_output=True, check=False, timeout=60,
    )
    if proc.returncode != 0 or not proc.stdout:
        raise CosyVoiceError(f"espeak-ng failed for voice {voice!r}: {proc.stderr.decode(errors='replace')[:200]}")
    wave, sr = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    return wave, int(sr)


def _split_texts(split: str) -> dict[str, list[str]]:
    """The sentences of one split: even-numbered sentences calibrate, odd-numbered ones are held out."""
    k = SPLITS.index(split)
    return {lang: [t for i, t in enumerate(texts) if i % 2 == k] for lang, texts in TEXTS.items()}


def utterances(n: int, *, split: str = "calibration", seed: int = 0, min_seconds: float = 1.0,
               max_seconds: float = 12.0) -> list[Utterance]:
    """``n`` deterministic utterances of ``split``: languages, voices, speeds (120-220 wpm), pitches and
    lengths (1 to 3 sentences joined) vary. Utterances outside [min_seconds, max_seconds] are skipped."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    texts = _split_texts(split)
    langs = sorted(texts)
    rng = random.Random(f"{split}:{seed}")
    out: list[Utterance] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 20 * n + 50:
            raise CosyVoiceError(f"could not synthesise {n} utterances between {min_seconds} and {max_seconds} s")
        lang = rng.choices(langs, weights=[len(texts[x]) for x in langs])[0]
        k = min(rng.choice((1, 1, 2, 3)), len(texts[lang]))
        text = " ".join(rng.sample(texts[lang], k=k))
        voice = rng.choice(VOICES[lang])
        speed, pitch = rng.randrange(120, 221, 10), rng.randrange(25, 76, 5)
        wave, sr = synthesize(text, voice=voice, speed_wpm=speed, pitch=pitch)
        utt = Utterance(wave=wave, sample_rate=sr, text=text, voice=voice, speed_wpm=speed, pitch=pitch)
        if min_seconds <= utt.seconds <= max_seconds:
            out.append(utt)
    return out
