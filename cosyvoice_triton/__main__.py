"""``cosyvoice-triton`` (``python -m cosyvoice_triton``): every path of the project from one command line.

in process:   demo-model, vc, tts, speaker, bench, bench-preprocess
served:       serve, demo, supervise, render, gateway, client, rollout
measured:     loadtest, loadtest-live, loadtest-rollout, soak, bench-tts, bench-peer, bench-gpu, bench-incremental,
              bench-schedule, bench-prompt-cache, bench-neighbour, bench-server-overhead
exported:     export-onnx, quantize, quality, engines, convert-llm

examples:
  cosyvoice-triton demo-model --size tiny --out models/cosyvoice2-demo-tiny
  cosyvoice-triton tts --model-dir models/cosyvoice2-demo-tiny --text "Hello." --prompt-audio voice.wav -o hi.wav
  cosyvoice-triton serve --model-dir models/cosyvoice2-demo-tiny          # Triton + the gateway on :8080
  cosyvoice-triton client tts --text "Hello there." --speaker alice --stream -o hi.wav
  cosyvoice-triton loadtest --config tiny --mode tts
  cosyvoice-triton export-onnx --model-dir models/cosyvoice2-demo-tiny --out build/onnx/fp32

``cosyvoice-triton COMMAND --help`` shows each command's options. The commands that compute in this process choose
their threads from the free cores unless told (--threads, COSYVOICE_THREADS; cosyvoice_triton.threads).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .commands import PASSTHROUGH, add_passthrough
from .commands import run as run_passthrough
from .errors import CosyVoiceError
from .threads import prepare_environment

#: commands that compute with torch in this process (or its workers): the OpenMP wait policy is set before torch loads
IN_PROCESS = {"vc", "tts", "speaker", "bench", "bench-preprocess"}


def _cmd_demo_model(args: argparse.Namespace) -> int:
    if args.family == "cosyvoice3":
        from .models.cosyvoice3.demo import write_demo_model3 as write_demo_model
    else:
        from .models.demo import write_demo_model

    out = write_demo_model(args.out, size=args.size, seed=args.seed)
    print(f"{args.family} demo model ({args.size}, random weights) written to {out}")
    return 0


def _cmd_vc(args: argparse.Namespace) -> int:
    import soundfile as sf

    from .pipeline import CosyVoice2, StageTimer

    cv3 = _is_cosyvoice3(args.model_dir)
    t0 = time.perf_counter()
    if cv3:
        from .models.cosyvoice3.pipeline import CosyVoice3

        model = CosyVoice3.from_pretrained(args.model_dir, device=args.device, tts=False,
                                           threads=args.threads or None)
    else:
        model = CosyVoice2.from_pretrained(args.model_dir, device=args.device, threads=args.threads or None)
    load_s = time.perf_counter() - t0
    timer = StageTimer()
    t0 = time.perf_counter()
    if cv3:  # its vocoder's noise is a fixed buffer: no seed
        wave = model.vc(args.source, args.prompt, stream=args.stream, timer=timer)
    else:
        wave = model.convert(args.source, args.prompt, stream=args.stream, seed=args.seed, timer=timer)
    total = time.perf_counter() - t0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    sr = model.config.sample_rate
    sf.write(out, wave, sr, subtype="PCM_16")
    seconds = len(wave) / sr
    print(f"wrote {out}: {seconds:.2f} s at {sr} Hz (model load {load_s:.2f} s)")
    print(f"conversion {total:.2f} s, real-time factor {total / max(seconds, 1e-9):.3f}")
    for name, s in timer.seconds.items():
        print(f"  {name:<18} {s * 1000:9.1f} ms")
    return 0


def _cmd_tts(args: argparse.Namespace) -> int:
    import numpy as np
    import soundfile as sf

    from .pipeline import CosyVoice2, StageTimer

    text = args.text if args.text is not None else Path(args.text_file).read_text(encoding="utf-8")
    timer = StageTimer()
    t0 = time.perf_counter()
    if _is_cosyvoice3(args.model_dir):
        from .frontend.text.cosyvoice3 import resolve_mode
        from .models.cosyvoice3.pipeline import CosyVoice3

        model = CosyVoice3.from_pretrained(args.model_dir, device=args.device, speaker_dir=args.speaker_dir,
                                           threads=args.threads or None)
        mode = resolve_mode(args.mode, args.prompt_text, args.instruct, speaker=bool(args.speaker))
        chunks = model.tts_stream(mode, text, stream=args.stream, seed=args.seed, timer=timer,
                                  prompt_wav=args.prompt_audio, prompt_text=args.prompt_text,
                                  instruct_text=args.instruct, speaker_id=args.speaker)
    else:
        model = CosyVoice2.from_pretrained(args.model_dir, device=args.device, tts=True,
                                           speaker_dir=args.speaker_dir, threads=args.threads or None)
        chunks = None
    load_s = time.perf_counter() - t0
    sr = model.config.sample_rate
    to_stdout = args.output == "-"
    sink = None if to_stdout else sf.SoundFile(_out_path(args.output), "w", samplerate=sr, channels=1,
                                                subtype="PCM_16")
    samples, first = 0, None
    t0 = time.perf_counter()
    if chunks is None:
        chunks = model.tts_stream(text, stream=args.stream, seed=args.seed, timer=timer,
                                  prompt_audio=args.prompt_audio, prompt_text=args.prompt_text,
                                  instruct=args.instruct, speaker_id=args.speaker, mode=args.mode)
    try:
        for chunk in chunks:
            first = first if first is not None else time.perf_counter() - t0
            samples += len(chunk)
            if to_stdout:  # raw 16-bit little-endian mono PCM for a player (e.g. `| aplay -f S16_LE -r 24000`)
                sys.stdout.buffer.write((np.clip(chunk, -1, 1) * 32767).astype("<i2").tobytes())
                sys.stdout.buffer.flush()
            else:
                sink.write(chunk)
    finally:
        if sink is not None:
            sink.close()
    total = time.perf_counter() - t0
    seconds = samples / sr
    report = sys.stderr if to_stdout else sys.stdout
    where = "stdout (raw s16le mono)" if to_stdout else args.output
    print(f"wrote {where}: {seconds:.2f} s at {sr} Hz (model load {load_s:.2f} s)", file=report)
    print(f"first audio after {first * 1000:.0f} ms ({'streaming' if args.stream else 'first segment'}); "
          f"total {total:.2f} s, real-time factor {total / max(seconds, 1e-9):.3f}", file=report)
    for name, s in timer.seconds.items():
        print(f"  {name:<18} {s * 1000:9.1f} ms", file=report)
    return 0


def _is_cosyvoice3(model_dir: str) -> bool:
    """Whether the folder is a CosyVoice3 one (the official ``AutoModel`` rule: its yaml); other folders go to the
    CosyVoice2 class, which names what it misses."""
    from .family import COSYVOICE3, model_family

    try:
        return model_family(model_dir) == COSYVOICE3
    except CosyVoiceError:
        return False


def _out_path(path: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _cmd_speaker(args: argparse.Namespace) -> int:
    from .speakers import SpeakerStore

    if args.action != "list" and not args.id:
        raise CosyVoiceError(f"speaker {args.action} needs a speaker id")
    if args.action == "add":
        if not args.prompt_audio or not args.model_dir:
            raise CosyVoiceError("speaker add needs --model-dir and --prompt-audio")
        if _is_cosyvoice3(args.model_dir):
            from .models.cosyvoice3.pipeline import CosyVoice3 as model_class
        else:
            from .pipeline import CosyVoice2 as model_class
        model = model_class.from_pretrained(args.model_dir, tts=args.prompt_text is not None,
                                            speaker_dir=args.speaker_dir)
        prompt = model.register_speaker(args.id, args.prompt_audio, prompt_text=args.prompt_text)
        print(f"registered {args.id!r} for {prompt.family}: {len(prompt.prompt_tokens)} prompt tokens, "
              f"{len(prompt.prompt_text_tokens)} transcript tokens, in {args.speaker_dir}")
        return 0
    store = SpeakerStore(args.speaker_dir)
    if args.action == "list":
        for speaker_id in store.list():
            print(speaker_id)
    else:
        store.delete(args.id)
        print(f"deleted {args.id!r}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench.vc import run_core_bench

    run_core_bench(args.model_dir, source=args.source, prompt=args.prompt, threads=args.threads,
                   repeats=args.repeats)
    return 0


def _cmd_bench_preprocess(args: argparse.Namespace) -> int:
    from .bench.vc import run_preprocess_bench

    run_preprocess_bench(args.model_dir, source=args.source, prompt=args.prompt, repeats=args.repeats,
                         warmup=args.warmup, threads=args.threads)
    return 0


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: COSYVOICE_THREADS, else chosen from the free cores)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-triton", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo-model", help="write a random-weight model folder in the official layout")
    d.add_argument("--out", required=True, help="folder to write")
    d.add_argument("--size", choices=("tiny", "full"), default="tiny",
                   help="tiny dims or the release's dims (CosyVoice2-0.5B, Fun-CosyVoice3-0.5B)")
    d.add_argument("--family", choices=("cosyvoice2", "cosyvoice3"), default="cosyvoice2",
                   help="model family: cosyvoice2.yaml (default) or cosyvoice3.yaml layout")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_cmd_demo_model)

    v = sub.add_parser("vc", help="in-process voice conversion (the official VC path)")
    v.add_argument("--model-dir", required=True, help="CosyVoice2 or CosyVoice3 folder (a release or a demo)")
    v.add_argument("--source", required=True, help="speech whose content is kept (wav/flac/ogg)")
    v.add_argument("--prompt", required=True, help="speech of the target voice (wav/flac/ogg)")
    v.add_argument("-o", "--output", required=True, help="output wav (24 kHz, 16-bit)")
    v.add_argument("--stream", action="store_true", help="official streaming schedule (chunked flow + HiFT)")
    v.add_argument("--seed", type=int, default=0, help="seed of HiFT's source noise")
    _add_runtime_args(v)
    v.set_defaults(func=_cmd_vc)

    t = sub.add_parser("tts", help="in-process text to speech (zero-shot, cross-lingual, instruct, registered speaker)")
    t.add_argument("--model-dir", required=True,
                   help="CosyVoice2 or CosyVoice3 folder with llm.pt and CosyVoice-BlankEN/")
    text = t.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="text to speak (any length: split as the official front end splits)")
    text.add_argument("--text-file", help="UTF-8 file with the text to speak")
    t.add_argument("--prompt-audio", help="speech of the target voice (wav/flac/ogg)")
    t.add_argument("--prompt-text", help="transcript of the prompt audio (zero-shot); without it: cross-lingual")
    t.add_argument("--instruct", help="instruction, e.g. 'Speak slowly and happily' (instruct mode)")
    t.add_argument("--speaker", help="a registered speaker id instead of --prompt-audio (see `speaker add`)")
    t.add_argument("--speaker-dir", default="build/speakers", help="where registered speakers are kept")
    t.add_argument("--mode", choices=("zero_shot", "cross_lingual", "instruct"), default=None,
                   help="default: instruct with --instruct, zero_shot with a transcript, else cross_lingual")
    t.add_argument("-o", "--output", required=True, help="output wav (24 kHz, 16-bit), or - for raw PCM on stdout")
    t.add_argument("--stream", action="store_true", help="official streaming schedule, audio written as it comes")
    t.add_argument("--seed", type=int, default=0, help="seed of the LM's sampling and HiFT's source noise")
    _add_runtime_args(t)
    t.set_defaults(func=_cmd_tts)

    sp = sub.add_parser("speaker", help="register, list or delete speakers (prompt computed once, reused)")
    sp.add_argument("action", choices=("add", "list", "delete"))
    sp.add_argument("id", nargs="?", help="speaker id: 1-64 of A-Z a-z 0-9 _ . - (not starting with .)")
    sp.add_argument("--model-dir", help="CosyVoice2 or CosyVoice3 folder (add; the speaker is for that family)")
    sp.add_argument("--prompt-audio", help="speech of the speaker (add)")
    sp.add_argument("--prompt-text", help="its transcript (add; enables zero-shot for this speaker)")
    sp.add_argument("--speaker-dir", default="build/speakers", help="where registered speakers are kept")
    sp.set_defaults(func=_cmd_speaker)

    b = sub.add_parser("bench", help="per-stage timings, GFLOP/s against a GEMM ceiling, peak memory")
    b.add_argument("--model-dir", required=True)
    b.add_argument("--source", default=None, help="default: the bundled 5 s sample")
    b.add_argument("--prompt", default=None, help="default: the bundled 3 s sample")
    b.add_argument("--threads", type=int, default=0, help="0: COSYVOICE_THREADS, else chosen from the free cores")
    b.add_argument("--repeats", type=int, default=2, help="timed runs after one warm-up")
    b.set_defaults(func=_cmd_bench)

    bp = sub.add_parser("bench-preprocess", help="cost of the preprocess stage's optional VAD trim and prompt denoise")
    bp.add_argument("--model-dir", default=None, help="whose mel settings (default: the release's)")
    bp.add_argument("--source", default=None, help="default: the bundled 5 s sample")
    bp.add_argument("--prompt", default=None, help="default: the bundled 3 s sample")
    bp.add_argument("--repeats", type=int, default=20, help="timed calls per variant after the warm-up")
    bp.add_argument("--warmup", type=int, default=2)
    bp.add_argument("--threads", type=int, default=1, help="torch intra-op threads (Silero VAD runs on them)")
    bp.set_defaults(func=_cmd_bench_preprocess)

    from .serving.launch.rollout import add_parser as add_rollout_parser

    add_rollout_parser(sub)  # rollout status|stage N|canary PERCENT|promote|rollback
    add_passthrough(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:  # its own parser reads the rest, --help included
        if argv[0].startswith("bench-"):
            prepare_environment()
        return run_passthrough(PASSTHROUGH[argv[0]][1], argv[1:], prog=argv[0])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in IN_PROCESS:
        prepare_environment(getattr(args, "threads", 0) or None)
    try:
        return args.func(args)
    except CosyVoiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
