"""A stand-in for the tokenizer files of ``CosyVoice-BlankEN/`` (the Qwen2.5-0.5B tokenizer).

The release folder holds ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` (plus the LM's
``config.json``, ``generation_config.json`` and ``model.safetensors``). The real files cannot be shipped or
downloaded here, so :func:`write_tokenizer_standin` writes files in the same format: a byte-level BPE with
Qwen2's pre-tokenizer split and NFC normalisation, trained by the ``tokenizers`` library on a small built-in
Chinese and English text, followed by Qwen2's three special tokens. ``AutoTokenizer`` loads it as a Qwen2
tokenizer and CosyVoice's added tokens follow it, as with the real files. It is a stand-in: its ids are not the
real ones and it splits text into more pieces than the real 151,643-entry vocabulary does.

With ``official_ids=True`` the BPE vocabulary is padded to the real 151,643 entries with placeholder tokens that
no merge produces (so no text ever encodes to them): the special tokens then take their official ids
(``<|endoftext|>`` 151643, ``<|endofprompt|>`` 151646, ...), which the CosyVoice3 LM needs (it looks for
``<|endofprompt|>`` by that id).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .tokenizer import ENDOFTEXT, FAMILY_SPECIAL_TOKENS, QWEN_SPECIAL_TOKENS

# Qwen2's pre-tokenization pattern (transformers' Qwen2Tokenizer uses the same).
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_BASE_VOCAB = 151643  # ids of the real BPE vocabulary; <|endoftext|> is 151643
STANDIN_README = "README.md"
# Room left between the last id and ``vocab_size`` (the real release leaves 273 of 151,936).
_SPARE_IDS = 76
# Placeholder entries of an ``official_ids`` vocabulary: ASCII, so byte-level decoding maps them to themselves.
_PLACEHOLDER = "<|placeholder_{}|>"

_CORPUS_ZH = """\
收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。
希望你以后能够做得比我还好，今天的天气非常好，我们一起去公园散步吧。
在面对挑战时，他展现了非凡的勇气与智慧，大家都为他感到骄傲。
这家公司去年的收入增长了百分之十五，利润达到了三千五百万元。
会议将于明天上午九点半在北京举行，请各位准时参加。
我们需要买两公斤苹果、三瓶牛奶和一些面包，总共花了一百二十元。
他的电话号码是一三八零零一三八零零零，有事可以随时联系他。
二零二四年三月五日是星期二，气温负三点五摄氏度，北风三到四级。
人工智能技术正在改变我们的生活方式，语音合成就是其中一个例子。
请用四川话说这句话，然后再用广东话说一遍，最后用普通话总结。
春天来了，花儿开了，小鸟在树上唱歌，孩子们在草地上奔跑。
这本书一共有三百六十五页，我每天读十页，大约一个多月就能读完。
火车将在下午三点十五分到达上海站，请旅客们提前做好准备。
他笑着说：“你说得对，我们明天再试一次吧！”然后转身离开了。
这个房间的面积是二十五平方米，每个月的租金是四千五百元。
比赛的最终比分是三比二，主队在最后一分钟打进了决胜球。
医生建议他每天喝八杯水，早睡早起，并且坚持锻炼身体。
中国的首都是北京，上海是最大的城市，广州和深圳也很发达。
一年有十二个月，一个月大约有三十天，一天有二十四小时。
零一二三四五六七八九十百千万亿点负正年月日时分秒元角毛钱度米克升
你好，我是通义生成式语音大模型，请问有什么可以帮您的吗？
在他讲述那个荒诞故事的过程中，他突然停下来，因为他自己也被逗笑了。
"""

_CORPUS_EN = """\
The quick brown fox jumps over the lazy dog, and then it runs back into the forest.
On the fifth of January, twenty twenty four, at three thirty PM, I paid twelve dollars for three kilograms of apples.
Speech synthesis turns written text into natural sounding audio, one sentence at a time.
The meeting starts at nine o'clock tomorrow morning; please don't be late.
She said, "We'll try again next week," and closed the door behind her.
Our revenue grew by fifteen percent last year, reaching three point five million dollars.
Voice conversion keeps the words of the source speaker but changes the voice to the target speaker.
It is a truth universally acknowledged that a good model needs a good tokenizer.
What time is it? It's a quarter past seven in the evening, and the train has already left.
Hello, my name is Alex. I live in London and I work as an engineer at a small company.
The temperature dropped to minus five degrees Celsius, so we stayed at home and read books.
Please call me back at one two three, four five six, seven eight nine zero when you have time.
In the first chapter, the author describes a small village by the sea where everyone knows each other.
They're going to build a new bridge across the river, which will take about two years.
And then later on, fully acquiring that company, keeping management in line with the asset.
Numbers: one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand million.
"""


def standin_corpus() -> list[str]:
    """The built-in training text, one sentence a line (Chinese, then English)."""
    return [line for line in (_CORPUS_ZH + _CORPUS_EN).splitlines() if line.strip()]


def write_tokenizer_standin(out_dir: str | os.PathLike, vocab_size: int = 4096, *, official_ids: bool = False
                            ) -> Path:
    """Write ``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` and a README note into ``out_dir``.

    Parameters
    ----------
    out_dir : str or os.PathLike
        Folder to write (created if needed); the Qwen2 ``config.json`` is not written here.
    vocab_size : int
        The LM's text vocabulary (its embedding rows). Every id, the BPE vocabulary, Qwen2's 3 special tokens and
        the added tokens of either family (CosyVoice3's 278 new ones, which include CosyVoice2's 17), stays below
        it: the BPE takes at most ``vocab_size - 357`` entries (fewer where the built-in text runs out of merges;
        the real 151,643 at most).
    official_ids : bool
        Pad the BPE vocabulary with placeholders to the real 151,643 entries, so that every special token has
        its official id (``vocab_size`` at least 151,924, the ids CosyVoice3's tokenizer uses; the release's
        LM has 151,936).

    Returns
    -------
    pathlib.Path
        ``out_dir``. Training is single-pass and deterministic: the same arguments give the same files.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    most_added = max(len(set(added) - set(QWEN_SPECIAL_TOKENS)) for added in FAMILY_SPECIAL_TOKENS.values())
    n_added = len(QWEN_SPECIAL_TOKENS) + most_added
    least = QWEN2_BASE_VOCAB + n_added if official_ids else 256 + n_added + _SPARE_IDS + 1
    if vocab_size < least:
        what = "151,643 BPE" if official_ids else "256 byte"
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the {what} tokens and {n_added} special ones "
                         f"(at least {least})")
    bpe_size = min(vocab_size - n_added - _SPARE_IDS, QWEN2_BASE_VOCAB)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(standin_corpus(), trainer=trainer)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out))  # vocab.json + merges.txt ("#version: 0.2" header), the Qwen2 layout
    n_trained = tok.get_vocab_size()
    n_bpe = _pad_vocab(out / "vocab.json", QWEN2_BASE_VOCAB) if official_ids else n_trained
    write_tokenizer_config(out, n_bpe)
    specials = ", ".join(f"{t} = {n_bpe + i}" for i, t in enumerate(QWEN_SPECIAL_TOKENS))
    if official_ids:
        body = (f"A byte-level BPE of {n_trained} entries in the Qwen2 tokenizer format, trained by cosyvoice_triton "
                f"on a small built-in Chinese and English text, padded with {n_bpe - n_trained} placeholder entries "
                f"that no text encodes to, then Qwen2's special tokens ({specials}). CosyVoice2 adds its 17 tokens "
                f"after these, CosyVoice3 its 278, at their official ids, every id below {vocab_size}. The text's ids "
                "are not the real Qwen2.5 ids: use the release's CosyVoice-BlankEN folder for real speech.\n")
    else:
        body = (f"A byte-level BPE of {n_bpe} entries in the Qwen2 tokenizer format, trained by cosyvoice_triton on a "
                f"small built-in Chinese and English text, then Qwen2's special tokens ({specials}). CosyVoice2 adds "
                f"its 17 tokens after these, so every id is below {vocab_size}. The ids are not the real Qwen2.5 ids: "
                "use the release's CosyVoice-BlankEN folder for real speech.\n")
    (out / STANDIN_README).write_text("# Stand-in tokenizer (not the real CosyVoice-BlankEN)\n\n" + body)
    return out


def _pad_vocab(vocab_path: Path, size: int) -> int:
    """Append placeholder entries to ``vocab.json`` until it has ``size`` ids; returns ``size``."""
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    if len(vocab) > size or sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"{vocab_path}: {len(vocab)} ids, not 0 .. n-1 with n <= {size}")
    vocab.update({_PLACEHOLDER.format(i): i for i in range(len(vocab), size)})
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    return size


def write_tokenizer_config(out_dir: str | os.PathLike, n_bpe: int) -> Path:
    """``tokenizer_config.json`` of a Qwen2 tokenizer folder whose byte-level BPE has ``n_bpe`` entries: Qwen2's
    three special tokens follow it (ids ``n_bpe`` ...), as in the release's ``CosyVoice-BlankEN``."""
    out = Path(out_dir)
    added = {
        str(n_bpe + i): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True
        }
        for i, t in enumerate(QWEN_SPECIAL_TOKENS)
    }  # fmt: skip
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out / "tokenizer_config.json"
