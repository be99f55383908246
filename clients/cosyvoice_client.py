#!/usr/bin/env python3
"""Convert speech through the served ``cosyvoice_vc`` ensemble (a thin CLI over cosyvoice_triton.client).

    python clients/cosyvoice_client.py --source a.wav --prompt voice.wav -o out.wav
    python clients/cosyvoice_client.py --source a.wav b.wav c.wav --prompt voice.wav -o out_dir/ --protocol grpc

Several sources are converted concurrently (``--concurrency``) over one connection; each result is written as
``<out_dir>/<source stem>.wav``. A request the server refuses prints the server's message; the exit code is 1
when any conversion failed, 2 for bad arguments or an unreachable server.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyvoice_triton.client import VCClient, VCError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8000 http, 127.0.0.1:8001 grpc)")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--source", nargs="+", required=True, help="speech file(s) whose content is kept")
    p.add_argument("--prompt", required=True, help="speech of the target voice")
    p.add_argument("-o", "--output", required=True, help="output wav (one source) or folder (several)")
    p.add_argument("--seed", type=int, default=None, help="seed of the vocoder noise (server default: 0)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")
    args = p.parse_args(argv)
    several = len(args.source) > 1
    out = Path(args.output)
    targets = [out / f"{Path(s).stem}.wav" for s in args.source] if several else [out]
    try:
        client = VCClient(args.url, protocol=args.protocol, timeout=args.timeout, concurrency=args.concurrency)
    except Exception as exc:
        print(f"error: cannot connect: {exc}", file=sys.stderr)
        return 2
    with client:
        if not client.is_ready():
            print(f"error: the server at {client.url} ({args.protocol}) is not ready or has no model {client.model}",
                  file=sys.stderr)
            return 2
        results = client.convert_many([(s, args.prompt) for s in args.source], seed=args.seed)
    failed = 0
    for src, target, res in zip(args.source, targets, results, strict=True):
        if isinstance(res, VCError):
            failed += 1
            print(f"{src}: error: {res}", file=sys.stderr)
            continue
        res.write(target)
        print(f"{src} -> {target}: {res.seconds:.2f} s at {res.sample_rate} Hz in {res.latency_s * 1000:.0f} ms")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
