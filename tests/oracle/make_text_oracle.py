"""Regenerate tests/fixtures/text_oracle/ with the official CosyVoice2 text front end.

Runs the official ``CosyVoiceFrontEnd.text_normalize`` and ``get_qwen_tokenizer`` (a checkout of
FunAudioLLM/CosyVoice) over the sentences below, on the stand-in tokenizer files written by
``cosyvoice_triton.frontend.text.write_tokenizer_standin`` (copied into the fixture folder), and writes
``official.json``. The official front end is built without its ONNX / torch models: ``__new__`` plus the
attributes that ``text_normalize`` and ``_extract_text_token`` read, set as its ``__init__`` sets them on the
``wetext`` path (``ttsfrd`` absent). Modules that the import chain needs but this check does not use
(whisper, tiktoken, torchaudio) are stubbed.

Normaliser: the official requirements pin ``wetext==0.0.4``, whose ``Normalizer`` downloads its FSTs with
``modelscope.snapshot_download("pengzhendong/wetext")``. Here that call is stubbed to return the ``fsts/``
folder of the installed ``wetext`` wheel (0.0.7 to 0.1.0 ship that hub snapshot; this project pins 0.1.0), so the
official code runs the official 0.0.4 runtime on FSTs from a registry package. Install the runtime beside the
project's with ``pip install --no-deps --target DIR wetext==0.0.4`` and pass ``--wetext-runtime DIR``.

    python tests/oracle/make_text_oracle.py --official /tmp/cosyvoice_official --wetext-runtime /tmp/wetext004
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "text_oracle"
VOCAB_SIZE = 4096

SENTENCES = [
    # Chinese: dates, times, money, percentages, units, phone numbers, decimals, signs, ratios, ranges
    "今天是2024年3月5日，气温-3.5°C，花了￥120.50元，增长了15%。",
    "会议定于2025-07-01上午9:30在3号会议室召开，预计持续2个小时。",
    "这辆车的最高时速是240km/h，百公里加速只需要4.2秒，售价38.8万元。",
    "他的电话号码是13800138000，办公室分机是8021。",
    "这个房间的面积是25m²，体积大约是75m³。",
    "比赛的最终比分是3:2，主队在第89分钟打进了决胜球。",
    "请在1/4小时内完成第1到第10题，然后休息5分钟。",
    "股价从12.35元涨到了15.60元，涨幅约为26.3%。",
    "1998年到2008年之间，这座城市的人口翻了一番。",
    "这本书一共有365页，我每天读10页（周末读20页），大约一个多月就能读完。",
    "【通知】明天下午三点开会——请大家准时参加，不要迟到，",
    "他笑着说：“你说得对，我们明天再试一次吧！”然后转身离开了。",
    "我用iPhone 15 Pro拍了100张照片，又用 Python 3.11 写了一个脚本。",
    "第一行文字\n第二行文字 - 第三行文字.",
    "在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。",
    "在面对挑战时，他展现了非凡的<strong>勇气</strong>与<strong>智慧</strong>[breath]。",
    "<laughter>这真是太好笑了</laughter>，我从来没有听过这么有趣的故事。",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐，笑容如花儿般绽放。"
    "春天来了，花儿开了，小鸟在树上唱歌，孩子们在草地上奔跑，老人们在树荫下下棋聊天。"
    "夏天的傍晚，凉风习习，人们三三两两地走出家门，在河边散步，享受一天中最惬意的时光。"
    "秋天是收获的季节，田野里一片金黄，农民伯伯脸上洋溢着丰收的喜悦。"
    "冬天虽然寒冷，但是雪花飘落的时候，整个世界都变得安静而美好。",
    "人工智能技术在2023年取得了突破性进展；大语言模型的参数量从70亿增长到了1750亿！"
    "与此同时，语音合成的自然度也大幅提升，平均意见得分达到了4.5分？"
    "专家预计，到2030年，全球人工智能市场规模将超过15000亿美元，年均增长率约为37%。"
    "不过，也有人担心技术发展过快会带来新的问题，比如隐私泄露、就业冲击等。",
    "  前后都有空格的句子，后面还有标点、  ",
    "你好，我是通义生成式语音大模型，请问有什么可以帮您的吗？",
    # English: dates, times, money, percentages, units, ordinals, abbreviations, leftover digits
    "On Jan. 5, 2024 at 3:30 pm, I paid $12.50 for 3 kg of apples, 25% off.",
    "The meeting is on 2025-07-01 at 9:30 AM in room 301.",
    "Dr. Smith lives at 221B Baker Street and owns 2 cats and 1 dog.",
    "Our revenue grew by 15.5% to $3.5 million in Q3, up from £2.1 million in 2022.",
    "The 1st, 2nd and 3rd places went to teams from the 21st century league.",
    "It is -5°C outside, the wind blows at 30 km/h, and the lake is 120 m deep.",
    "Call me at 555-0123 or (800) 555-0199 before 10 p.m., please!",
    'She said, "We\'ll try again next week." Then she closed the door.',
    "And then later on, fully acquiring that company. So keeping management in line, interest in line with the "
    "asset that's coming into the family is a reason why sometimes we don't buy the whole thing. In 2019 we bought "
    "3 companies for a total of $450 million; in 2020 we bought 7 more. Our investors, who had doubts at first, "
    "were happy with a 12% return! What will happen next year? Nobody knows, but we plan to grow by at least 20 "
    "percent; our team of 250 engineers is ready. Thank you all for listening, and see you at the next meeting "
    "on March 3rd.",
    "Hello world",
    "He shouted [laughter] and then took a deep [breath] before saying <strong>no</strong>.",
    "Version 2.0 of the model has 500000000 parameters and was trained on 170000 hours of speech",
    "Wait... what? Really?! Yes - really; absolutely: 100 percent.",
    # Skipped by the official front end: the text holds <| and |>
    "用四川话说这句话<|endofprompt|>收到好友从远方寄来的2份生日礼物。",
]
PROMPT_TEXTS = [
    "希望你以后能够做的比我还好呦。",
    "That's the 2nd time I've seen him this week, at 7:45 am.",
]
INSTRUCT_TEXTS = [
    "用四川话说这句话<|endofprompt|>",
    "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
    "Speak slowly and gently, with a smile.<|endofprompt|>",
]


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def arguments(doc: str) -> argparse.Namespace:
    """The oracle scripts' command line (``--official``, ``--wetext-runtime``); puts the project on ``sys.path``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--official", required=True, type=Path, help="checkout of FunAudioLLM/CosyVoice")
    parser.add_argument("--wetext-runtime", required=True, type=Path, help="pip --target folder with wetext==0.0.4")
    sys.path.insert(0, str(ROOT))
    return parser.parse_args()


def official_frontend(official: Path, wetext_runtime: Path, standin: Path, version: str = "cosyvoice2"):
    """The official ``CosyVoiceFrontEnd`` (text side only, see the module docstring) with the tokenizer of
    ``get_qwen_tokenizer(standin, skip_special_tokens=True, version=version)``, and what it ran on (for the meta)."""
    # The FSTs of the installed wetext wheel, found before the 0.0.4 runtime shadows the package name.
    fst_dir = Path(importlib.util.find_spec("wetext").origin).parent / "fsts"
    wheel_version = metadata.version("wetext")

    import transformers  # noqa: F401  (before the stubs: it probes for torchaudio at import)

    sys.path.insert(0, str(wetext_runtime))
    sys.path.insert(0, str(official))
    _stub("modelscope", snapshot_download=lambda repo_id, *a, **k: str(fst_dir))
    _stub("whisper", log_mel_spectrogram=None)
    _stub("whisper.tokenizer", Tokenizer=object)
    _stub("tiktoken", Encoding=object)
    torchaudio = _stub("torchaudio")
    torchaudio.compliance = _stub("torchaudio.compliance")
    torchaudio.compliance.kaldi = _stub("torchaudio.compliance.kaldi")

    import inflect
    import wetext
    from cosyvoice.cli.frontend import CosyVoiceFrontEnd
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    runtime_version = None
    for dist in metadata.distributions(path=[str(wetext_runtime)]):
        if dist.metadata["Name"] == "wetext":
            runtime_version = dist.version
    assert Path(wetext.__file__).is_relative_to(wetext_runtime), wetext.__file__

    frontend = CosyVoiceFrontEnd.__new__(CosyVoiceFrontEnd)
    frontend.tokenizer = get_qwen_tokenizer(token_path=str(standin), skip_special_tokens=True, version=version)
    frontend.allowed_special = "all"
    frontend.inflect_parser = inflect.engine()
    frontend.zh_tn_model = wetext.Normalizer(remove_erhua=False)
    frontend.en_tn_model = wetext.Normalizer()
    frontend.text_frontend = "wetext"

    commit = subprocess.run(
        ["git", "-C", str(official), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    fst_files = sorted(p for p in fst_dir.rglob("*.fst") if "/tn/" in p.as_posix())
    ran_on = {
        "official_commit": commit or "ace7c47 (no git metadata in the checkout)",
        "wetext_runtime": runtime_version,
        "wetext_fsts_from": f"wetext {wheel_version} wheel",
        "fst_sha256": {p.relative_to(fst_dir).as_posix(): _sha256(p) for p in fst_files},
        "inflect": metadata.version("inflect"),
        "transformers": metadata.version("transformers"),
        "tokenizers": metadata.version("tokenizers"),
    }
    return frontend, ran_on


def official_cases(frontend, sentences, prompt_texts, instruct_texts) -> dict:
    """What the official front end makes of each text: its segments, their tokens, the unsplit normalised text and
    the tokens of the raw text; of each prompt text its unsplit normalised form and tokens; of each instruct text
    its tokens (not normalised, as ``inference_instruct2``); and the tokenizer's length and special ids."""

    def encode(text: str) -> list[int]:
        return [int(i) for i in frontend.tokenizer.encode(text, allowed_special="all")]

    cases = []
    for text in sentences:
        segments = frontend.text_normalize(text, split=True, text_frontend=True)
        cases.append(
            {
                "text": text,
                "segments": segments,
                "tokens": [encode(s) for s in segments],
                "unsplit": frontend.text_normalize(text, split=False, text_frontend=True),
                "raw_tokens": encode(text),
            }
        )
    prompts = []
    for text in prompt_texts:
        normalized = frontend.text_normalize(text, split=False, text_frontend=True)
        prompts.append({"text": text, "normalized": normalized, "tokens": encode(normalized)})
    tok = frontend.tokenizer.tokenizer
    added = frontend.tokenizer.special_tokens["additional_special_tokens"]
    return {
        "tokenizer_len": len(tok),
        "special_ids": {t: int(tok.convert_tokens_to_ids(t)) for t in added},
        "cases": cases,
        "prompts": prompts,
        "instructs": [{"text": text, "tokens": encode(text)} for text in instruct_texts],
    }


def main() -> None:
    args = arguments(__doc__)
    from cosyvoice_triton.frontend.text import write_tokenizer_standin

    standin = OUT / f"standin_{VOCAB_SIZE}"
    if standin.exists():
        shutil.rmtree(standin)
    write_tokenizer_standin(standin, VOCAB_SIZE)
    frontend, ran_on = official_frontend(args.official, args.wetext_runtime, standin)

    reference = {
        "about": "official CosyVoice2 text_normalize and get_qwen_tokenizer outputs (tests/oracle/make_text_oracle.py)",
        **ran_on,
        "standin_vocab_size": VOCAB_SIZE,
        "standin_sha256": {p.name: _sha256(p) for p in sorted(standin.iterdir())},
        **official_cases(frontend, SENTENCES, PROMPT_TEXTS, INSTRUCT_TEXTS),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "official.json").write_text(json.dumps(reference, ensure_ascii=False, indent=1) + "\n")
    n_segments = sum(len(c["segments"]) for c in reference["cases"])
    print(f"wrote {OUT / 'official.json'}: {len(SENTENCES)} texts, {n_segments} segments, {len(PROMPT_TEXTS)} prompts")


if __name__ == "__main__":
    main()
