"""Error types raised by the library.

Every error a caller can fix (bad audio, a wrong model folder) derives from ``ValueError`` so that the
serving layer can map it to HTTP 400 / gRPC INVALID_ARGUMENT without knowing the subclasses.
A message that quotes the client's input quotes it through :func:`shown`, so a 10 kB id makes a short error.
"""

import reprlib

_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 66


def shown(value: object) -> str:
    """``repr(value)``, shortened with ``...`` in the middle past 66 characters."""
    return _SHOWN.repr(value)


class CosyVoiceError(ValueError):
    """Base class of the errors that describe bad input rather than a bug."""


class AudioError(CosyVoiceError):
    """Audio that cannot be used: empty, too short or long, non-finite, silent, undecodable, bad rate."""


class CheckpointError(CosyVoiceError):
    """A model file that is missing, unreadable, of the wrong revision or of the wrong shape."""


class ConfigError(CosyVoiceError):
    """A ``cosyvoice2.yaml`` whose values cannot be read."""


class TextError(CosyVoiceError):
    """Text that cannot be synthesised: empty, only punctuation, too long, bad UTF-8, an unknown control tag."""


class LLMError(CosyVoiceError):
    """Input the speech-token LM cannot decode: empty text, token ids outside its vocabularies, too long."""


class SpeakerError(CosyVoiceError):
    """A registered speaker that is unknown, has a bad id, bad prompt arrays, or does not fit in the store."""
