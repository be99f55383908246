"""Every command the user docs show is one the project has, written as it accepts it.

Read from every fenced ``bash`` block and every inline code span of README.md, model_repository/README.md and
docs/**/*.md, and from the examples of ``cosyvoice-triton --help`` (commands.PASSTHROUGH, the top-level docstring):

* ``make TARGET [VAR=VALUE ...]`` (or ``VAR=VALUE make TARGET``): TARGET is a target of the Makefile and each VAR a
  variable it sets or reads; ``make -n`` of each (a dry run: nothing is built) succeeds, and the
  ``cosyvoice-triton`` command lines it prints pass the check below, so ``LOADTEST_ARGS="..."`` is checked too;
* ``cosyvoice-triton CMD ...``, ``.venv/bin/cosyvoice-triton ...``, ``python -m cosyvoice_triton[.MODULE] ...`` and
  the repository's command-line scripts (``model_repository/render.py``, ``loadtest/run.py``, ``export/*.py``): the
  command exists and the real argparse parser of that command (built by its own code,
  :func:`cosyvoice_triton.commands.command_parser`) accepts every flag and subcommand as written (placeholders
  such as ``...``, ``N``, ``DIR`` and ``<...>`` stand for any value; required arguments may be left out of an
  example); ``--help`` of each documented command runs;
* ``--set NAME=VALUE[,NAME=VALUE] [NAME=VALUE ...]`` wherever it is written (in a command or in prose): each NAME is
  a field of :class:`~cosyvoice_triton.serving.repository.Tunables` and the values go through the ``--set`` of the
  real parser (the command's, else ``render``'s), which types them as every command line does;
* a program in a fenced block is installed by ``make install`` (``.venv/bin``), is a script of the repository, or
  is one of a few well-known tools; ``tritonserver`` is not on any PATH in the CPU set-up (the launchers find the
  binary inside the nvidia-pytriton wheel), so a command line that calls it fails.

``test_each_check_fails_on_a_wrong_command`` feeds each check a wrong line, so none of them passes vacuously.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from functools import cache
from pathlib import Path

import pytest

from cosyvoice_triton.commands import PASSTHROUGH, command_parser
from cosyvoice_triton.commands import run as run_command
from cosyvoice_triton.serving.repository import Tunables

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "model_repository" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
VENV_BIN = ROOT / ".venv" / "bin"
#: Programs a documented command may call besides the project's own: the tools the pages tell the user to have.
#: ``llm_cli`` stands for the user's own LLM program (docs/live.md).
EXTERNAL_TOOLS = {"make", "docker", "kubectl", "curl", "ffmpeg", "aplay", "arecord", "openssl", "git", "pip", "sh",
                  "llm_cli"}
PLACEHOLDER = "PLACEHOLDER"
#: The repository's command-line scripts: a path -> what ``commands.run`` runs.
SCRIPTS = {**{t: t for _, t, _ in PASSTHROUGH.values() if t.endswith(".py")}, "loadtest/run.py": "loadtest/run.py",
           "render.py": "model_repository/render.py"}
SHELL_WORDS = {"then", "else", "do", "if", "fi", "done", "exec", "time", "nohup", "sudo"}
TUNABLES = {f.name: f for f in fields(Tunables)}
#: ``a=1,b=2``: a comma starts another tunable only before ``NAME=`` (a mapping's own commas stay in its value).
SET_SPLIT = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*=)")


# -- what the docs show --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Snippet:
    where: str  # file:line
    text: str
    fenced: bool


def _snippets(path: Path) -> list[Snippet]:
    rel = path.relative_to(ROOT)
    out: list[Snippet] = []
    prose: list[str] = []
    fence, lang, block = "", "", []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w-]*)", line)
        if m and (not fence or m.group(1) == fence):
            if fence:  # closing: one snippet per logical line (backslash continuations joined)
                if lang in ("bash", "sh", "shell", "console"):
                    logical, start = "", 0
                    for k, text in block:
                        start = start or k
                        logical += text.rstrip()
                        if logical.endswith("\\"):
                            logical = logical[:-1] + " "
                            continue
                        out.append(Snippet(f"{rel}:{start}", logical, True))
                        logical, start = "", 0
                fence, block = "", []
            else:
                fence, lang = m.group(1), m.group(2)
            prose.append("")
            continue
        if fence:
            block.append((n, line))
            prose.append("")
        else:
            prose.append(line)
    text = "\n".join(prose)
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
        line = text.count("\n", 0, m.start()) + 1
        out.append(Snippet(f"{rel}:{line}", m.group(2).replace("\n", " ").replace("\\|", "|"), False))
    return out


def _help_examples() -> list[Snippet]:
    """The examples ``cosyvoice-triton --help`` and each passthrough command's description show."""
    import cosyvoice_triton.__main__ as cli

    out = [Snippet(f"commands.PASSTHROUGH[{name!r}]", f"cosyvoice-triton {example}", True)
           for name, (_, _, example) in PASSTHROUGH.items()]
    out += [Snippet("cosyvoice_triton/__main__.py (docstring)", line.strip(), True)
            for line in (cli.__doc__ or "").splitlines() if line.strip().startswith("cosyvoice-triton ")]
    return out


@cache
def all_snippets() -> tuple[Snippet, ...]:
    return tuple(s for path in DOCS for s in _snippets(path)) + tuple(_help_examples())


def _tokens(text: str) -> list[str]:
    text = re.sub(r"<[^<>\s][^<>]*>", PLACEHOLDER, text)  # <checkout of ...>, <name>: any value
    text = re.sub(r"(?<=[\w.])\|[\w.|-]+", "", text)  # --size tiny|full: alternatives, not a pipe; the first
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote in prose
        return text.split()


@dataclass(frozen=True)
class Line:
    """One simple command of a snippet (a pipeline or list split at ``|``, ``&&``, ``;``...)."""

    where: str
    env: tuple[str, ...]  # leading VAR=VALUE
    argv: tuple[str, ...]  # program first
    fenced: bool


def command_lines(snippets=None) -> list[Line]:
    out = []
    for s in all_snippets() if snippets is None else snippets:
        segment: list[str] = []
        for tok in [*_tokens(s.text), ";"]:
            if tok and set(tok) <= set("|&;()<>"):
                while segment and segment[0] in SHELL_WORDS:
                    segment.pop(0)
                env = []
                while segment and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0], re.S):
                    env.append(segment.pop(0))
                if segment:
                    out.append(Line(s.where, tuple(env), tuple(segment), s.fenced))
                segment = []
                continue
            stripped = tok.strip("[]")  # [--protocol grpc]: an optional part, checked as if given
            if tok and not stripped:
                continue
            segment.append(stripped)
    return out


def is_placeholder(value: str) -> bool:
    parts = re.split(r"[:,/=]", value)
    return ("..." in value or "…" in value or PLACEHOLDER in value
            or any(re.fullmatch(r"[A-Z][A-Z0-9_]*", p) for p in parts if p))


# -- the Makefile ----------------------------------------------------------------------------------------------------

@cache
def makefile() -> tuple[frozenset[str], frozenset[str]]:
    """The Makefile's targets and its variables (set or read)."""
    text = (ROOT / "Makefile").read_text()
    targets, variables = set(), set()
    for line in text.splitlines():
        if line.startswith("\t") or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\?|:|::|\+)?=", line)
        if m:
            variables.add(m.group(1))
            continue
        m = re.match(r"^([^:#=\s][^:#=]*?)\s*::?(?!=)(.*)$", line)
        if m:
            names = m.group(2).split() if m.group(1) == ".PHONY" else m.group(1).split()
            targets |= {t for t in names if "%" not in t and "$" not in t}
    variables |= set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))
    return frozenset(targets - {".PHONY", ".DEFAULT_GOAL"}), frozenset(variables)


def make_invocation(line: Line) -> tuple[list[str], list[str]] | None:
    """(targets, VAR=VALUE assignments, those before ``make`` included) of a ``make`` line, else None."""
    if Path(line.argv[0]).name != "make":
        return None
    targets, assignments = [], list(line.env)
    args = list(line.argv[1:])
    while args:
        a = args.pop(0)
        if a in ("-C", "-f", "-j"):
            args and args.pop(0)
        elif a.startswith("-"):
            continue
        elif "=" in a:
            assignments.append(a)
        else:
            targets.append(a)
    return targets, assignments


def check_make(line: Line) -> list[str]:
    found = make_invocation(line)
    if found is None:
        return []
    targets, assignments = found
    known_targets, known_vars = makefile()
    problems = [f"`make {t}`: no such target in the Makefile" for t in targets if t not in known_targets]
    problems += [f"`{a.split('=')[0]}`: the Makefile has no such variable" for a in assignments
                 if a.split("=")[0] not in known_vars]
    if not line.fenced and not targets:
        return []  # `make` alone in prose
    return problems


def make_dry_run(line: Line) -> tuple[int, str]:
    targets, assignments = make_invocation(line)
    env = {**os.environ, **dict(a.split("=", 1) for a in line.env)}
    overrides = [a for a in assignments if a not in line.env]
    proc = subprocess.run(["make", "-n", "--no-print-directory", *targets, *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stdout + proc.stderr


# -- the command lines -----------------------------------------------------------------------------------------------

def cli_invocation(line: Line) -> tuple[str, list[str], str] | None:
    """(target for command_parser, its arguments, how it was called) of a project command line, else None."""
    argv = list(line.argv)
    prog = argv[0]
    name = Path(prog).name
    if name == "cosyvoice-triton":
        return "cosyvoice_triton", argv[1:], "cosyvoice-triton"
    if re.fullmatch(r"python(3(\.\d+)?)?", name):
        if len(argv) > 2 and argv[1] == "-m" and argv[2].split(".")[0] == "cosyvoice_triton":
            return argv[2], argv[3:], f"python -m {argv[2]}"
        if len(argv) > 1 and argv[1] in SCRIPTS:
            return SCRIPTS[argv[1]], argv[2:], argv[1]
        return None
    if prog in SCRIPTS:
        return SCRIPTS[prog], argv[1:], prog
    return None


class DocError(Exception):
    pass


def _tolerant(parser: argparse.ArgumentParser, seen: set[int]) -> None:
    """Parse as the command does, but let an example leave out required arguments and write placeholders for typed
    values; unknown flags, a stray argument, an unknown subcommand and ``--set``'s own checks still fail."""
    if id(parser) in seen:
        return
    seen.add(id(parser))
    parser.allow_abbrev = False

    def error(message, prog=parser.prog):
        raise DocError(f"{prog}: {message}")

    parser.error = error
    for group in parser._mutually_exclusive_groups:
        group.required = False
    for action in parser._actions:
        action.required = False
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _tolerant(sub, seen)
        elif "--set" not in action.option_strings:
            action.type = None
            if action.choices is not None and not all(isinstance(c, str) for c in action.choices):
                action.choices = None


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return dict(parser._option_string_actions)


def cli_default(name: str) -> str:
    """A tunable's default as ``--set`` writes it."""
    f = TUNABLES[name]
    value = f.default if f.default is not MISSING else f.default_factory()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


def _set_values(args: list[str], start: int) -> list[str]:
    values = []
    for a in args[start:]:
        if a.startswith("-"):
            break
        values.append(a)
    return values


def _substitute(args: list[str]) -> list[str]:
    """Placeholders made parseable: a ``--set`` value by the tunable's default, ``...`` after a flag by a word,
    ``...`` anywhere else dropped."""
    out = []
    after_set = False
    for i, a in enumerate(args):
        if a == "--set":
            after_set = True
        elif a.startswith("-"):
            after_set = False
        elif after_set:
            a = ",".join(f"{n}={cli_default(n)}" if n in TUNABLES and is_placeholder(v) else f"{n}={v}"
                         for n, _, v in (p.partition("=") for p in SET_SPLIT.split(a)))
        elif a in ("...", "…"):
            if i and args[i - 1].startswith("-") and args[i - 1] != "-":
                a = PLACEHOLDER
            else:
                continue
        out.append(a)
    return out


def parse_documented(target: str, args: list[str], called: str) -> argparse.Namespace:
    """Parse ``args`` with the command's real parser (:func:`_tolerant`); raises :class:`DocError` naming the fault."""
    try:
        parser, argv = command_parser(target, _substitute(args), prog=called)
    except LookupError as exc:
        raise DocError(f"`{called}` has no command line here ({exc})") from exc
    _tolerant(parser, set())
    if argv and argv[-1].startswith("--") and "=" not in argv[-1]:  # `render.py --precision`: a flag named in prose
        action = _options(parser).get(argv[-1])
        if action is not None and action.nargs != 0:
            argv = argv[:-1]
    return parser.parse_args(argv)


def check_cli(line: Line) -> list[str]:
    found = cli_invocation(line)
    if found is None:
        return []
    target, args, called = found
    if not line.fenced and not args and called == "cosyvoice-triton":
        return []  # the command named in prose
    try:
        parse_documented(target, args, called)
    except DocError as exc:
        return [f"`{called} {' '.join(args)}`: {exc}"]
    return []


def check_sets(line: Line) -> list[str]:
    """The ``--set`` values of a line: the names are tunables, the values go through the real ``--set``."""
    args = list(line.argv)
    problems = []
    for i, a in enumerate(args):
        if a != "--set":
            continue
        values = _set_values(args, i + 1)
        if not values or all(re.fullmatch(r"[A-Z]+=[A-Z]*", v) for v in values):
            continue  # `--set` or `--set NAME=VALUE` named in prose
        for v in values:
            for part in SET_SPLIT.split(v):
                name = part.partition("=")[0]
                if "=" not in part or name not in TUNABLES:
                    problems.append(f"`--set {' '.join(values)}`: {name!r} is not a tunable (a field of Tunables)")
        found = cli_invocation(line)
        target, called = (found[0], found[2]) if found and "--set" in found[1] else ("cosyvoice_triton",
                                                                                    "cosyvoice-triton")
        head = [] if target != "cosyvoice_triton" else ["render"]
        try:
            parse_documented(target, [*head, "--set", *values], called)
        except DocError as exc:
            problems.append(f"`--set {' '.join(values)}` ({called} {' '.join(head)}): {exc}")
    return problems


def check_program(line: Line) -> list[str]:
    prog = line.argv[0]
    name = Path(prog).name
    if line.fenced:
        if (cli_invocation(line) or make_invocation(line) or name in EXTERNAL_TOOLS
                or re.fullmatch(r"python(3(\.\d+)?)?", name) or (VENV_BIN / name).exists()
                or (ROOT / prog).is_file()):
            return []
        return [f"`{prog}`: not installed by `make install` (not in .venv/bin), not a script of the repository "
                "and not a known tool"]
    # inline code: only what reads as a command line (a program, then a flag)
    if (len(line.argv) > 1 and line.argv[1].startswith("--") and re.fullmatch(r"[a-z][a-z0-9_-]*", prog)
            and name not in EXTERNAL_TOOLS and not (VENV_BIN / name).exists() and not cli_invocation(line)):
        return [f"`{' '.join(line.argv)}`: `{prog}` is not on PATH after `make install`"]
    return []


def problems(check, lines) -> list[str]:
    return [f"{line.where}: {p}" for line in lines for p in check(line)]


# -- the checks ----------------------------------------------------------------------------------------------------

def test_make_targets_and_variables_exist():
    found = problems(check_make, command_lines())
    assert not found, "\n".join(found)


def _make_lines() -> list[Line]:
    seen, out = set(), []
    for line in command_lines():
        inv = make_invocation(line)
        if inv and inv[0] and (key := (tuple(inv[0]), tuple(inv[1]))) not in seen:
            seen.add(key)
            out.append(line)
    return out


def test_make_dry_runs_and_the_commands_they_run():
    """``make -n`` of each documented make line succeeds, and every cosyvoice-triton line it would run (with the
    documented variables, LOADTEST_ARGS and the like) passes the command-line check."""
    found = []
    for line in _make_lines():
        if check_make(line):
            continue  # reported by the test above
        rc, out = make_dry_run(line)
        if rc != 0:
            found.append(f"{line.where}: `make -n {' '.join(line.argv[1:])}` failed ({rc}): {out.strip()[-300:]}")
            continue
        snippets = [Snippet(f"{line.where} (make -n)", text, True) for text in out.replace("\\\n", " ").splitlines()
                    if "cosyvoice-triton" in text]
        for sub in command_lines(snippets):
            found += [f"{sub.where}: {p}" for p in check_cli(sub) + check_sets(sub)]
    assert not found, "\n".join(found)


def test_documented_command_lines_parse():
    found = problems(check_cli, command_lines())
    assert not found, "\n".join(found)


def test_documented_tunables_are_real():
    lines = command_lines()
    assert any("--set" in line.argv for line in lines)  # the docs do show tunables
    found = problems(check_sets, lines)
    assert not found, "\n".join(found)


def test_documented_programs_are_installed():
    found = problems(check_program, command_lines())
    assert not found, "\n".join(found)


def _env_names_read() -> set[str]:
    """The ``COSYVOICE_*`` variables the code reads: named in the package, the container's start script and the
    tests' conftest, and the gateway's ``COSYVOICE_GATEWAY_`` + each ``_env(name)`` of its config."""
    from cosyvoice_triton.gateway import config

    names: set[str] = set()
    for path in [*(ROOT / "cosyvoice_triton").rglob("*.py"), ROOT / "export" / "container_start.sh",
                 ROOT / "tests" / "conftest.py"]:
        names |= set(re.findall(r"\bCOSYVOICE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    source = Path(config.__file__).read_text()
    return names | {config.ENV_PREFIX + n.upper() for n in re.findall(r'_env\("(\w+)"', source)}


def test_documented_environment_variables_are_read():
    """Every ``COSYVOICE_*`` variable the docs and the manifests name is one the code reads; the gateway's flags read
    ``COSYVOICE_GATEWAY_<FLAG>``, and the variables that break that rule are named on the gateway's page."""
    from cosyvoice_triton.gateway import config

    read = _env_names_read()
    texts = {p.relative_to(ROOT): p.read_text() for p in [*DOCS, *sorted((ROOT / "deploy").rglob("*.yaml")),
                                                          ROOT / "Dockerfile.triton"]}
    found = [f"{path}: {name} is read by nothing" for path, text in texts.items()
             for name in sorted(set(re.findall(r"\bCOSYVOICE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))) if name not in read]
    flags = {o for o in config.parser()._option_string_actions if o.startswith("--") and o != "--help"}
    derived = {config.ENV_PREFIX + f[2:].upper().replace("-", "_") for f in flags}
    gateway_page = (ROOT / "docs" / "gateway.md").read_text()
    found += [f"docs/gateway.md: the gateway reads {name}, which is not COSYVOICE_GATEWAY_<FLAG> of any flag: name it"
              for name in sorted({n for n in read if n.startswith(config.ENV_PREFIX)} - derived)
              if name not in gateway_page]
    assert not found, "\n".join(found)


def test_gateway_page_names_real_flags():
    from cosyvoice_triton.gateway import config

    flags = set(config.parser()._option_string_actions)
    named = {m.group(1) for m in re.finditer(r"`(--[a-z][a-z0-9-]*)", (ROOT / "docs" / "gateway.md").read_text())}
    assert named, "the gateway's page names no flag"
    assert named <= flags, f"docs/gateway.md names flags the gateway does not have: {sorted(named - flags)}"


def _heads() -> dict[tuple[str, ...], tuple[str, str]]:
    """Each documented command with its subcommands, once: (target, *subcommands) -> (where, called)."""
    heads: dict[tuple[str, ...], tuple[str, str]] = {}
    for line in command_lines():
        found = cli_invocation(line)
        if found is None:
            continue
        target, args, called = found
        try:
            parser, argv = command_parser(target, _substitute(args), prog=called)
        except LookupError:
            continue  # reported by test_documented_command_lines_parse
        path: list[str] = []
        if target == "cosyvoice_triton" and args and args[0] in PASSTHROUGH:
            path.append(args[0])
            argv = argv[:]
        while argv:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not subs or argv[0] not in subs[0].choices:
                break
            parser = subs[0].choices[argv[0]]
            path.append(argv.pop(0))
        heads.setdefault((target, *path), (line.where, called))
    return heads


def _run_help(target: str, path: list[str], called: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        if ":" in target or target.endswith(".py"):
            rc = run_command(target, [*path, "--help"], prog=called)
        else:
            saved = sys.argv
            sys.argv = [called, *path, "--help"]
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    runpy.run_module(target, run_name="__main__", alter_sys=False)
                rc = 0
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            finally:
                sys.argv = saved
    return rc, out.getvalue()


def test_help_of_each_documented_command_runs():
    heads = _heads()
    assert len(heads) > 10
    found = []
    for (target, *path), (where, called) in sorted(heads.items()):
        rc, out = _run_help(target, path, called)
        if rc != 0 or "usage:" not in out:
            found.append(f"{where}: `{called} {' '.join(path)} --help` exited {rc}: {out[-300:]}")
    assert not found, "\n".join(found)


def test_every_passthrough_command_is_documented_with_a_real_example():
    """The examples of ``cosyvoice-triton --help`` are read above; each passthrough command has one."""
    where = {s.where for s in _help_examples()}
    assert {f"commands.PASSTHROUGH[{name!r}]" for name in PASSTHROUGH} <= where


def test_set_takes_every_form_the_docs_use():
    """``--set a=1 --set b=2``, ``--set a=1,b=2`` and ``--set a=1 b=2`` give the same tunables to every command line
    that takes them, and a wrong one is the parser's error naming the tunable."""
    forms = (["--set", "vc_max_streams=8", "--set", "instances=flow:2,hift:2"],
             ["--set", "vc_max_streams=8,instances=flow:2,hift:2"],
             ["--set", "vc_max_streams=8", "instances=flow:2,hift:2"])
    want = {"vc_max_streams": 8, "instances": {"flow": 2, "hift": 2}}
    for target in ("model_repository/render.py", "cosyvoice_triton.loadtest.runner:main",
                   "cosyvoice_triton.loadtest.soak:main"):
        for argv in forms:
            parser, _ = command_parser(target, argv)
            action = next(a for a in parser._actions if "--set" in a.option_strings)
            assert dict(getattr(parser.parse_args(argv), action.dest)) == want, (target, argv)
        parser, _ = command_parser(target, [])
        parser.error = lambda message: (_ for _ in ()).throw(DocError(message))
        with pytest.raises(DocError, match="max_batch.*did you mean"):
            parser.parse_args(["--set", "max_batch=8"])
        with pytest.raises(DocError, match="several tunables go as"):
            parser.parse_args(["--set", "vc_max_streams=4,vc_max_waiting"])


def test_status_lists_real_make_targets():
    text = (ROOT / "docs" / "status.md").read_text()
    listed = re.search(r"Make targets \(`make help`\):(.*?)(?:\n\n|\Z)", text, re.S)
    assert listed, "docs/status.md lists no make targets"
    names = set(re.findall(r"`([a-z][a-z0-9-]*)`", listed.group(1)))
    targets, _ = makefile()
    assert names and names <= targets, f"not Makefile targets: {sorted(names - targets)}"


def test_each_command_a_make_target_runs_is_a_target_of_its_name():
    """``make X`` and ``cosyvoice-triton X`` are one thing: every ``cosyvoice-triton`` command a recipe runs is also a
    target of that name (other targets running it are variants, or older names kept as aliases)."""
    commands = set(re.findall(r"\$\(CLI\) ([a-z][a-z0-9-]*)", (ROOT / "Makefile").read_text()))
    targets, _ = makefile()
    assert {"export-onnx", "convert-llm", "loadtest-live"} <= commands
    assert commands <= targets, f"commands run by make under another name only: {sorted(commands - targets)}"


WRONG = {
    check_make: ["make no-such-target", "make serve NO_SUCH_VARIABLE=1"],
    check_cli: ["cosyvoice-triton render --no-such-flag", "cosyvoice-triton no-such-command",
                "cosyvoice-triton client vc --source a.wav --bogus", "python -m cosyvoice_triton.loadtest.soak --x",
                "python model_repository/render.py --flavor nope", "cosyvoice-triton rollout nope"],
    check_sets: ["--set max_batch=8", "cosyvoice-triton render --set no_such_tunable=1",
                 "cosyvoice-triton loadtest --set instances=flow:two", "--set warmup=1,bogus=2"],
    check_program: ["tritonserver --model-repository build/model_repository"],
}


@pytest.mark.parametrize("check", list(WRONG), ids=lambda c: c.__name__)
def test_each_check_fails_on_a_wrong_command(check):
    for text in WRONG[check]:
        lines = command_lines([Snippet("wrong", text, True)])
        assert problems(check, lines), f"{check.__name__} passed {text!r}"


def test_a_failed_dry_run_is_reported():
    line = command_lines([Snippet("wrong", "make no-such-target", True)])[0]
    assert make_dry_run(line)[0] != 0
