#!/usr/bin/env python3
"""A short example of the client library against a running server (``make serve``): register a voice, speak a
sentence in it as it streams, convert a recording into it. The full command line is ``cosyvoice-triton client``.

    python clients/cosyvoice_client.py voice.wav "What the voice says." source.wav [host:grpc_port]
"""

import sys

import numpy as np
import soundfile as sf

from cosyvoice_triton.clients.client import CosyVoiceClient


def main(prompt_wav: str, prompt_text: str, source_wav: str, url: str = "127.0.0.1:8001") -> None:
    with CosyVoiceClient(url, protocol="grpc") as client:
        client.register_speaker("example", prompt_wav, prompt_text=prompt_text)
        chunks = []
        for chunk in client.tts_stream("Hello there, this is my voice.", speaker_id="example"):
            print(f"chunk {chunk.index}: {len(chunk.waveform)} samples after {chunk.elapsed_s:.2f} s")
            chunks.append(chunk)
        sf.write("example_tts.wav", np.concatenate([c.waveform for c in chunks]), chunks[0].sample_rate)
        client.convert(source_wav, prompt_wav).write("example_vc.wav")
        client.delete_speaker("example")


if __name__ == "__main__":
    main(*sys.argv[1:5])
