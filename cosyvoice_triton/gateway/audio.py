"""Audio encoding of the answers: whole files (``encode``) and streams (``StreamEncoder``, bytes as the chunks come).

wav / flac / ogg-opus through soundfile (libsndfile), mp3 through lameenc (LAME; its frames concatenate, so one
encoder serves files and streams), pcm as OpenAI defines it: raw signed 16-bit little-endian mono samples.
A streamed wav has the streaming header (RIFF and data sizes 0xFFFFFFFF: length unknown); flac is not streamed
(its header is rewritten at the end)."""

from __future__ import annotations

import base64
import binascii
import io
import struct

import lameenc
import numpy as np
import soundfile as sf

from .errors import GatewayError

#: ``response_format`` -> Content-Type.
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "flac": "audio/flac", "wav": "audio/wav",
                 "pcm": "audio/pcm"}
FORMATS = tuple(CONTENT_TYPES)
STREAM_FORMATS = ("mp3", "opus", "wav", "pcm")
_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "opus": ("OGG", "OPUS")}
MP3_KBPS = 128


def reference_bytes(data: str, param: str = "reference_audio") -> bytes:
    """A recording sent as base64 or a ``data:`` URL (``reference_audio``), decoded; 400 naming ``param``."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise GatewayError(400, f"{param}: not valid base64", param=param, code="invalid_value") from None
    if not raw:
        raise GatewayError(400, f"{param}: empty", param=param, code="invalid_value")
    return raw


def pcm16(wave: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(wave, np.float32).reshape(-1), -1.0, 1.0) * 32767.0).round().astype("<i2")


def _mp3_encoder(sample_rate: int) -> lameenc.Encoder:
    enc = lameenc.Encoder()
    enc.set_bit_rate(MP3_KBPS)
    enc.set_in_sample_rate(int(sample_rate))
    enc.set_channels(1)
    enc.set_quality(2)
    return enc


def encode(wave: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """One whole answer as a ``fmt`` file (``fmt`` in :data:`FORMATS`)."""
    if fmt == "pcm":
        return pcm16(wave).tobytes()
    if fmt == "mp3":
        enc = _mp3_encoder(sample_rate)
        return bytes(enc.encode(pcm16(wave).tobytes())) + bytes(enc.flush())
    container, subtype = _SOUNDFILE[fmt]
    buf = io.BytesIO()
    data = pcm16(wave) if subtype == "PCM_16" else np.asarray(wave, np.float32).reshape(-1)  # one 16-bit rounding
    sf.write(buf, data, int(sample_rate), format=container, subtype=subtype)
    return buf.getvalue()


def wav_stream_header(sample_rate: int) -> bytes:
    """The 44-byte header of a 16-bit mono wav of unknown length."""
    rate = int(sample_rate)
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2,
                                                                                2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


class _Sink(io.RawIOBase):
    """A seekable in-memory file for libsndfile whose appended bytes are taken away as they are written."""

    def __init__(self):
        self.data, self.pos = bytearray(), 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        end = self.pos + len(b)
        self.data[self.pos:end] = b
        self.pos = end
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: len(self.data)}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


class StreamEncoder:
    """``feed(chunk)`` -> the bytes of that chunk so far; ``close()`` -> the rest. ``fmt`` in :data:`STREAM_FORMATS`."""

    def __init__(self, fmt: str, sample_rate: int):
        if fmt not in STREAM_FORMATS:
            raise ValueError(f"{fmt} cannot be streamed; one of {', '.join(STREAM_FORMATS)}")
        self.fmt, self.sample_rate = fmt, int(sample_rate)
        self._header = wav_stream_header(sample_rate) if fmt == "wav" else b""
        self._mp3 = _mp3_encoder(sample_rate) if fmt == "mp3" else None
        self._sink, self._file, self._sent = None, None, 0
        if fmt == "opus":
            self._sink = _Sink()
            self._file = sf.SoundFile(self._sink, "w", self.sample_rate, 1, format="OGG", subtype="OPUS")

    def _take(self) -> bytes:
        out = bytes(self._sink.data[self._sent:])
        self._sent = len(self._sink.data)
        return out

    def feed(self, wave: np.ndarray) -> bytes:
        head, self._header = self._header, b""
        if self._mp3 is not None:
            return bytes(self._mp3.encode(pcm16(wave).tobytes()))
        if self._file is not None:
            self._file.write(np.asarray(wave, np.float32).reshape(-1))
            return self._take()
        return head + pcm16(wave).tobytes()

    def close(self) -> bytes:
        head, self._header = self._header, b""
        if self._mp3 is not None:
            return bytes(self._mp3.flush())
        if self._file is not None:
            self._file.close()
            return self._take()
        return head
