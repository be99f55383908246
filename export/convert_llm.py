"""Convert the CosyVoice2 LM (llm.pt + CosyVoice-BlankEN/) for the TensorRT-LLM backend, and build its engine.

    python export/convert_llm.py --model-dir /models/CosyVoice2-0.5B --out build/llm_hf --verify
    python export/convert_llm.py --model-dir /models/CosyVoice2-0.5B --out build/llm_hf --build-engine
    python export/convert_llm.py --model-dir models/cosyvoice2-demo-tiny --out build/llm_hf --dry-run

Step 1 (anywhere, CPU): a Hugging Face Qwen2ForCausalLM folder with one merged vocabulary (text ids, the speech
tokens, three stop ids, sos, task id; lm_head = llm_decoder; embedding_bias.safetensors carries the decoder's bias,
which the engine's lm_head cannot), its tokenizer and cosyvoice_vocab.json. --verify loads it with transformers and
compares greedy decoding and the speech log-probabilities with the PyTorch LM. The model folder is only read.
Step 2 (--build-engine, NGC -trtllm- image with a GPU): TensorRT-LLM's checkpoint conversion and trtllm-build into
--engine-dir (default build/engines/llm, where `render.py --set lm_backend=tensorrtllm` points the tensorrt_llm
model), plus the vocabulary, bias and tokenizer files. Without TensorRT-LLM or a GPU the build is skipped and the
reason printed (exit 0; --require-engine makes it an error). The library is cosyvoice_triton.export.trtllm.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from cosyvoice_triton.errors import CosyVoiceError
from cosyvoice_triton.export.trtllm import (
    DTYPES,
    VOCAB_FILE,
    EngineOptions,
    build_llm_engine,
    convert_llm,
    read_vocab,
    verify_conversion,
)

log = logging.getLogger("convert_llm")
SKIPPED_EXIT = 3  # --require-engine and no toolchain


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="CosyVoice2 folder (cosyvoice2.yaml, llm.pt, "
                   "CosyVoice-BlankEN/)")
    p.add_argument("--out", type=Path, default=Path("build/llm_hf"), help="merged Hugging Face folder (default: "
                   "build/llm_hf)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="weights of the merged folder (default: auto = llm.pt's dtype)")
    p.add_argument("--overwrite", action="store_true", help="convert again over a folder this tool wrote")
    p.add_argument("--verify", action="store_true",
                   help="compare the converted folder (transformers) with the PyTorch LM on a random prompt")
    p.add_argument("--verify-steps", type=int, default=30, help="greedy steps of --verify (default: 30)")
    eng = p.add_argument_group("engine (TensorRT-LLM, NGC -trtllm- image with a GPU)")
    eng.add_argument("--build-engine", action="store_true", help="TensorRT-LLM checkpoint + trtllm-build")
    eng.add_argument("--dry-run", action="store_true", help="print the engine commands, build nothing")
    eng.add_argument("--require-engine", action="store_true",
                     help=f"exit {SKIPPED_EXIT} instead of 0 when the engine build is skipped (no TensorRT-LLM / GPU)")
    eng.add_argument("--checkpoint-dir", type=Path, default=Path("build/trtllm_checkpoint"),
                     help="TensorRT-LLM checkpoint (default: build/trtllm_checkpoint)")
    eng.add_argument("--engine-dir", type=Path, default=Path("build/engines/llm"),
                     help="engine + serving files (default: build/engines/llm, the rendered config's gpt_model_path "
                          "with --engine-dir build/engines)")
    defaults = EngineOptions()
    eng.add_argument("--engine-dtype", choices=("bfloat16", "float16", "float32"), default=defaults.dtype)
    eng.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                     help=f"at least the served max_active_requests (default: {defaults.max_batch_size})")
    eng.add_argument("--max-input-len", type=int, default=defaults.max_input_len)
    eng.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len)
    eng.add_argument("--max-num-tokens", type=int, default=defaults.max_num_tokens)
    return p


def _reusable(out: Path, model_dir: Path, dtype: str) -> bool:
    """A folder converted from the same llm.pt already (same folder, same size, the dtype asked for)."""
    try:
        doc = json.loads((out / VOCAB_FILE).read_text(encoding="utf-8"))
        read_vocab(out)
    except (OSError, ValueError, CosyVoiceError):
        return False
    src = doc.get("source", {})
    return (src.get("model_dir") == str(model_dir.resolve()) and (model_dir / "llm.pt").is_file()
            and src.get("llm_pt_bytes") == (model_dir / "llm.pt").stat().st_size
            and dtype in ("auto", doc.get("dtype")))


def _verify(args) -> bool:
    import numpy as np

    from cosyvoice_triton.config import ModelConfig
    from cosyvoice_triton.models.llm import load_llm

    vocab = read_vocab(args.out)
    dtype = json.loads((args.out / VOCAB_FILE).read_text(encoding="utf-8"))["dtype"]
    lm = load_llm(args.model_dir, ModelConfig.from_yaml(args.model_dir / "cosyvoice2.yaml"))
    rng = np.random.default_rng(0)
    text = rng.integers(0, vocab.text_vocab_size, 12)
    prompt_text = rng.integers(0, vocab.text_vocab_size, 6)
    prompt_speech = rng.integers(0, vocab.speech_token_size, 40)
    log.info("verify: greedy %d steps + speech log-probabilities, PyTorch Qwen2LM vs transformers Qwen2ForCausalLM "
             "on %s (prompt of %d merged ids)", args.verify_steps, args.out,
             len(vocab.input_ids(text, prompt_text, prompt_speech)))
    r = verify_conversion(args.out, lm, text, prompt_text, prompt_speech, steps=args.verify_steps)
    tol = 1e-3 if dtype == "float32" else 0.25  # reduced-precision weights move the log-probabilities
    ok = r["max_abs_logp_diff"] <= tol and r["text_mass"] == 0.0 and (r["greedy_equal"] or dtype != "float32")
    log.info("verify: max |log p| difference %.2e (bar %.2g, weights %s), greedy tokens equal: %s (%d tokens), "
             "largest probability of a non-speech id: %.1e -> %s", r["max_abs_logp_diff"], tol, dtype,
             r["greedy_equal"], len(r["tokens"]), r["text_mass"], "OK" if ok else "FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.build_engine and args.dry_run:
        parser.error("--build-engine and --dry-run exclude each other")
    if args.verify_steps < 1:
        parser.error(f"--verify-steps must be >= 1, got {args.verify_steps}")
    try:  # checks the engine settings (each >= 1, room for output after the input)
        options = EngineOptions(args.engine_dtype, args.max_batch_size, args.max_input_len, args.max_seq_len,
                                args.max_num_tokens)
    except CosyVoiceError as exc:
        parser.error(f"{exc} (--{str(exc).split()[0].replace('_', '-')})")
    try:
        if not args.overwrite and args.model_dir.is_dir() and _reusable(args.out, args.model_dir, args.dtype):
            log.info("%s: converted from this llm.pt already (--overwrite to convert again)", args.out)
        else:
            convert_llm(args.model_dir, args.out, dtype=args.dtype, overwrite=args.overwrite, progress=log.info)
        if args.verify and not _verify(args):
            return 1
        if args.build_engine or args.dry_run:
            result = build_llm_engine(args.out, args.checkpoint_dir, args.engine_dir, options, dry_run=args.dry_run,
                                      progress=log.info)
            for cmd in result.commands:
                log.info("%s %s", "would run:" if result.status != "built" else "ran:", shlex.join(cmd))
            if result.status == "skipped":
                log.info("engine build SKIPPED: %s. Nothing was built; build it on the serving GPU in the NGC image "
                         "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3 (README, 'TensorRT-LLM engine').",
                         result.reason)
                return SKIPPED_EXIT if args.require_engine else 0
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
