"""Request size limits of the launcher: passed to Triton where it has the flag, and said plainly where it has not
(Triton 2.51 of the wheel, 2.54 of the 25.01 image: a proxy must cap request bodies, README "Hardening")."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice_triton.serving.launch import server as server_mod
from cosyvoice_triton.serving.launch.server import (
    HTTP_MAX_INPUT_BYTES,
    TritonInstallation,
    TritonNotInstalled,
    TritonServer,
    find_installation,
)


def _fake(tmp_path: Path, help_text: str) -> TritonInstallation:
    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}\nEOF\n")
    binary.chmod(0o755)
    return TritonInstallation(root=tmp_path, binary=binary, backends=tmp_path / "backends", stub=tmp_path / "stub",
                              libs=None, bundled=False)


def test_the_size_limit_is_passed_where_triton_has_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(server_mod, "_HELP", {})
    (tmp_path / "repo").mkdir()
    newer = _fake(tmp_path / "newer", "  --http-max-input-size <integer>\n\tThe maximum input size")
    s = TritonServer(tmp_path / "repo", installation=newer)
    assert s.size_limit_enforced
    assert f"--http-max-input-size={HTTP_MAX_INPUT_BYTES}" in s.command()
    s = TritonServer(tmp_path / "repo", installation=newer, http_max_input_bytes=1 << 20)
    assert "--http-max-input-size=1048576" in s.command()
    assert not [a for a in TritonServer(tmp_path / "repo", installation=newer, http_max_input_bytes=None).command()
                if "max-input" in a]
    older = _fake(tmp_path / "older", "  --http-port <integer>")
    s = TritonServer(tmp_path / "repo", installation=older)
    assert not s.size_limit_enforced and not [a for a in s.command() if "max-input" in a]


def test_the_wheels_triton_has_no_request_size_limit(tmp_path):
    try:
        inst = find_installation()
    except TritonNotInstalled as exc:
        pytest.skip(str(exc))
    (tmp_path / "repo").mkdir()
    s = TritonServer(tmp_path / "repo", installation=inst)
    assert "--http-restricted-api" in server_mod.server_flags(inst)  # the help text was read
    assert not s.size_limit_enforced  # 2.51: the README's proxy caps bodies (tests/live/test_hostile_server.py: gzip)
