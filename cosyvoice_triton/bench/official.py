"""Import the OFFICIAL CosyVoice code from a checkout, for oracles and side-by-side benchmarks only.

The library never depends on it. ``import_official(path, "cosyvoice.llm.llm")`` puts the checkout (and its
``third_party/Matcha-TTS``) on ``sys.path`` and stubs the modules that cannot import with the CPU torch here
(torchaudio, whose PyPI builds need CUDA libraries; lightning, which Matcha-TTS imports only for a logging
decorator; the ``__init__`` of ``matcha.utils``, which pulls in hydra and rich for training: its submodules
import from their files as usual). Nothing the stubbed modules provide is called on the paths used (LM inference,
flow, HiFT).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from functools import partial
from pathlib import Path

import torch

from ..errors import CheckpointError

# The sampling section of the official cosyvoice2.yaml (llm.sampling: ras_sampling) and the inference defaults
# of Qwen2LM.inference.
OFFICIAL_SAMPLING = {"top_p": 0.8, "top_k": 25, "win_size": 10, "tau_r": 0.1}
OFFICIAL_TOKEN_TEXT_RATIO = {"min_token_text_ratio": 2.0, "max_token_text_ratio": 20.0}

STUBBED: list[str] = []


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers probes find_spec on it
    module.__dict__.update(attrs)
    sys.modules[name] = module
    STUBBED.append(name)
    return module


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # torchaudio raises OSError (missing CUDA libraries), not only ImportError
        sys.modules.pop(name, None)
        return False
    return True


def import_official(checkout: str | Path, *modules: str) -> list[types.ModuleType]:
    """Import ``modules`` (dotted names) from an official CosyVoice checkout; returns them in order."""
    checkout = Path(checkout).resolve()
    if not (checkout / "cosyvoice" / "llm" / "llm.py").is_file():
        raise CheckpointError(f"{checkout}: not a checkout of the official CosyVoice code (no cosyvoice/llm/llm.py)")
    matcha = checkout / "third_party" / "Matcha-TTS"
    for path in (str(matcha), str(checkout)):
        if path not in sys.path:
            sys.path.insert(0, path)
    if "torchaudio" not in sys.modules and not _importable("torchaudio"):
        torchaudio = _stub("torchaudio")
        torchaudio.compliance = _stub("torchaudio.compliance")
        torchaudio.compliance.kaldi = _stub("torchaudio.compliance.kaldi")
    if "lightning" not in sys.modules and importlib.util.find_spec("lightning") is None:
        _stub("lightning")
        _stub("lightning.pytorch")
        _stub("lightning.pytorch.utilities", rank_zero_only=lambda fn: fn)
    if (matcha / "matcha" / "utils").is_dir() and "matcha.utils" not in sys.modules:
        _stub("matcha.utils", __path__=[str(matcha / "matcha" / "utils")])
    return [importlib.import_module(name) for name in modules]


def official_qwen2lm(checkout: str | Path, qwen: str | Path | torch.nn.Module, *, hidden_size: int,
                     speech_token_size: int = 6561):
    """The official ``Qwen2LM`` as cosyvoice2.yaml builds it, in eval mode.

    ``qwen``: a ``CosyVoice-BlankEN`` folder with a config and weights (the official ``Qwen2Encoder`` calls
    ``from_pretrained`` on it), or an already built official ``Qwen2Encoder``.
    """
    llm, common = import_official(checkout, "cosyvoice.llm.llm", "cosyvoice.utils.common")
    encoder = qwen if isinstance(qwen, torch.nn.Module) else llm.Qwen2Encoder(str(qwen))
    model = llm.Qwen2LM(llm_input_size=hidden_size, llm_output_size=hidden_size, speech_token_size=speech_token_size,
                        llm=encoder, sampling=partial(common.ras_sampling, **OFFICIAL_SAMPLING),
                        length_normalized_loss=True, lsm_weight=0, mix_ratio=[5, 15])
    return model.eval()
