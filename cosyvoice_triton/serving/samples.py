"""Warm-up inputs of the Python stages that call no other model, shared by the render (Triton's ``model_warmup``
of ``preprocess`` / ``postprocess``) and the launchers (the warm-up request, the rollout's parity input)."""

from __future__ import annotations

import numpy as np

__all__ = ["stage_warmup_samples"]


def stage_warmup_samples(name: str, seconds: float = 1.0) -> dict[str, np.ndarray] | None:
    """Warm-up inputs of the Python stages that do not call other models (None: no warm-up); ``seconds``: the
    length of the preprocess sample (at least the configured minimum, or the warm-up would be refused)."""
    if name == "preprocess":
        sr = 16000
        t = np.arange(int(sr * seconds)) / sr
        speech = (0.3 * np.sin(2 * np.pi * 150 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
        return {"source_audio": speech, "source_sample_rate": np.array([sr], np.int32),
                "prompt_audio": speech, "prompt_sample_rate": np.array([sr], np.int32)}
    if name == "postprocess":
        return {"waveform": (0.1 * np.sin(np.arange(12000) * 0.05)).astype(np.float32)}
    return None
