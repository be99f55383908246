"""Speak one text with libespeak-ng from the ``espeakng-loader`` wheel:
``python -m cosyvoice_triton.export.espeak_worker VOICE SPEED_WPM PITCH`` reads UTF-8 text on stdin and
writes the sample rate (4 bytes, little-endian) then 16-bit PCM to stdout.

One process per text, as the ``espeak-ng`` command works: the library keeps state from one synthesis to the next
(the same text comes out a few samples different on a second call), so a fresh process is what makes the corpus
identical whatever was spoken before. Only ctypes here: the process starts in tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import sys

_AUDIO_OUTPUT_SYNCHRONOUS, _POS_CHARACTER, _CHARS_UTF8, _RATE, _PITCH = 2, 1, 1, 1, 3
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Voice(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_char_p), ("identifier", ctypes.c_char_p),
                ("gender", ctypes.c_ubyte), ("age", ctypes.c_ubyte), ("variant", ctypes.c_ubyte),
                ("xx1", ctypes.c_ubyte), ("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


def speak(text: str, voice: str, speed_wpm: int, pitch: int) -> tuple[bytes, int]:
    """(16-bit PCM bytes, sample rate in Hz) of ``text``; raises ``ValueError`` naming an unknown voice."""
    import espeakng_loader

    lib = ctypes.cdll.LoadLibrary(str(espeakng_loader.get_library_path()))
    rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, str(espeakng_loader.get_data_path()).encode(), 0)
    if rate <= 0:
        raise RuntimeError("libespeak-ng failed to initialise")
    pcm = bytearray()

    def collect(wav, n, _events):
        if n > 0:
            pcm.extend(ctypes.string_at(wav, 2 * n))
        return 0

    callback = _CALLBACK(collect)
    lib.espeak_SetSynthCallback(callback)
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    # as the espeak-ng command does: a voice name first, else a language (either may carry "+variant")
    if lib.espeak_SetVoiceByName(voice.encode()) != 0 and \
            lib.espeak_SetVoiceByProperties(ctypes.byref(_Voice(languages=voice.encode()))) != 0:
        raise ValueError(f"espeak-ng has no voice {voice!r}")
    lib.espeak_SetParameter(_RATE, speed_wpm, 0)
    lib.espeak_SetParameter(_PITCH, pitch, 0)
    lib.espeak_ng_SetRandSeed(1)  # breathy variants (e.g. +f2) draw noise, seeded from the clock by default
    raw = text.encode("utf-8") + b"\0"
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    err = lib.espeak_Synth(raw, len(raw), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
    if err != 0:
        raise RuntimeError(f"espeak_Synth failed with error {err}")
    return bytes(pcm), rate


def main(argv: list[str]) -> int:
    voice, speed_wpm, pitch = argv[0], int(argv[1]), int(argv[2])
    try:
        pcm, rate = speak(sys.stdin.buffer.read().decode("utf-8"), voice, speed_wpm, pitch)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    sys.stdout.buffer.write(rate.to_bytes(4, "little") + pcm)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
