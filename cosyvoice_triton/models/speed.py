"""CosyVoice's ``speed`` (the official ``token2wav(speed=...)``): the final mel is stretched in time by linear
interpolation to ``int(T / speed)`` frames before HiFT (PyTorch's ``F.interpolate(mel, size=..., mode="linear")``,
``align_corners=False``), so speech is faster above 1 and slower below, at the same pitch. Non-streaming answers
only: a stream's chunks are vocoded before the whole mel exists. One function for the library's
:class:`~cosyvoice_triton.pipeline.CosyVoice2` and the served TTS stage."""

from __future__ import annotations

import math

import numpy as np

from ..errors import CosyVoiceError

#: The accepted range (OpenAI's ``speed`` bounds); 1.0 leaves the mel as it is.
MIN_SPEED, MAX_SPEED = 0.25, 4.0


def check_speed(speed, name: str = "speed") -> float:
    """``speed`` as a float within [:data:`MIN_SPEED`, :data:`MAX_SPEED`]; :class:`CosyVoiceError` otherwise."""
    try:
        value = float(speed)
    except (TypeError, ValueError):
        raise CosyVoiceError(f"{name}: expected a number, got {speed!r}") from None
    if not math.isfinite(value) or not MIN_SPEED <= value <= MAX_SPEED:
        raise CosyVoiceError(f"{name}: {value!r} is out of range; between {MIN_SPEED} and {MAX_SPEED}")
    return value


def change_speed(mel: np.ndarray, speed: float) -> np.ndarray:
    """``mel`` [..., T] stretched to ``int(T / speed)`` frames by linear interpolation along its last axis, as
    ``F.interpolate(mel, size=int(T / speed), mode="linear")`` computes it (each output frame ``i`` reads the input
    at ``(i + 0.5) * T / T' - 0.5``, clamped at 0, between its two neighbours); ``speed`` 1.0 returns ``mel``."""
    speed = check_speed(speed)
    if speed == 1.0:
        return mel
    mel = np.asarray(mel)
    frames = mel.shape[-1]
    out = int(frames / speed)
    if frames == 0 or out == 0:
        return mel[..., :0]
    # PyTorch's arithmetic: the scale in float32, each source position rounded once (its CPU kernel's fused
    # multiply-add), the weights in float32
    scale = float(np.float32(frames / out))
    src = np.maximum(((np.arange(out) + 0.5) * scale - 0.5).astype(np.float32), np.float32(0))
    left = src.astype(np.int64)
    right = np.minimum(left + 1, frames - 1)
    weight = src - left.astype(np.float32)
    x = mel.astype(np.float32, copy=False)
    return (x[..., left] * (np.float32(1) - weight) + x[..., right] * weight).astype(mel.dtype, copy=False)
