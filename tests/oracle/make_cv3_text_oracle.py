"""Regenerate tests/fixtures/text_oracle/cosyvoice3.json with the official CosyVoice3 text front end.

Runs the official ``CosyVoiceFrontEnd.text_normalize`` with ``get_qwen_tokenizer(..., version="cosyvoice3")`` (the
official ``CosyVoice3Tokenizer``) on the stand-in tokenizer files of the CosyVoice2 text oracle
(``tests/fixtures/text_oracle/standin_4096``, unchanged: CosyVoice3 reads the same Qwen2 files and adds more special
tokens), built and stubbed as ``make_text_oracle.py`` does (see its docstring for the ``wetext`` runtime). The texts:
the CosyVoice2 oracle's (the same normalisation, now with CosyVoice3's tokenizer) and CosyVoice3's own (the
official examples' system prompt and ``<|endofprompt|>``, ``<|endofsystem|>``, ARPAbet and pinyin tags).

It also records the special ids on a stand-in written with ``official_ids=True`` (BPE padded to the real 151,643
entries; not committed, the test writes it again and checks its sha256): there CosyVoice3's tokens take their
official ids, e.g. ``<|endofprompt|>`` 151646, the id the official CosyVoice3 LM looks for.

    /work/cv3-oracle-venv/bin/python tests/oracle/make_cv3_text_oracle.py --official /tmp/cosyvoice_official \
        --wetext-runtime /tmp/wetext004
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_text_oracle as cv2_oracle

ROOT = cv2_oracle.ROOT
OUT = cv2_oracle.OUT / "cosyvoice3.json"
STANDIN = cv2_oracle.OUT / f"standin_{cv2_oracle.VOCAB_SIZE}"
FULL_VOCAB = 151936  # the release LM's text rows

SYSTEM = "You are a helpful assistant."
SENTENCES = [
    *cv2_oracle.SENTENCES,
    # zero-shot text of the official example (normalised and split as usual)
    "八百标兵奔北坡，北坡炮兵并排跑，炮兵怕把标兵碰，标兵怕碰炮兵炮。",
    # cross-lingual texts of the official examples: the system prompt first, so no normalisation and no splitting
    f"{SYSTEM}<|endofprompt|>[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点，[breath]邻居都很活络，[breath]嗯，都很熟悉。[breath]",
    f"{SYSTEM}<|endofprompt|>レキシ テキ セカイ ニ オイ テ ワ、カコ ワ タンニ スギサッ タ モノ デ ワ ナイ、"
    "プラトン ノ イウ ゴトク ヒ ユー ガ ユー デ アル。",
    f"{SYSTEM}<|endofprompt|>On May 3rd, 2024 we paid $45 for [R][EH1][D] roses.",
    # pronunciation tags in text that is normalised (the official "hotfix" example, then English and more pinyin)
    "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。",
    "银行[h][áng]的行[x][íng]长说，2024年的利率是3.5%。",
    "I [R][IH0][K][AO1][R][D] 2 songs, then [R][EH1][K][ER0][D] them at 9:30 am.",
    "The [L][IY1][D] singer took the [L][EH1][D] out, [HH][AH0][L][OW1] everyone!",
    # <|endofsystem|> and the other CosyVoice3 tags in text the front end leaves alone
    f"{SYSTEM}<|endofsystem|>读[zh][òng]要的书<|endofprompt|>好的。",
    "[ǘ][ǚ][ǜ][vè][iǒng][uǎng][ZH][OY2] plain words [breath] [NOPE] [x]",
]
PROMPT_TEXTS = [
    # the official zero-shot prompt text: holds <|endofprompt|>, so it is not normalised
    f"{SYSTEM}<|endofprompt|>希望你以后能够做的比我还好呦。",
    f"{SYSTEM}<|endofprompt|>That's the 2nd time I've seen him this week, at 7:45 am.",
    # without the system prompt (the official LM would then need <|endofprompt|> in the text): normalised
    "希望你以后能够做的比我还好呦，2024年。",
]
INSTRUCT_TEXTS = [
    f"{SYSTEM} 请用广东话表达。<|endofprompt|>",
    f"{SYSTEM} 请用尽可能快地语速说一句话。<|endofprompt|>",
    f"{SYSTEM} Please say a sentence as loudly as possible.<|endofprompt|>",
    f"{SYSTEM} 我想体验一下小猪佩奇风格，可以吗？<|endofprompt|>",
]


def main() -> None:
    args = cv2_oracle.arguments(__doc__)
    from cosyvoice_triton.frontend.text import write_tokenizer_standin

    sha = {p.name: cv2_oracle._sha256(p) for p in sorted(STANDIN.iterdir())}
    expected = json.loads((cv2_oracle.OUT / "official.json").read_text())["standin_sha256"]
    if sha != expected:
        raise SystemExit(f"{STANDIN}: not the CosyVoice2 text oracle's stand-in files (regenerate that oracle first)")
    frontend, ran_on = cv2_oracle.official_frontend(args.official, args.wetext_runtime, STANDIN, "cosyvoice3")
    assert type(frontend.tokenizer).__name__ == "CosyVoice3Tokenizer", type(frontend.tokenizer)

    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        padded = write_tokenizer_standin(Path(tmp) / "padded", FULL_VOCAB, official_ids=True)
        padded_sha = {p.name: cv2_oracle._sha256(p) for p in sorted(padded.iterdir())}
        official_layout = get_qwen_tokenizer(token_path=str(padded), skip_special_tokens=True, version="cosyvoice3")
        added = official_layout.special_tokens["additional_special_tokens"]
        tok = official_layout.tokenizer
        example = PROMPT_TEXTS[0] + INSTRUCT_TEXTS[2]
        padded_ids = {"tokenizer_len": len(tok), "special_ids": {t: int(tok.convert_tokens_to_ids(t)) for t in added},
                      "example": {"text": example, "tokens": [int(i) for i in official_layout.encode(example)]}}

    reference = {
        "about": "official CosyVoice3 text_normalize and get_qwen_tokenizer(version='cosyvoice3') outputs "
                 "(tests/oracle/make_cv3_text_oracle.py)",
        **ran_on,
        "standin": STANDIN.name,
        "standin_sha256": sha,
        **cv2_oracle.official_cases(frontend, SENTENCES, PROMPT_TEXTS, INSTRUCT_TEXTS),
        "official_ids_standin": {"vocab_size": FULL_VOCAB, "sha256": padded_sha, **padded_ids},
    }
    OUT.write_text(json.dumps(reference, ensure_ascii=False, indent=1) + "\n")
    n_segments = sum(len(c["segments"]) for c in reference["cases"])
    print(f"wrote {OUT}: {len(SENTENCES)} texts, {n_segments} segments, {len(PROMPT_TEXTS)} prompts, "
          f"{len(INSTRUCT_TEXTS)} instructs, {len(reference['special_ids'])} special tokens")


if __name__ == "__main__":
    main()
