"""The CosyVoice2 text tokenizer: the Qwen2 BPE of ``CosyVoice-BlankEN/`` plus CosyVoice's added special tokens.

``transformers.AutoTokenizer`` reads the folder (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``; a
``tokenizer.json`` where present) and the tokens below are added in the official order, so that their ids are
the official ones: with the real Qwen2.5 files ``<|endofprompt|>`` is 151646, the id the official LM looks for.
Every added token, the fine-grained control tags included, is matched whole in the text and encodes to one id.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...errors import CheckpointError

ENDOFTEXT = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"
# The Qwen2 tokenizer's own special tokens, right after its byte-level BPE vocabulary.
QWEN_SPECIAL_TOKENS = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
# Fine-grained control tags of CosyVoice2 (instruct / cross-lingual text), in the official order.
CONTROL_TAGS = (
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip
# ``additional_special_tokens`` as CosyVoice2 adds them (cosyvoice/tokenizer/tokenizer.py: CosyVoice2Tokenizer).
ADDED_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", ENDOFPROMPT, *CONTROL_TAGS)
KNOWN_TAGS = frozenset(QWEN_SPECIAL_TOKENS + ADDED_SPECIAL_TOKENS)
# A folder must hold these (the release also has config.json, generation_config.json, model.safetensors).
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


class QwenTextTokenizer:
    """Encode and decode CosyVoice2 text tokens, exactly as ``get_qwen_tokenizer(dir, skip_special_tokens=True)``.

    Parameters
    ----------
    blank_en_dir : str or os.PathLike
        A ``CosyVoice-BlankEN`` folder (the real one or :func:`~.write_tokenizer_standin`'s).
    """

    def __init__(self, blank_en_dir: str | os.PathLike):
        folder = Path(blank_en_dir)
        missing = [name for name in TOKENIZER_FILES if not (folder / name).is_file()]
        if not folder.is_dir() or (missing and not (folder / "tokenizer.json").is_file()):
            raise CheckpointError(f"{folder}: not a CosyVoice-BlankEN tokenizer folder (missing {', '.join(missing)})")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{folder}: the Qwen2 tokenizer files cannot be read: {exc}") from exc
        tok.add_special_tokens(
            {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "additional_special_tokens": list(ADDED_SPECIAL_TOKENS)}
        )
        self._tok = tok
        self.folder = folder

    def __len__(self) -> int:
        """Number of ids, base vocabulary and every special token included (the LM's embedding must be larger)."""
        return len(self._tok)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, shape ``(n,)``, int64; special tokens in the text become their single ids."""
        return np.asarray(self._tok(text)["input_ids"], dtype=np.int64).reshape(-1)

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (any integer sequence); special tokens are dropped unless ``skip_special_tokens=False``."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        """The id of one special token, e.g. ``"<|endofprompt|>"``."""
        if token not in KNOWN_TAGS:
            raise KeyError(f"{token!r} is not a CosyVoice2 special token")
        return int(self._tok.convert_tokens_to_ids(token))
