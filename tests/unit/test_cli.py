"""``cosyvoice-triton``: one command line; every passthrough command reaches its own parser (``--help`` exits 0
with that parser's options), the Makefile's targets call it, and the top-level help lists every command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT

from cosyvoice_triton.__main__ import build_parser, main
from cosyvoice_triton.commands import PASSTHROUGH
from cosyvoice_triton.errors import CosyVoiceError


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert set(PASSTHROUGH) <= commands and {"vc", "tts", "speaker", "rollout", "demo-model"} <= commands
    for name in commands:  # named in the grouped overview
        assert re.search(rf"\b{re.escape(name)}\b", out.split("positional arguments")[0]), name


@pytest.mark.parametrize("name", sorted(PASSTHROUGH))
def test_passthrough_reaches_its_own_parser(name):
    proc = subprocess.run([sys.executable, "-m", "cosyvoice_triton", name, "--help"], capture_output=True, text=True,
                          timeout=300, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "cosyvoice-triton [-h] [-v]" not in proc.stdout  # not the top-level parser


def test_passthrough_exit_codes():
    # a bad option is the called parser's error (2), not a crash
    assert main(["render", "--flavor", "nope"]) == 2
    assert main(["client", "speaker", "list", "--url", "127.0.0.1:1"]) == 2  # unreachable server


def test_make_targets_call_the_command_line():
    makefile = (ROOT / "Makefile").read_text()
    assert "CLI         := $(VENV)/bin/cosyvoice-triton" in makefile
    recipes = [line.strip() for line in makefile.splitlines() if line.startswith("\t")]
    direct = r"\$\(PY\) (-m cosyvoice_triton|export/|loadtest/|model_repository/)"
    scripts = [r for r in recipes if re.search(direct, r)]
    assert not scripts, scripts
    used = {m.group(1) for r in recipes for m in re.finditer(r"\$\(CLI\) ([a-z-]+)", r)}
    assert {"demo", "serve", "render", "export-onnx", "quantize", "loadtest", "bench-tts"} <= used


@pytest.mark.parametrize(("argv", "model"), [
    (["tts", "--text", "Hi.", "--speaker", "a", "-o", "x.wav"], "cosyvoice_tts"),
    (["tts", "--text", "Hi.", "--speaker", "a", "-o", "x.wav", "--stream"], "cosyvoice_tts_stream"),
    (["tts", "--live", "--speaker", "a", "-o", "-"], "cosyvoice_tts_live"),
    (["tts", "--text", "Hi.", "--speaker", "a", "-o", "x.wav", "--family", "cosyvoice3"], "cosyvoice3_tts"),
    (["tts", "--text", "Hi.", "--speaker", "a", "-o", "x.wav", "--family", "cosyvoice3", "--stream"],
     "cosyvoice3_tts_stream"),
    (["tts", "--live", "--speaker", "a", "-o", "-", "--family", "cosyvoice3"], "cosyvoice3_tts_live"),
    (["speaker", "list"], "speakers"),
    (["speaker", "list", "--family", "cosyvoice3"], "cosyvoice3_speakers"),
    (["vc", "--source", "a.wav", "--prompt", "p.wav", "-o", "x.wav"], "cosyvoice_vc"),
    (["vc", "--live", "a.wav", "--prompt", "p.wav", "-o", "x.wav"], "cosyvoice_vc_live"),
    (["vc", "--source", "a.wav", "--prompt", "p.wav", "-o", "x.wav", "--family", "cosyvoice3"], "cosyvoice3_vc"),
    (["vc", "--live", "a.wav", "--speaker", "a", "-o", "x.wav", "--family", "cosyvoice3"], "cosyvoice3_vc_live"),
    (["tokens", "--audio", "a.wav"], "speech_tokens"),
])
def test_the_client_command_picks_the_family_s_model(argv, model):
    from cosyvoice_triton.clients.cli import build_parser as client_parser
    from cosyvoice_triton.clients.cli import command_model

    assert command_model(client_parser().parse_args(argv)) == model


def test_cosyvoice3_voice_conversion_is_not_streamed():
    from cosyvoice_triton.clients.cli import build_parser as client_parser
    from cosyvoice_triton.clients.cli import command_model

    args = client_parser().parse_args(["vc", "--source", "a.wav", "--prompt", "p.wav", "-o", "x.wav", "--stream",
                                       "--family", "cosyvoice3"])
    with pytest.raises(CosyVoiceError, match="not streamed"):
        command_model(args)


def test_the_client_family_is_one_of_the_two():
    from cosyvoice_triton.clients.cli import build_parser as client_parser

    with pytest.raises(SystemExit):
        client_parser().parse_args(["speaker", "list", "--family", "cosyvoice1"])
