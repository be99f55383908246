"""Typed tunables from a Triton model config's ``parameters`` (``{"key": {"string_value": "..."}}``).

A model declares what it reads as :class:`Param` entries; :func:`read_parameters` converts each value to its
type once, in ``initialize()``, and refuses unknown keys, missing required ones and values of the wrong type,
so a typo in a config fails the model's load with a message instead of being ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Param", "ParameterError", "config_parameters", "read_parameters", "set_niceness"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ParameterError(ValueError):
    """A model config parameter that is unknown, missing or not of its type."""


@dataclass(frozen=True)
class Param:
    name: str
    type: type  # bool, int, float or str
    default: Any = None  # None: required
    doc: str = ""
    choices: tuple[Any, ...] = ()

    def convert(self, raw: str, model: str) -> Any:
        text = str(raw).strip()
        try:
            if self.type is bool:
                low = text.lower()
                if low not in _TRUE | _FALSE:
                    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
                value: Any = low in _TRUE
            elif self.type is int:
                value = int(text)
            elif self.type is float:
                value = float(text)
            else:
                value = str(raw)
        except ValueError as exc:
            raise ParameterError(f"{model}: parameter {self.name!r} = {raw!r} is not a {self.type.__name__} "
                                 f"({exc})") from exc
        if self.choices and value not in self.choices:
            raise ParameterError(f"{model}: parameter {self.name!r} = {raw!r} is not one of "
                                 f"{', '.join(map(str, self.choices))}")
        return value


def config_parameters(model_config: Mapping[str, Any] | str) -> dict[str, str]:
    """The raw ``parameters`` of a model config (the JSON string Triton passes to ``initialize`` or its dict)."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    raw = cfg.get("parameters") or {}
    return {k: (v.get("string_value", "") if isinstance(v, Mapping) else str(v)) for k, v in raw.items()}


def read_parameters(model_config: Mapping[str, Any] | str, params: Iterable[Param], *,
                    model: str = "model") -> dict[str, Any]:
    """Typed values of ``params`` from ``model_config``; defaults fill what the config leaves out."""
    params = list(params)
    raw = config_parameters(model_config)
    known = {p.name for p in params}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ParameterError(f"{model}: unknown parameter(s) {', '.join(unknown)}; this model reads "
                             f"{', '.join(sorted(known))}")
    out: dict[str, Any] = {}
    for p in params:
        if p.name in raw:
            out[p.name] = p.convert(raw[p.name], model)
        elif p.default is None:
            raise ParameterError(f"{model}: parameter {p.name!r} is required ({p.doc})")
        else:
            out[p.name] = p.default
    return out


def set_niceness(nice: int) -> None:
    """Raise the CPU niceness of every thread of this process to ``nice`` (0-19; 0: leave it). Linux keeps a
    niceness per thread and a new thread inherits its creator's, so this is called first in ``initialize()``,
    before the model starts its threads (onnxruntime, torch, the LM loop)."""
    if nice <= 0:
        return
    nice = min(19, int(nice))
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
