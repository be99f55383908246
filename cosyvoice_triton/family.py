"""Which CosyVoice family a model folder holds, by the official ``AutoModel`` rule, and the files each needs.

The official ``AutoModel`` looks for the family's yaml in a fixed order and takes the first it finds:
``cosyvoice.yaml`` (CosyVoice), ``cosyvoice2.yaml`` (CosyVoice2), ``cosyvoice3.yaml`` (CosyVoice3); a folder
with none is refused. The family's own loader then checks that the yaml builds that family's modules (an LM,
flow and vocoder class triple); :func:`yaml_classes_family` does the same check on the yaml's text without
executing it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from .config import load_hyperpyyaml
from .errors import ConfigError

COSYVOICE, COSYVOICE2, COSYVOICE3 = "cosyvoice", "cosyvoice2", "cosyvoice3"
#: Family -> its yaml, in the order the official ``AutoModel`` tries them.
FAMILY_YAML = {COSYVOICE: "cosyvoice.yaml", COSYVOICE2: "cosyvoice2.yaml", COSYVOICE3: "cosyvoice3.yaml"}

#: Family -> the files its official loader opens (a trailing ``/``: a folder). ``spk2info.pt`` is optional.
FAMILY_FILES = {
    COSYVOICE: ("cosyvoice.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v1.onnx"),
    COSYVOICE2: ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
                 "CosyVoice-BlankEN/"),
    COSYVOICE3: ("cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx",
                 "CosyVoice-BlankEN/"),
}
COSYVOICE3_FILES = FAMILY_FILES[COSYVOICE3]

#: Family -> the (llm, flow, hift) classes its yaml builds (the official ``get_model_type``: instances of them,
#: tried in this order).
FAMILY_CLASSES = {
    COSYVOICE: ("cosyvoice.llm.llm.TransformerLM", "cosyvoice.flow.flow.MaskedDiffWithXvec",
                "cosyvoice.hifigan.generator.HiFTGenerator"),
    COSYVOICE2: ("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.flow.flow.CausalMaskedDiffWithXvec",
                 "cosyvoice.hifigan.generator.HiFTGenerator"),
    COSYVOICE3: ("cosyvoice.llm.llm.CosyVoice3LM", "cosyvoice.flow.flow.CausalMaskedDiffWithDiT",
                 "cosyvoice.hifigan.generator.CausalHiFTGenerator"),
}


_LLM, _FLOW, _HIFT = "cosyvoice.llm.llm.", "cosyvoice.flow.flow.", "cosyvoice.hifigan.generator."
#: Class -> the official classes that are instances of it (their subclasses, themselves included).
_INSTANCES = {
    _LLM + "TransformerLM": {_LLM + "TransformerLM", _LLM + "Qwen2LM", _LLM + "CosyVoice3LM"},
    _LLM + "Qwen2LM": {_LLM + "Qwen2LM", _LLM + "CosyVoice3LM"},
    _HIFT + "HiFTGenerator": {_HIFT + "HiFTGenerator", _HIFT + "CausalHiFTGenerator"},
}


def model_family(model_dir: str | Path) -> str:
    """``"cosyvoice"``, ``"cosyvoice2"`` or ``"cosyvoice3"``: the first of the three yaml names present in
    ``model_dir``, in the official ``AutoModel`` order."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: not a folder (a CosyVoice model folder)")
    for family, name in FAMILY_YAML.items():
        if (model_dir / name).is_file():
            return family
    raise ConfigError(f"{model_dir}: no model type found: the folder has none of {', '.join(FAMILY_YAML.values())}")


def missing_files(model_dir: str | Path, family: str) -> list[str]:
    """The files (and folders, ending in ``/``) of :data:`FAMILY_FILES` that ``model_dir`` lacks."""
    if family not in FAMILY_FILES:
        raise ConfigError(f"unknown model family {family!r} (one of {', '.join(FAMILY_FILES)})")
    model_dir = Path(model_dir)
    return [name for name in FAMILY_FILES[family]
            if not ((model_dir / name).is_dir() if name.endswith("/") else (model_dir / name).is_file())]


def check_model_folder(model_dir: str | Path, family: str | None = None) -> str:
    """The folder's family (:func:`model_family`, or ``family`` which it must then hold), after checking that every
    file its loader opens is there; the error lists the missing ones."""
    found = model_family(model_dir)
    if family is not None and found != family:
        raise ConfigError(f"{model_dir}: a {found} folder ({FAMILY_YAML[found]}), not {family}")
    missing = missing_files(model_dir, found)
    if missing:
        raise ConfigError(f"{model_dir}: a {found} folder without {', '.join(missing)}")
    return found


def yaml_classes_family(path: str | Path) -> str:
    """The family whose (llm, flow, hift) classes the yaml at ``path`` builds, read without executing it; refuses
    a yaml whose classes are no family's, or are another family's than its file name says (as the official
    loaders do)."""
    path = Path(path)
    try:
        doc = load_hyperpyyaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (yaml.YAMLError, ConfigError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    classes = tuple(doc[k].get("__class__") if isinstance(doc.get(k), dict) else None for k in ("llm", "flow", "hift"))
    family = next((f for f, bases in FAMILY_CLASSES.items()
                   if all(c in _INSTANCES.get(b, {b}) for c, b in zip(classes, bases, strict=True))), None)
    if family is None:
        raise ConfigError(f"{path}: no model type found: llm / flow / hift are {classes}")
    named = next((f for f, name in FAMILY_YAML.items() if name == path.name), None)
    if named is not None and named != family:
        raise ConfigError(f"{path}: builds {family} modules {classes}, not {named}'s")
    return family
