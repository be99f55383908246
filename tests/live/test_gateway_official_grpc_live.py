"""CosyVoice's own gRPC service at the gateway process, in front of a real tritonserver (the session's
``triton_server``: local flavor, tiny demo model): the official ``runtime/python/grpc/client.py`` itself, unchanged
(from ``$COSYVOICE_OFFICIAL_GIT``, a git folder of FunAudioLLM/CosyVoice;
skipped without it), with stubs protoc generates from the official ``cosyvoice.proto``, against a gateway without
keys (the client sends none): each of its four modes answers the same samples as the gateway's form route for the
same request. Then ``speed`` of ``/v1/audio/speech`` through ``cosyvoice_tts``: a whole answer's mel stretched
(``int(T / speed)`` frames of 480 samples), a stream refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import FIXTURES, PATIENCE_S, PATIENT_TEST_S, gateway_process, official_git

from cosyvoice_triton.shapes import SAMPLES_PER_MEL_FRAME

VOICE = "official_grpc_voice"
TEXT = "Hello there, this is the gateway speaking."
PROMPT_TEXT = "the prompt says hello"
INSTRUCT = "Speak slowly."
OFFICIAL_COMMIT = "ace7c47"
GRPC = "runtime/python/grpc"

pytestmark = pytest.mark.timeout(PATIENT_TEST_S)


@pytest.fixture(scope="module")
def gateway(triton_server, tmp_path_factory):
    """A gateway without keys, VOICE registered in its public namespace."""
    from cosyvoice_triton.clients.client import VCClient

    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=PATIENCE_S) as c:
        c.register_speaker(VOICE, str(FIXTURES / "prompt_en_3s.wav"), prompt_text=PROMPT_TEXT)
        try:
            with gateway_process(triton_server, tmp_path_factory.mktemp("gateway") / "gateway.log") as urls:
                yield urls
        finally:
            c.delete_speaker(VOICE)


@pytest.fixture(scope="module")
def prompt16(tmp_path_factory) -> Path:
    """The prompt as 16-bit samples at 16 kHz: what the official client sends (its ``load_wav`` at 16 kHz, times
    2^15 as int16), and exactly the samples a form upload of this file gives the gateway."""
    import soxr

    wave, sr = sf.read(FIXTURES / "prompt_en_3s.wav", dtype="float32")
    pcm = np.clip(np.round(soxr.resample(wave, sr, 16000) * 32768), -32768, 32767).astype(np.int16)
    out = tmp_path_factory.mktemp("prompt") / "prompt16.wav"
    sf.write(out, pcm, 16000, subtype="PCM_16")
    return out


@pytest.fixture(scope="module")
def official_client(tmp_path_factory) -> tuple[Path, Path]:
    """``(client.py, the folder its imports come from)``: the official client and the stubs of the official proto
    beside it; ``cosyvoice.utils.file_utils.load_wav`` and ``torchaudio.save`` stubbed (the official package and a
    torchaudio that loads with this CPU torch are not installed), reading and writing with soundfile."""
    from grpc_tools import protoc

    official = official_git()
    root = tmp_path_factory.mktemp("official")
    for name in ("client.py", "cosyvoice.proto"):
        (root / name).write_bytes(subprocess.run(["git", f"--git-dir={official}", "show",
                                                  f"{OFFICIAL_COMMIT}:{GRPC}/{name}"],
                                                 capture_output=True, check=True).stdout)
    assert protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}",
                        "cosyvoice.proto"]) == 0
    stubs = root / "stubs"
    (stubs / "cosyvoice" / "utils").mkdir(parents=True)
    (stubs / "cosyvoice" / "__init__.py").write_text("")
    (stubs / "cosyvoice" / "utils" / "__init__.py").write_text("")
    (stubs / "cosyvoice" / "utils" / "file_utils.py").write_text(
        "import soundfile\nimport torch\n\n\ndef load_wav(path, target_sr):\n"
        "    wave, sr = soundfile.read(path, dtype='float32')\n"
        "    assert sr == target_sr, (sr, target_sr)\n"
        "    return torch.from_numpy(wave)[None]\n")
    (stubs / "torchaudio.py").write_text("import soundfile\n\n\ndef save(path, tensor, sample_rate):\n"
                                         "    soundfile.write(path, tensor.numpy().T, sample_rate, subtype='PCM_16')\n")
    return root / "client.py", stubs


def _form(gateway, path: str, fields: dict, prompt: Path | None = None) -> np.ndarray:
    files = {"prompt_wav": ("prompt.wav", prompt.read_bytes(), "audio/wav")} if prompt else None
    r = httpx.post(f"{gateway.base}{path}", data=fields, files=files, timeout=PATIENCE_S)
    assert r.status_code == 200, r.text[:300]
    return np.frombuffer(r.content, "<i2")


def test_the_official_grpc_client_unchanged(gateway, official_client, prompt16, tmp_path):
    client, stubs = official_client
    host, port = gateway.grpc.rsplit(":", 1)
    modes = {
        "sft": (["--spk_id", VOICE], "/inference_sft", {"spk_id": VOICE}, None),
        "zero_shot": (["--prompt_text", PROMPT_TEXT, "--prompt_wav", str(prompt16)], "/inference_zero_shot",
                      {"prompt_text": PROMPT_TEXT}, prompt16),
        "cross_lingual": (["--prompt_wav", str(prompt16)], "/inference_cross_lingual", {}, prompt16),
        # CosyVoice 2's instruct mode in a registered voice: the form route takes a prompt file instead
        "instruct": (["--spk_id", VOICE, "--instruct_text", INSTRUCT], None, None, None),
    }
    env = {**os.environ, "PYTHONPATH": str(stubs)}
    heard = {}
    for mode, (args, path, fields, prompt) in modes.items():
        out = tmp_path / f"{mode}.wav"
        run = subprocess.run([sys.executable, str(client), "--host", host, "--port", port, "--mode", mode,
                              "--tts_text", TEXT, "--tts_wav", str(out), *args], capture_output=True, text=True,
                             env=env, timeout=PATIENCE_S)
        assert run.returncode == 0, run.stderr[-2000:]
        got, _ = sf.read(out, dtype="int16")  # its header says 22050 Hz (its CosyVoice 1 default): 24 kHz samples
        assert got.size > 0.2 * 24000 and np.abs(got).max() > 100  # plausible length, not silence
        heard[mode] = got
        if path is not None:
            np.testing.assert_array_equal(got, _form(gateway, path, {"tts_text": TEXT, **fields}, prompt))
    assert not np.array_equal(heard["instruct"], heard["sft"])  # the instruction reached the LM


def test_speed_stretches_whole_answers(gateway):
    def speech(**extra) -> httpx.Response:
        return httpx.post(f"{gateway.base}/v1/audio/speech", timeout=PATIENCE_S, json={
            "model": "cosyvoice2", "input": TEXT, "voice": VOICE, "response_format": "pcm", "seed": 3, **extra})

    normal = speech()
    assert normal.status_code == 200, normal.text
    frames = len(normal.content) // 2 // SAMPLES_PER_MEL_FRAME  # one text segment: its mel's frames
    assert len(normal.content) == 2 * SAMPLES_PER_MEL_FRAME * frames
    for speed in (1.5, 0.8):
        r = speech(speed=speed)
        assert r.status_code == 200, r.text
        assert len(r.content) == 2 * SAMPLES_PER_MEL_FRAME * int(frames / float(np.float32(speed)))
    r = speech(speed=1.5, stream_format="audio")
    assert r.status_code == 400 and r.json()["error"]["param"] == "speed"
