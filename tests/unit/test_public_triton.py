"""Triton's own ports have no keys: the launcher (``TritonServer``, the supervisor's command line, and so ``serve``
and the image's start script) refuses an address beyond loopback unless asked with ``--public-triton`` /
``public=True``. Nothing starts here: the refusal comes before any server."""

from __future__ import annotations

import pytest

from cosyvoice_triton.serving.launch import supervisor
from cosyvoice_triton.serving.launch.server import TritonServer, check_loopback, is_loopback

PUBLIC = ["0.0.0.0", "::", "192.168.1.7", "10.0.0.1", "example.com", ""]
LOOPBACK = ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"]


def test_loopback_addresses():
    assert all(is_loopback(a) for a in LOOPBACK)
    assert not any(is_loopback(a) for a in PUBLIC)


@pytest.mark.parametrize("host", PUBLIC)
def test_a_public_host_is_refused_unless_asked(host, tmp_path):
    with pytest.raises(ValueError, match="not loopback.*--public-triton"):
        TritonServer(tmp_path, host=host)
    assert TritonServer(tmp_path, host=host, public=True).host == host


@pytest.mark.parametrize("extra", [["--http-address=0.0.0.0"], ["--grpc-address", "10.1.2.3"],
                                   ["--log-verbose=1", "--metrics-address=::"]])
def test_an_address_flag_beyond_loopback_is_refused_too(extra, tmp_path):
    with pytest.raises(ValueError, match="not loopback"):
        TritonServer(tmp_path, extra_args=extra)
    TritonServer(tmp_path, extra_args=extra, public=True)


def test_loopback_passes():
    for host in LOOPBACK:
        check_loopback(host, ["--http-address=127.0.0.1", "--grpc-address", "::1"])


def test_the_supervisor_command_refuses_a_public_host_with_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        supervisor.main(["--model-repository", str(tmp_path), "--host", "0.0.0.0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Triton would listen on 0.0.0.0, not loopback" in err and "--public-triton" in err
    with pytest.raises(SystemExit):
        supervisor.main(["--model-repository", str(tmp_path), "--", "--grpc-address=0.0.0.0"])
    assert "Triton would listen on 0.0.0.0" in capsys.readouterr().err


def test_serve_keeps_triton_on_loopback_behind_a_public_gateway():
    import argparse

    from cosyvoice_triton.serving.launch.serve import add_arguments, triton_host

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--host", "0.0.0.0"])
    assert not args.public_triton and triton_host(args.host, args.public_triton) == "127.0.0.1"
    args = p.parse_args(["--host", "0.0.0.0", "--public-triton"])
    assert triton_host(args.host, args.public_triton) == "0.0.0.0"
    TritonServer(".", host=triton_host("0.0.0.0"))  # what serve builds: accepted without public
