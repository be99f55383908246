"""Reading the official ``flow.pt`` / ``hift.pt`` files and checking them before ``load_state_dict``.

The official loader (``CosyVoiceModel.load``) does ``torch.load(..., weights_only=True)`` and
``load_state_dict(strict=True)``; for HiFT it first removes every ``generator.`` occurrence in the keys.
Older weight-norm exports store ``X.weight_g`` / ``X.weight_v``, newer ones (torch >= 2.1 parametrizations)
``X.parametrizations.weight.original0`` / ``original1``; both are accepted here.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

from ..errors import CheckpointError

log = logging.getLogger(__name__)

# Present in the current (causal, 2025+) flow; the pre-2025 release had GroupNorm at block.1 instead.
CAUSAL_FLOW_KEY = "decoder.estimator.down_blocks.0.0.block1.block.2.weight"
LEGACY_FLOW_KEY = "decoder.estimator.down_blocks.0.0.block1.block.1.weight"


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """``torch.load`` a checkpoint safely (no pickled code), with errors that name the file.

    Returns a flat ``{key: float32 tensor}`` on CPU. Half-precision files are widened to float32.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: file is empty")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Weights only" in str(exc):
            raise CheckpointError(
                f"{path}: holds pickled objects other than tensors; refusing to execute it (weights_only load)"
            ) from exc
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({exc})") from exc
    except Exception as exc:  # corrupt archives fail with many types (zipfile, EOF, Index, Runtime...)
        raise CheckpointError(
            f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not obj:
        kind = "an empty dict" if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path}: expected a state_dict (a mapping of names to tensors), got {kind}")
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        if value.is_floating_point() and value.dtype != torch.float32:
            value = value.float()
        out[str(key)] = value
    return out


def normalize_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map the key spellings the official loader accepts onto this package's module names.

    - every ``generator.`` occurrence is removed (as the official HiFT loader does);
    - legacy weight norm ``X.weight_g`` / ``X.weight_v`` becomes ``X.parametrizations.weight.original0/1``.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.replace("generator.", "")
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out


def check_flow_revision(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Reject the pre-2025 CosyVoice2 flow (non-causal ``ConditionalDecoder``) with a useful message."""
    if CAUSAL_FLOW_KEY in state:
        return
    if LEGACY_FLOW_KEY in state:
        raise CheckpointError(
            f"{path}: this flow.pt is the pre-2025 CosyVoice2 release (non-causal decoder, GroupNorm at "
            f"{LEGACY_FLOW_KEY}); this package implements the current causal flow. Download the current "
            "CosyVoice2-0.5B revision."
        )
    raise CheckpointError(f"{path}: not a CosyVoice2 flow checkpoint (no key {CAUSAL_FLOW_KEY})")


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """``module.load_state_dict(state, strict=True)`` with a readable summary of any mismatch."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in state and state[k].shape != expected[k].shape
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        if wrong:
            parts.append(f"{len(wrong)} with other shapes (e.g. {'; '.join(wrong[:3])})")
        raise CheckpointError(
            f"{path}: does not match the model built from cosyvoice2.yaml: " + ", ".join(parts)
            + ". Is cosyvoice2.yaml from the same model folder?"
        )
    module.load_state_dict(state, strict=True)
    log.info("loaded %s (%d tensors)", path, len(state))


def load_flow(path: str | Path, config):
    """The official ``flow.pt`` at ``path`` in a :class:`~.flow.CausalMaskedDiffWithXvec` built from ``config``
    (a :class:`~cosyvoice_triton.config.FlowConfig`), checked and in eval mode."""
    from .flow import CausalMaskedDiffWithXvec

    state = normalize_keys(read_state_dict(path))
    check_flow_revision(state, path)
    flow = CausalMaskedDiffWithXvec(config)
    load_into(flow, state, path)
    return flow.eval()
