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


def stretch_mel(mel, speed: float):
    """``mel``, a torch tensor [..., T], stretched to ``int(T / speed)`` frames along its last axis by PyTorch's
    ``F.interpolate(..., mode="linear")``, the official call, in its own dtype and device; ``speed`` 1.0 returns
    ``mel``."""
    import torch
    import torch.nn.functional as F

    speed = check_speed(speed)
    if speed == 1.0:
        return mel
    frames = mel.shape[-1]
    out = int(frames / speed)
    if frames == 0 or out == 0:
        return mel[..., :0]
    with torch.inference_mode():
        y = F.interpolate(mel.float().reshape(1, -1, frames), size=out, mode="linear")
    return y.reshape(*mel.shape[:-1], out).to(mel.dtype)


def change_speed(mel: np.ndarray, speed: float) -> np.ndarray:
    """:func:`stretch_mel` of a numpy mel [..., T] (the served stage's), as numpy."""
    import torch

    if check_speed(speed) == 1.0:
        return mel
    mel = np.asarray(mel)
    return stretch_mel(torch.from_numpy(np.ascontiguousarray(mel)), speed).numpy().astype(mel.dtype, copy=False)
