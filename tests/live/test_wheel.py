"""The package as a wheel installs it, with no clone beside it: built from this tree (``pip wheel``), installed
into a fresh virtual environment outside the clone (its dependencies: this interpreter's site-packages, without the
editable install), and run from a folder outside the clone. The commands that run repository files reach them,
every run-time file (templates, scripts, sample recordings) resolves into the installed package, ``render`` writes
the same repository as the clone's editable install, and tritonserver serves that repository."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

#: the commands that run a script of the repository (cosyvoice_triton.commands.PASSTHROUGH), and some that read the
#: package's other files at import (the demo's and the load tests' recordings and Locust files)
COMMANDS = ("render", "export-onnx", "quantize", "quality", "engines", "convert-llm", "serve", "demo", "loadtest")
#: what the package reads or runs at run time, relative to the repository's top (cosyvoice_triton.resources.path)
RUNTIME_FILES = ("model_repository/render.py", "export/export_onnx.py", "export/quantize.py",
                 "export/quality_report.py", "export/build_engines.py", "export/convert_llm.py",
                 "loadtest/locustfile.py", "loadtest/rollout_locustfile.py", "tests/fixtures/source_en_5s.wav",
                 "tests/fixtures/prompt_en_3s.wav", "tests/fixtures/speech_engb_16k.wav")
NOT_SHIPPED = {"README.md"}  # the templates' folders' documentation
MARKER = "cosyvoice_repository.json"  # cosyvoice_triton.serving.marker.MARKER: what was rendered, from where


def _copy_tree(dest: Path) -> Path:
    """This tree's files (tracked, and new ones git does not ignore) in ``dest``: the build writes ``build/`` and
    ``*.egg-info`` there, not into the clone."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                 capture_output=True, check=True, timeout=120).stdout.decode()
        for rel in filter(None, listing.split("\0")):
            if (ROOT / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
    else:  # not a git clone: all but the outputs and caches .gitignore names (those at the top: only there)
        anywhere = shutil.ignore_patterns("__pycache__", "*.egg-info")
        top = {".git", ".venv", "build", "models", ".pytest_cache", ".ruff_cache"}

        def ignore(folder: str, names: list[str]) -> set[str]:
            return set(anywhere(folder, names)) | (top & set(names) if Path(folder) == ROOT else set())

        shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


@dataclass
class Installed:
    venv: Path
    work: Path  # the current folder of every command: outside the clone
    env: dict[str, str]

    def run(self, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        assert proc.returncode == 0, f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
        return proc

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run([str(self.venv / "bin" / "cosyvoice-triton"), *args], timeout=timeout)

    def python(self, code: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run([str(self.venv / "bin" / "python"), "-c", textwrap.dedent(code)], timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    assert not tmp.resolve().is_relative_to(ROOT.resolve()), "the test needs a temporary folder outside the clone"
    src = _copy_tree(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", str(src), "-w", str(tmp / "dist")], check=True, timeout=600, cwd=tmp)
    wheel = next((tmp / "dist").glob("cosyvoice_triton-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                                   "print(sysconfig.get_path('purelib'))"], capture_output=True, text=True,
                                  check=True, timeout=60).stdout.strip())
    # The dependencies: this interpreter's site-packages as plain path entries. Their .pth files are not read
    # there, so the editable install of the clone (a .pth + import hook) is not.
    deps = [p for p in site.getsitepackages() if Path(p).resolve() != ROOT.resolve()]
    (purelib / "zz_dependencies.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=600, cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "COSYVOICE_TEMPLATES")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    return Installed(venv=venv, work=work, env=env)


def test_installed_package_is_the_wheel_not_the_clone(installed):
    proc = installed.python("""
        import json, sys
        import cosyvoice_triton
        from cosyvoice_triton import resources
        print(json.dumps({"package": cosyvoice_triton.__file__, "root": str(resources.root()),
                          "checkout": str(resources.checkout()), "path": sys.path}))
    """)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(installed.venv), found["package"]
    assert Path(found["root"]).is_relative_to(installed.venv), found["root"]
    assert found["checkout"] == "None"
    assert not any(p and Path(p).resolve() == ROOT.resolve() for p in found["path"]), found["path"]


def test_runtime_files_resolve_into_the_package(installed):
    proc = installed.python(f"""
        import json
        from cosyvoice_triton import resources
        from cosyvoice_triton.commands import PASSTHROUGH
        from cosyvoice_triton.loadtest import rollout, setup, soak
        from cosyvoice_triton.serving.launch import serve_demo
        from cosyvoice_triton.serving.repository import default_templates_dir

        paths = {{rel: resources.path(rel) for rel in {list(RUNTIME_FILES)!r}}}
        paths.update({{name: resources.path(target) for name, (_, target, _) in PASSTHROUGH.items()
                       if ":" not in target}})
        paths.update(templates=default_templates_dir(), ensemble=resources.path("ensemble"),
                     demo_source=serve_demo.DEFAULT_SOURCE, demo_prompt=serve_demo.DEFAULT_PROMPT,
                     soak_source=soak.SOURCE, soak_prompt=soak.PROMPT, locustfile=setup.LOCUSTFILE,
                     rollout_locustfile=rollout.LOCUSTFILE, fixtures=setup.FIXTURES)
        root = resources.root()
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
        print(json.dumps({{"paths": {{k: str(v) for k, v in paths.items()}}, "root": str(root), "files": files}}))
    """)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for what, p in found["paths"].items():
        assert Path(p).is_relative_to(installed.venv) and Path(p).exists(), (what, p)
    # the templates' folders as a whole (a new kind of template file must reach the wheel too)
    wanted = {str(p.relative_to(ROOT)) for folder in ("model_repository", "ensemble")
              for p in (ROOT / folder).rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and p.name not in NOT_SHIPPED}
    assert wanted - set(found["files"]) == set()
    assert set(RUNTIME_FILES) <= set(found["files"])


def test_the_gateways_grpc_messages_compile_from_the_wheel(installed):
    # CosyVoice's own gRPC service: its .proto is package data, compiled by protoc when the gateway starts
    proc = installed.python("""
        from cosyvoice_triton.gateway import official_grpc
        request, _ = official_grpc.messages()
        print(official_grpc.PROTO, request.DESCRIPTOR.full_name)
    """)
    proto, name = proc.stdout.split()[-2:]
    assert Path(proto).is_relative_to(installed.venv) and name == "cosyvoice.Request"


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_reach_their_parsers(installed, command):
    out = installed.cli(command, "--help").stdout
    assert "usage:" in out and "cosyvoice-triton [-h] [-v]" not in out  # the command's own parser


def test_top_level_help(installed):
    out = installed.cli("--help").stdout
    assert all(name in out for name in COMMANDS)


@pytest.fixture(scope="module")
def rendered(installed) -> dict[str, Path]:
    """A tiny demo model, its ONNX export and the local flavor's repository, each by the installed commands."""
    work = installed.work
    installed.cli("demo-model", "--size", "tiny", "--out", "m")
    installed.cli("export-onnx", "--model-dir", "m", "--out", "onnx/fp32", "--no-verify", "-q")
    installed.cli("render", "--flavor", "local", "--model-dir", "m", "--onnx-dir", "onnx", "--out", "repo_wheel")
    return {"model": work / "m", "onnx": work / "onnx", "repo": work / "repo_wheel"}


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_render_matches_the_clone(installed, rendered):
    # the same command line through the clone's (editable) install, in the same folder
    installed.run([sys.executable, "-m", "cosyvoice_triton", "render", "--flavor", "local", "--model-dir", "m",
                   "--onnx-dir", "onnx", "--out", "repo_clone"])
    wheel, clone = rendered["repo"], installed.work / "repo_clone"
    names = _files(clone)
    assert any(n.endswith("model.py") for n in names) and any(n.endswith("config.pbtxt") for n in names)
    assert _files(wheel) == names
    differ = [n for n in sorted(names) if n != MARKER and not filecmp.cmp(wheel / n, clone / n, shallow=False)]
    assert not differ, differ
    # the marker differs only in where the templates were read
    marks = {which: json.loads((repo / MARKER).read_text()) for which, repo in (("wheel", wheel), ("clone", clone))}
    assert Path(marks["wheel"].pop("templates")).is_relative_to(installed.venv)
    assert Path(marks["clone"].pop("templates")) == ROOT / "model_repository"
    assert marks["wheel"] == marks["clone"]


def test_serves_from_the_wheel(installed, rendered):
    """tritonserver (the nvidia-pytriton wheel) on the repository the wheel rendered, its Python models running the
    installed package: one conversion of the shipped sample recordings through ``cosyvoice_vc`` (the models of the
    voice conversion alone are loaded: the TTS ones would double the start on a small machine)."""
    proc = installed.python(f"""
        import json, sys
        from cosyvoice_triton.serving.launch.server import TritonNotInstalled, TritonServer, find_installation
        try:
            find_installation()
        except TritonNotInstalled as exc:
            print(json.dumps({{"skip": str(exc)}}))
            sys.exit(0)
        from cosyvoice_triton.clients.client import VCClient
        from cosyvoice_triton.serving.launch.serve_demo import DEFAULT_PROMPT, DEFAULT_SOURCE
        from cosyvoice_triton.shapes import GRAPHS, VC_MODEL

        load = [*GRAPHS, "flow", "hift", "preprocess", "postprocess", VC_MODEL]
        with TritonServer({str(rendered["repo"])!r}, exit_timeout=5, start_timeout=600, model_control="explicit",
                          load_models=load) as server:
            with VCClient(server.http_url) as client:
                result = client.convert(str(DEFAULT_SOURCE), str(DEFAULT_PROMPT), seed=0)
        print(json.dumps({{"seconds": result.seconds}}))
    """)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in found:
        pytest.skip(found["skip"])
    assert found["seconds"] > 1.0
