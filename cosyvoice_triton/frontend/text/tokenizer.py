"""The CosyVoice2 / CosyVoice3 text tokenizer: the Qwen2 BPE of ``CosyVoice-BlankEN/`` plus the family's added
special tokens.

``transformers.AutoTokenizer`` reads the folder (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``; a
``tokenizer.json`` where present) and the tokens below are added in the official order, so that their ids are
the official ones: with the real Qwen2.5 files ``<|endofprompt|>`` is 151646, the id the official LM looks for.
Every added token, the fine-grained control tags included, is matched whole in the text and encodes to one id.

Both families read the same tokenizer files. CosyVoice3 (``CosyVoice3Tokenizer``) adds CosyVoice2's tokens, then
``<|endofsystem|>``, the CMU ARPAbet phones (vowels also with stress 0 / 1 / 2) and pinyin initials and finals (with
tone marks) as ``[..]`` tags, which pin the pronunciation of a word (``[j][ǐ]``, ``[HH][AH0][L][OW1]``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...errors import CheckpointError

# The model families, named as cosyvoice_triton.family names them.
COSYVOICE2, COSYVOICE3 = "cosyvoice2", "cosyvoice3"
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
ENDOFSYSTEM = "<|endofsystem|>"
# CosyVoice3's phone tags: ARPAbet phones in alphabetical order, each vowel followed by its stress variants.
_ARPABET_VOWELS = (
    "AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW"
)  # fmt: skip
_ARPABET_CONSONANTS = (
    "B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S", "SH", "T", "TH", "V", "W", "Y",
    "Z", "ZH"
)  # fmt: skip
ARPABET_TAGS = tuple(f"[{phone}{stress}]" for phone in sorted(_ARPABET_VOWELS + _ARPABET_CONSONANTS)
                     for stress in (("", "0", "1", "2") if phone in _ARPABET_VOWELS else ("",)))
# CosyVoice3's pinyin tags: initials, toneless finals and the tone-marked finals it knows, in code point order.
_PINYIN_UNITS = (
    "b", "c", "ch", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "q", "r", "s", "sh", "t", "w", "x", "y", "z",
    "zh", "a", "ai", "an", "ang", "ao", "e", "ei", "en", "eng", "i", "ian", "in", "ing", "iu", "o", "ong", "ou", "u",
    "uang", "ue", "un", "uo", "à", "ài", "àn", "àng", "ào", "á", "ái", "án", "áng", "áo", "ā", "āi", "ān", "āng", "āo",
    "ǎ", "ǎi", "ǎn", "ǎng", "ǎo", "è", "èi", "èn", "èng", "èr", "é", "éi", "én", "éng", "ér", "ē", "ēi", "ēn", "ēng",
    "ě", "ěi", "ěn", "ěng", "ěr", "ì", "ìn", "ìng", "í", "ín", "íng", "ī", "īn", "īng", "ǐ", "ǐn", "ǐng", "ò", "òng",
    "òu", "ó", "óng", "óu", "ō", "ōng", "ōu", "ǒ", "ǒng", "ǒu", "ù", "ùn", "ú", "ún", "ū", "ūn", "ǔ", "ǔn", "ǘ", "ǚ",
    "ǜ", "vè", "ià", "iàn", "iàng", "iào", "iá", "ián", "iáng", "iáo", "iā", "iān", "iāng", "iāo", "iǎ", "iǎn", "iǎng",
    "iǎo", "iè", "ié", "iē", "iě", "iòng", "ióng", "iōng", "iǒng", "iù", "iú", "iū", "iǔ", "uà", "uài", "uàn", "uàng",
    "uá", "uái", "uán", "uáng", "uā", "uāi", "uān", "uāng", "uǎ", "uǎi", "uǎn", "uǎng", "uè", "ué", "uē", "uě", "uì",
    "uí", "uī", "uǐ", "uò", "uó", "uō", "uǒ"
)  # fmt: skip
PINYIN_TAGS = tuple(f"[{unit}]" for unit in sorted(_PINYIN_UNITS))
# ``additional_special_tokens`` as CosyVoice3 adds them (CosyVoice3Tokenizer).
COSYVOICE3_ADDED_SPECIAL_TOKENS = (*ADDED_SPECIAL_TOKENS, ENDOFSYSTEM, *ARPABET_TAGS, *PINYIN_TAGS)
#: Family -> the special tokens its tokenizer adds to the Qwen2 files, in the official order.
FAMILY_SPECIAL_TOKENS = {COSYVOICE2: ADDED_SPECIAL_TOKENS, COSYVOICE3: COSYVOICE3_ADDED_SPECIAL_TOKENS}
#: Family -> every special token it matches whole in text (Qwen2's own three included).
FAMILY_KNOWN_TAGS = {family: frozenset(QWEN_SPECIAL_TOKENS + added)
                     for family, added in FAMILY_SPECIAL_TOKENS.items()}
# A folder must hold these (the release also has config.json, generation_config.json, model.safetensors).
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def family_special_tokens(family: str) -> tuple[str, ...]:
    """The special tokens that ``family``'s tokenizer adds, in the official order."""
    try:
        return FAMILY_SPECIAL_TOKENS[family]
    except KeyError:
        raise ValueError(f"no text tokenizer for model family {family!r} (one of {', '.join(FAMILY_SPECIAL_TOKENS)})"
                         ) from None


class QwenTextTokenizer:
    """Encode and decode CosyVoice2 / CosyVoice3 text tokens, exactly as the official
    ``get_qwen_tokenizer(dir, skip_special_tokens=True, version=family)``.

    Parameters
    ----------
    blank_en_dir : str or os.PathLike
        A ``CosyVoice-BlankEN`` folder (the real one or :func:`~.write_tokenizer_standin`'s).
    family : str
        ``"cosyvoice2"`` (default) or ``"cosyvoice3"``: which special tokens are added.
    """

    def __init__(self, blank_en_dir: str | os.PathLike, family: str = COSYVOICE2):
        added = family_special_tokens(family)
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
            {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "additional_special_tokens": list(added)}
        )
        self._tok = tok
        self.folder = folder
        self.family = family
        self.known_tags = FAMILY_KNOWN_TAGS[family]

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
        if token not in self.known_tags:
            raise KeyError(f"{token!r} is not a {self.family} special token")
        return int(self._tok.convert_tokens_to_ids(token))
