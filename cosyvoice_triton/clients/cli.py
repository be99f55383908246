"""``cosyvoice-triton client``: the served CosyVoice models from the command line (:mod:`.client`, :mod:`.live`).

    cosyvoice-triton client --source a.wav --prompt voice.wav -o out.wav          # vc (the default)
    cosyvoice-triton client vc --source a.wav b.wav --prompt voice.wav -o out_dir/ --protocol grpc
    cosyvoice-triton client vc --source a.wav --speaker alice --stream -o - | aplay -f S16_LE -r 24000
    cosyvoice-triton client tts --text "Hello there." --prompt voice.wav --prompt-text "..." -o hi.wav
    cosyvoice-triton client tts --text "Hello there." --speaker alice --stream -o hi.wav
    cosyvoice-triton client speaker add alice --prompt voice.wav [--prompt-text "..."]
    cosyvoice-triton client speaker list | speaker delete alice
    cosyvoice-triton client speaker add alice --prompt voice.wav --prompt-text "..." --family cosyvoice3
    cosyvoice-triton client tts --text "Hello there." --speaker alice --family cosyvoice3 --stream -o hi.wav
    cosyvoice-triton client tokens --audio a.wav [-o tokens.npy]        # 25 Hz speech tokens
    cosyvoice-triton client embedding --audio voice.wav [-o emb.npy]    # 192-dim CAM++ embedding
    cosyvoice-triton client tts --text "Hi." --prompt voice.wav --priority 1 -o hi.wav
    arecord -f S16_LE -r 16000 | cosyvoice-triton client vc --live - --speaker alice -o - | aplay ...
    cosyvoice-triton client vc --live talk.wav --prompt voice.wav -o live.wav    # at real-time pace
    my_llm | cosyvoice-triton client tts --live --speaker alice --chunk-chars 4 -o - | aplay ...

``--stream`` asks the streaming model (``cosyvoice_vc_stream`` / ``cosyvoice_tts_stream``) over a gRPC stream, or
with ``--protocol http`` over HTTP ``generate_stream`` (server-sent events), and writes each chunk as it arrives:
to a 16-bit wav, or with ``-o -`` as raw 16-bit little-endian mono PCM on stdout (for a player, at the served
rate, printed); the first-chunk latency is printed (on stderr with ``-o -``). Several VC sources are converted
concurrently (``--concurrency``) over one connection; each result is written as ``<out_dir>/<source stem>.wav``.
A request the server refuses prints the server's message; the exit code is 1 when any request failed, 2 for bad
arguments or an unreachable server. ``tokens`` / ``embedding`` print the values on one line (``-o -``, the default) or
write them to a ``.npy`` (or text) file. ``--priority N`` (every command) sends the request at priority level N (1 is
the highest; checked against the model's configured levels when the admin key is known; not over HTTP streams).

``--live`` runs a live session over one gRPC stream (``cosyvoice_vc_live`` / ``cosyvoice_tts_live``). ``vc --live FILE``
sends the file at real-time pace in pieces of ``--piece-ms`` (``--no-pace``: as fast as it can), ``vc --live -`` sends
raw 16-bit little-endian mono PCM from stdin at ``--rate`` as it comes; ``tts --live`` speaks stdin line by line as
the lines come (``--chunk-chars N``: in pieces of N characters, as an LLM's tokens). The audio is written as it
arrives; each chunk's latency (after the piece it answers was sent) and real-time margin (how early it came for
gap-free playback from the first chunk on, ``--buffer-ms`` later) go to stderr, then a summary.

``--family cosyvoice3`` (``tts``, ``vc``, ``speaker``) speaks and converts with the CosyVoice3 models of a deployment
that serves them (``cosyvoice3_tts``, ``cosyvoice3_tts_stream``, ``cosyvoice3_tts_live``, ``cosyvoice3_vc``,
``cosyvoice3_vc_live``) and registers, lists or deletes its speakers (``cosyvoice3_speakers``): a speaker is
registered per family.
"""

import argparse
import sys
from pathlib import Path

from ..errors import CosyVoiceError
from ..shapes import (
    CV3_TTS_LIVE_MODEL,
    CV3_TTS_MODEL,
    CV3_TTS_STREAM_MODEL,
    CV3_VC_LIVE_MODEL,
    CV3_VC_MODEL,
    SPEAKER_EMBEDDING_MODEL,
    SPEECH_TOKENS_MODEL,
    TTS_MODEL,
    TTS_STREAM_MODEL,
    VC_MODEL,
)
from .live import (
    TTS_LIVE_MODEL,
    VC_LIVE_MODEL,
    LiveClient,
    LiveStats,
    PacedPieces,
    pcm_pieces,
    text_pieces,
)
from .sync_client import CosyVoiceClient
from .wire import (
    VC_STREAM_MODEL,
    PriorityError,
    StreamStats,
    VCError,
    speakers_model,
)

COMMANDS = ("vc", "tts", "speaker", "tokens", "embedding")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8000 http, 127.0.0.1:8001 grpc)")
    p.add_argument("--protocol", choices=("http", "grpc"), default=None,
                   help="default: http, or grpc with --stream (streams go over either)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")
    p.add_argument("--priority", type=int, default=None, metavar="N",
                   help="request priority level (1 highest; default: the model's own level)")


def _family(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", choices=("cosyvoice2", "cosyvoice3"), default="cosyvoice2",
                   help="the model family the deployment serves it with (default cosyvoice2)")


#: The TTS models of each family: (whole answers, streamed, live).
TTS_MODELS = {"cosyvoice2": (TTS_MODEL, TTS_STREAM_MODEL, TTS_LIVE_MODEL),
              "cosyvoice3": (CV3_TTS_MODEL, CV3_TTS_STREAM_MODEL, CV3_TTS_LIVE_MODEL)}


def command_model(args: argparse.Namespace) -> str:
    """The served model a parsed command line calls."""
    stream, live = getattr(args, "stream", False), bool(getattr(args, "live", None))
    if args.command == "tts":
        whole, streamed, live_model = TTS_MODELS[args.family]
        return live_model if live else (streamed if stream else whole)
    if args.command == "vc":
        if args.family == "cosyvoice3":
            if stream:
                raise CosyVoiceError("--family cosyvoice3: voice conversion is served whole (cosyvoice3_vc) or live "
                                     "(--live, cosyvoice3_vc_live), not streamed")
            return CV3_VC_LIVE_MODEL if live else CV3_VC_MODEL
        return VC_LIVE_MODEL if live else (VC_STREAM_MODEL if stream else VC_MODEL)
    return {"speaker": lambda: speakers_model(args.family), "tokens": lambda: SPEECH_TOKENS_MODEL,
            "embedding": lambda: SPEAKER_EMBEDDING_MODEL}[args.command]()


def _live_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buffer-ms", type=float, default=0.0,
                   help="--live: playback starts this long after the first chunk (for the real-time margin)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-triton client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("vc", help="voice conversion (the default command)")
    _common(v)
    what = v.add_mutually_exclusive_group(required=True)
    what.add_argument("--source", nargs="+", help="speech file(s) whose content is kept")
    what.add_argument("--live", metavar="FILE|-", help="live session: a file sent at real-time pace, or - for raw "
                      "s16le mono PCM on stdin (at --rate)")
    voice = v.add_mutually_exclusive_group(required=True)
    voice.add_argument("--prompt", help="speech of the target voice")
    voice.add_argument("--speaker", help="a registered speaker id instead of --prompt")
    v.add_argument("-o", "--output", required=True, help="output wav (one source), folder (several), or - (raw PCM)")
    v.add_argument("--seed", type=int, default=None, help="seed of the vocoder noise (server default: 0)")
    v.add_argument("--stream", action="store_true", help="streaming model, audio written as it arrives")
    v.add_argument("--concurrency", type=int, default=4)
    v.add_argument("--rate", type=int, default=16000, help="--live -: sample rate of the PCM on stdin")
    v.add_argument("--piece-ms", type=float, default=200.0, help="--live: source piece length")
    v.add_argument("--no-pace", action="store_true", help="--live FILE: send the pieces as fast as possible")
    _live_common(v)
    _family(v)

    t = sub.add_parser("tts", help="text to speech")
    _common(t)
    text = t.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="text to speak")
    text.add_argument("--text-file", help="UTF-8 file with the text to speak")
    text.add_argument("--live", action="store_true", help="live session: speak stdin line by line as it comes")
    voice = t.add_mutually_exclusive_group(required=True)
    voice.add_argument("--prompt", help="speech of the target voice")
    voice.add_argument("--speaker", help="a registered speaker id instead of --prompt")
    t.add_argument("--prompt-text", help="transcript of --prompt (zero-shot)")
    t.add_argument("--instruct", help="instruction (instruct mode)")
    t.add_argument("--mode", choices=("zero_shot", "cross_lingual", "instruct"), default=None)
    t.add_argument("-o", "--output", required=True, help="output wav, or - for raw s16le PCM on stdout")
    t.add_argument("--seed", type=int, default=None, help="seed of the LM sampling and the vocoder noise")
    t.add_argument("--stream", action="store_true", help="streaming model, audio written as it arrives")
    t.add_argument("--chunk-chars", type=int, default=0, metavar="N",
                   help="--live: send the text in pieces of N characters (default: a line each)")
    _family(t)
    _live_common(t)

    s = sub.add_parser("speaker", help="register, list or delete speakers on the server")
    _common(s)
    s.add_argument("action", choices=("add", "list", "delete"))
    s.add_argument("id", nargs="?", help="speaker id: 1-64 of A-Z a-z 0-9 _ . - (not starting with .)")
    s.add_argument("--prompt", help="speech of the speaker (add)")
    s.add_argument("--prompt-text", help="its transcript (add)")
    _family(s)

    for name, what in (("tokens", "25 Hz CosyVoice speech tokens of a recording (at most 30 s)"),
                       ("embedding", "192-dim CAM++ speaker embedding of a recording")):
        e = sub.add_parser(name, help=what)
        _common(e)
        e.add_argument("--audio", required=True, help="speech file (wav/flac/ogg)")
        e.add_argument("-o", "--output", default="-", help="- (print, the default), a .npy file, or a text file")
    return p


class _Sink:
    """Chunks to a 16-bit wav or to raw s16le PCM on stdout, written as they come."""

    def __init__(self, output: str):
        self.stdout = output == "-"
        self.output, self.file = output, None

    def write(self, wave, sample_rate: int) -> None:
        import numpy as np

        if self.stdout:
            sys.stdout.buffer.write(np.rint(np.clip(wave, -1, 1) * 32767).astype("<i2").tobytes())
            sys.stdout.buffer.flush()
            return
        if self.file is None:
            import soundfile

            Path(self.output).parent.mkdir(parents=True, exist_ok=True)
            self.file = soundfile.SoundFile(self.output, "w", samplerate=sample_rate, channels=1, subtype="PCM_16")
        self.file.write(np.clip(wave, -1, 1))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _stream_to(chunks, output: str, stats: StreamStats, label: str) -> None:
    sink = _Sink(output)
    try:
        for chunk in chunks:
            sink.write(chunk.waveform, chunk.sample_rate)
    finally:
        sink.close()
    report = sys.stderr if output == "-" else sys.stdout
    where = "stdout (raw s16le mono)" if output == "-" else output
    seconds = stats.samples / max(stats.sample_rate, 1)
    first = f"{stats.first_chunk_s * 1000:.0f} ms" if stats.first_chunk_s is not None else "none"
    print(f"{label} -> {where}: {seconds:.2f} s at {stats.sample_rate} Hz in {stats.chunks} chunks; first chunk "
          f"after {first}, total {stats.total_s:.2f} s, real-time factor {stats.rtf:.3f}", file=report)


def _live_to(chunks, output: str, stats: LiveStats, label: str) -> None:
    """Write a live session's chunks as they arrive; per chunk and at the end a line on stderr."""
    sink = _Sink(output)
    try:
        for chunk in chunks:
            sink.write(chunk.waveform, chunk.sample_rate)
            margin = "playback starts" if chunk.margin_s is None else f"margin {chunk.margin_s * 1000:+.0f} ms"
            print(f"chunk {chunk.index}: {chunk.seconds:.2f} s, piece {chunk.piece}, latency "
                  f"{chunk.latency_s * 1000:.0f} ms, {margin}", file=sys.stderr, flush=True)
    finally:
        sink.close()
    where = "stdout (raw s16le mono)" if output == "-" else output
    print(f"{label} -> {where}: {stats.summary()}", file=sys.stderr, flush=True)


def _vc_live(client: LiveClient, args) -> int:
    if args.live == "-":
        pieces, rate = pcm_pieces(sys.stdin.buffer, sample_rate=args.rate, piece_ms=args.piece_ms), args.rate
    else:
        pieces = PacedPieces(args.live, piece_ms=args.piece_ms, realtime=not args.no_pace)
        rate = pieces.sample_rate
    stats = LiveStats(buffer_s=args.buffer_ms / 1000.0)
    _live_to(client.convert_live(pieces, prompt=args.prompt, speaker_id=args.speaker, sample_rate=rate,
                                 seed=args.seed, stats=stats, priority=args.priority, model=client.model),
             args.output, stats, "stdin" if args.live == "-" else args.live)
    return 0


def _tts_live(client: LiveClient, args) -> int:
    if args.instruct is not None or args.mode is not None:
        raise CosyVoiceError("--live speaks in the voice of --prompt (+ --prompt-text) or --speaker; no --instruct / "
                             "--mode")
    stats = LiveStats(buffer_s=args.buffer_ms / 1000.0)
    _live_to(client.tts_live(text_pieces(sys.stdin, chunk_chars=args.chunk_chars), prompt=args.prompt,
                             prompt_text=args.prompt_text, speaker_id=args.speaker, seed=args.seed, stats=stats,
                             priority=args.priority, model=client.model), args.output, stats, "tts")
    return 0


def _vc(client: CosyVoiceClient, args) -> int:
    if args.live:
        return _vc_live(client, args)
    several = len(args.source) > 1
    if args.stream:
        if several or args.output.endswith("/"):
            raise CosyVoiceError("--stream converts one source into one file (or - for stdout)")
        stats = StreamStats()
        _stream_to(client.convert_stream(args.source[0], args.prompt, speaker_id=args.speaker, seed=args.seed,
                                         stats=stats, priority=args.priority), args.output, stats, args.source[0])
        return 0
    if args.speaker:
        raise CosyVoiceError("--speaker needs --stream (cosyvoice_vc takes the prompt audio)")
    out = Path(args.output)
    targets = [out / f"{Path(s).stem}.wav" for s in args.source] if several else [out]
    results = client.convert_many([(s, args.prompt) for s in args.source], seed=args.seed, priority=args.priority)
    failed = 0
    for src, target, res in zip(args.source, targets, results, strict=True):
        if isinstance(res, VCError):
            failed += 1
            print(f"{src}: error: {res}", file=sys.stderr)
            continue
        res.write(target)
        print(f"{src} -> {target}: {res.seconds:.2f} s at {res.sample_rate} Hz in {res.latency_s * 1000:.0f} ms")
    return 1 if failed else 0


def _tts(client: CosyVoiceClient, args) -> int:
    if args.live:
        return _tts_live(client, args)
    text = args.text if args.text is not None else Path(args.text_file).read_text(encoding="utf-8")
    kw = {"prompt": args.prompt, "prompt_text": args.prompt_text, "instruct": args.instruct,
          "speaker_id": args.speaker, "mode": args.mode, "seed": args.seed, "priority": args.priority,
          "model": client.model}
    if args.stream:
        stats = StreamStats()
        _stream_to(client.tts_stream(text, stats=stats, **kw), args.output, stats, "tts")
        return 0
    res = client.tts(text, **kw)
    sink = _Sink(args.output)
    try:
        sink.write(res.waveform, res.sample_rate)
    finally:
        sink.close()
    report = sys.stderr if args.output == "-" else sys.stdout
    print(f"tts -> {args.output}: {res.seconds:.2f} s at {res.sample_rate} Hz in {res.latency_s * 1000:.0f} ms "
          f"(real-time factor {res.latency_s / max(res.seconds, 1e-9):.3f})", file=report)
    return 0


def _speaker(client: CosyVoiceClient, args) -> int:
    if args.action != "list" and not args.id:
        raise CosyVoiceError(f"speaker {args.action} needs a speaker id")
    if args.action == "add":
        if not args.prompt:
            raise CosyVoiceError("speaker add needs --prompt")
        prompt = client.register_speaker(args.id, args.prompt, prompt_text=args.prompt_text, priority=args.priority,
                                         family=args.family)
        print(f"registered {args.id!r}: {len(prompt.prompt_tokens)} prompt tokens, "
              f"{len(prompt.prompt_text_tokens)} transcript tokens")
    elif args.action == "list":
        for speaker_id in client.list_speakers(family=args.family):
            print(speaker_id)
    else:
        client.delete_speaker(args.id, family=args.family)
        print(f"deleted {args.id!r}")
    return 0


def _values(client: CosyVoiceClient, args) -> int:
    import numpy as np

    call = client.speech_tokens if args.command == "tokens" else client.speaker_embedding
    values = call(args.audio, priority=args.priority)
    text = " ".join(str(int(v)) if args.command == "tokens" else f"{float(v):.7g}" for v in values)
    if args.output == "-":
        print(text)
        return 0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".npy":
        np.save(out, values)
    else:
        out.write_text(text + "\n")
    print(f"{args.audio} -> {out}: {len(values)} {'tokens' if args.command == 'tokens' else 'values'}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["vc", *argv]  # the original command line: voice conversion
    args = build_parser().parse_args(argv)
    live = bool(getattr(args, "live", None))
    protocol = args.protocol or ("grpc" if getattr(args, "stream", False) or live else "http")
    if live and (protocol != "grpc" or args.stream):
        print("error: --live runs over a gRPC stream (no --protocol http, no --stream)", file=sys.stderr)
        return 2
    try:
        model = command_model(args)
        client = (LiveClient if live else CosyVoiceClient)(args.url, protocol=protocol, model=model,
                                                           timeout=args.timeout,
                                                           concurrency=getattr(args, "concurrency", 4))
    except Exception as exc:
        print(f"error: cannot connect: {exc}", file=sys.stderr)
        return 2
    with client:
        if not client.is_ready():
            print(f"error: the server at {client.url} ({protocol}) is not ready or has no model {client.model}",
                  file=sys.stderr)
            return 2
        try:
            client.validate_priority(client.model, args.priority)  # a bad --priority: before anything is sent
            return {"vc": _vc, "tts": _tts, "speaker": _speaker, "tokens": _values,
                    "embedding": _values}[args.command](client, args)
        except PriorityError as exc:
            print(f"error: --priority: {exc.message}", file=sys.stderr)
            return 2
        except VCError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except CosyVoiceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
