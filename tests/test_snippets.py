"""Every fenced code block in README.md and docs/*.md runs, or is checked, as a reader would paste it.

The convention, by the fence's language and an HTML comment on the line just above it:

- ```python: executed, each block on its own (a fresh namespace, nothing shared with the block
  before), its stdout captured. ``load_default_model`` hands back the default model this session
  already loaded (the same weights: a snippet does not pay for loading them again). A block that
  names ``127.0.0.1:PORT`` or ``localhost:PORT`` needs a server there: the last
  ``prefixcache serve`` (or ``make serve``) command on the same page, above the block, that
  listens on PORT is started on a free loopback port, with its flags and environment, and the
  block's PORT is rewritten to that port. No such command on the page fails the block.
- ```bash (or ```sh, ```shell): ``bash -n`` parses the block, and each command in it is checked:
  ``prefixcache ...`` against the CLI's own argparse parsers (``serve`` also builds its
  ``Settings`` from the flags and the command's environment assignments), ``python -m MODULE``
  and ``python path/script.py`` against that program's parser, ``make TARGET`` against the
  Makefile (``ARGS=...`` against the target's command), ``pip install`` pins against the
  Makefile's, ``docker run ... prefixcache ARGS`` as ``prefixcache ARGS`` (the image's entry point,
  with its ``-e`` variables). ``[...]`` around flags marks them optional: they are checked as if
  given. ``$(openssl rand -hex N)`` stands for 2N hex digits.
- ``<!-- snippet: run -->`` above a bash block: also executed, with ``bash -euo pipefail``, against
  the page's server as for Python (an unset variable fails it, and so does any ``curl`` that gets
  an HTTP error status).
- ``<!-- snippet: expect "REGEX" -->`` above a block: its stdout must match REGEX (``re.search``,
  multi-line). That is how a block's promise ("cached from the second call on") is held to.
- ``<!-- snippet: no-run REASON -->`` above a Python block: compiled, not executed (it needs a GPU,
  a download, or a server this test cannot start). The reason is required.
- ```text: output samples and diagrams, not run; ```json: parsed. A fence without a language fails.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*snippet:\s*(\S+)\s*(.*?)\s*-->\s*$")
LANGS = {"python", "bash", "sh", "shell", "text", "json"}
MARKERS = {"run", "expect", "no-run"}
#: ``host:port`` in a block: the server it needs.
ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):(\d{2,5})\b")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
WRAPPERS = {"time", "/usr/bin/time", "sudo", "nohup", "exec", "env"}


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    markers: tuple[tuple[str, str], ...]  # (name, argument) from the comments just above the fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def marker(self, name: str) -> str | None:
        return next((arg for key, arg in self.markers if key == name), None)


def blocks_of(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, lang = i, match.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        markers, k = [], start - 1
        while k >= 0 and MARKER.match(lines[k]):
            markers.insert(0, MARKER.match(lines[k]).groups())
            k -= 1
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", tuple(markers)))
        i = end + 1
    return out


BLOCKS = [b for page in PAGES for b in blocks_of(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell")]


def test_every_block_says_what_it_is():
    for b in BLOCKS:
        assert b.lang in LANGS, f"{b.id}: a fence needs a language ({', '.join(sorted(LANGS))}), got {b.lang!r}"
        for name, arg in b.markers:
            assert name in MARKERS, f"{b.id}: unknown snippet marker {name!r} (known: {sorted(MARKERS)})"
            assert name != "no-run" or arg, f"{b.id}: `no-run` needs a reason"
            assert name != "run" or b.lang != "python", f"{b.id}: Python blocks run anyway; `run` is for shell"
            assert name != "expect" or (arg.startswith('"') and arg.endswith('"')), f"{b.id}: expect \"REGEX\""
        assert not (b.marker("no-run") and b.marker("expect")), f"{b.id}: a block that does not run expects nothing"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.id)
def test_json_blocks_parse(block):
    json.loads(block.code)


# -- shell commands ------------------------------------------------------------------------
def logical_lines(code: str) -> list[str]:
    """Lines with backslash continuations joined."""
    out, pending = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return [ln for ln in out if ln.strip()]


def commands(line: str) -> list[list[str]]:
    """The simple commands of one line: words, split at ``|``, ``&&``, ``||`` and ``;``."""
    line = re.sub(r"\$\(openssl rand -hex (\d+)\)", lambda m: "0" * 2 * int(m.group(1)), line)
    words = shlex.split(line, comments=True)
    out: list[list[str]] = [[]]
    for word in words:
        if word in ("|", "&&", "||", ";"):
            out.append([])
        elif word.endswith(";"):
            out[-1].append(word[:-1])
            out.append([])
        else:
            out[-1].append(word)
    return [c for c in out if c]


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, the command after them and any wrapper such as ``time -v``)."""
    env: dict[str, str] = {}
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        name, _, value = argv[0].partition("=")
        env[name], argv = value, argv[1:]
    while argv and argv[0] in WRAPPERS:
        argv = argv[1:]
        while argv and argv[0].startswith("-"):
            argv = argv[1:]
    return env, argv


def optional_parts(argv: list[str]) -> list[str]:
    """``[--flag value]`` written as optional: checked as if given."""
    return [w.lstrip("[").rstrip("]") for w in argv if w.lstrip("[").rstrip("]")]


class Parsed(Exception):
    """Raised by the patched ``parse_args`` once a program's parser accepted its arguments."""


@contextlib.contextmanager
def parse_only():
    """Within: a program's ``parse_args`` (or a ``parse_known_args`` of its own) parses, then stops the
    program by raising ``Parsed``, so nothing past its argument parsing runs."""
    real_args, real_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = threading.local()

    def parse_args(self, args=None, namespace=None):
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            parsed = real_args(self, args, namespace)
        finally:
            inside.depth -= 1
        raise Parsed(parsed)

    def parse_known_args(self, args=None, namespace=None):
        parsed = real_known(self, args, namespace)
        if getattr(inside, "depth", 0):  # parse_args' own call, or a subcommand's parser
            return parsed
        raise Parsed(parsed[0])

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args):
        yield


def parse_program(main, argv: list[str], what: str) -> argparse.Namespace:
    err = io.StringIO()
    with parse_only(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except Parsed as parsed:
            return parsed.args[0]
        except SystemExit as exc:
            pytest.fail(f"{what}: its parser refuses {shlex.join(argv)!r} (exit {exc.code}): {err.getvalue()[-800:]}")
    pytest.fail(f"{what}: returned without parsing its arguments")


def cli_main(argv: list[str]) -> None:
    from prefixcache.cli import build_parser

    build_parser().parse_args(argv)


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """``os.environ`` with the proxy's ``PREFIXCACHE_*`` variables replaced by ``env``'s."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("PREFIXCACHE_")]:
        del os.environ[name]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def serve_settings(args: argparse.Namespace, env: dict[str, str]):
    """The ``Settings`` ``prefixcache serve`` builds from these flags and this environment (as ``cli._serve``)."""
    from prefixcache_api import Settings

    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    if "api_keys" in overrides:
        overrides["api_keys"] = dict(overrides["api_keys"])
    with environment(env):
        return Settings(**overrides)


def check_prefixcache(argv: list[str], env: dict[str, str], where: str) -> None:
    args = parse_program(cli_main, argv, f"{where}: `prefixcache`")
    if args.command == "serve":
        try:
            serve_settings(args, env)
        except Exception as exc:  # noqa: BLE001 (pydantic's ValidationError, with the reason)
            pytest.fail(f"{where}: `prefixcache {shlex.join(argv)}` would not start: {exc}")


def load_main(module: str | None = None, path: Path | None = None):
    import importlib
    import importlib.util

    if module is not None:
        return importlib.import_module(module).main
    name = f"snippet_{path.stem}"
    if name not in sys.modules:  # registered first: dataclasses look their module up there
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name].main


def check_python(argv: list[str], where: str) -> None:
    if argv[1:2] == ["-c"]:
        return
    if argv[1:2] == ["-m"]:
        module, rest = argv[2], argv[3:]
        if module in ("pytest", "pip", "venv"):
            return
        assert module.startswith(("prefixcache", "benchmarks.")), f"{where}: python -m {module} is not this project's"
        parse_program(load_main(module=module), optional_parts(rest), f"{where}: python -m {module}")
        return
    script, rest = ROOT / argv[1], argv[2:]
    assert script.is_file(), f"{where}: {argv[1]} does not exist"
    if "argparse" in script.read_text():
        parse_program(load_main(path=script), optional_parts(rest), f"{where}: {argv[1]}")
    else:
        assert not rest, f"{where}: {argv[1]} takes no arguments, given {rest}"


def makefile() -> str:
    return (ROOT / "Makefile").read_text()


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", makefile(), re.MULTILINE))


def check_make(argv: list[str], where: str) -> None:
    targets = [w for w in argv[1:] if not w.startswith("-") and "=" not in w]
    assert targets, f"{where}: `make` with no target"
    missing = set(targets) - make_targets()
    assert not missing, f"{where}: the Makefile has no target {sorted(missing)}"
    passed = dict(w.split("=", 1) for w in argv[1:] if "=" in w)
    if "ARGS" in passed:
        for target in targets:
            if target in ("serve", "bench"):
                check_prefixcache([target, *shlex.split(passed["ARGS"])], {}, where)


def check_pip(argv: list[str], where: str) -> None:
    if "install" not in argv:
        return
    pins = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)", makefile()))
    extras = re.search(r"^\[project\.optional-dependencies\]\n(.*?)^\[", (ROOT / "pyproject.toml").read_text(),
                       re.MULTILINE | re.DOTALL).group(1)
    extras = set(re.findall(r"^([a-z][a-z0-9-]*) = ", extras, re.MULTILINE))
    for word in argv[argv.index("install") + 1:]:
        name, sep, version = word.partition("==")
        if sep and name in pins:
            assert version.split("+")[0] == pins[name].split("+")[0], f"{where}: {word}, the Makefile pins {pins[name]}"
        match = re.fullmatch(r"\.\[([a-z,]+)\]", word.strip("'\""))
        if match:
            for extra in match.group(1).split(","):
                assert extra in extras, f"{where}: pyproject.toml has no extra {extra!r}"


def check_command(argv: list[str], where: str, exported: dict[str, str] | None = None) -> None:
    """Check one simple command; ``exported``: the variables the block's ``export`` lines set so far."""
    exported = {} if exported is None else exported
    env, argv = split_env(argv)
    if argv[:1] == ["export"]:
        exported.update(w.split("=", 1) for w in argv[1:] if "=" in w)
        return
    if not argv:
        return
    program = os.path.basename(argv[0])
    if program == "prefixcache":
        check_prefixcache(optional_parts(argv[1:]), env, where)
    elif re.fullmatch(r"python3?(\.\d+)?", program) and len(argv) > 1:
        check_python(argv, where)
    elif program == "make":
        check_make(argv, where)
    elif program in ("pip", "pip3"):
        check_pip(argv, where)
    elif argv[:2] == ["docker", "run"]:
        check_docker_run(argv, where, exported)


def check_docker_run(argv: list[str], where: str, exported: dict[str, str]) -> None:
    """``docker run [options] prefixcache ARGS``: this project's image runs ``prefixcache ARGS`` (its ENTRYPOINT);
    ``-e NAME`` passes the variable the block exported."""
    env, i = {}, 2
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag in ("-e", "--env"):
            name, sep, value = argv[i + 1].partition("=")
            env[name] = value if sep else exported.get(name, "")
        i += 1 if "=" in flag or flag in ("--rm", "-d", "-i", "-t", "-it", "--init") else 2
    if i < len(argv) and argv[i] == "prefixcache":
        check_prefixcache(argv[i + 1:], env, where)


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.id)
def test_shell_block_parses_and_its_commands_exist(block):
    syntax = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, f"{block.id}: bash -n: {syntax.stderr}"
    exported: dict[str, str] = {}
    for n, line in enumerate(logical_lines(block.code)):
        for argv in commands(line):
            check_command(argv, f"{block.id} (command {n + 1})", exported)


# -- servers -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServeCommand:
    line: int  # where the command is on its page
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]  # after `prefixcache`


def serve_commands(page: str) -> list[ServeCommand]:
    out = []
    for b in blocks_of(page):
        if b.lang not in ("bash", "sh", "shell"):
            continue
        for line in logical_lines(b.code):
            for words in commands(line):
                env, argv = split_env(words)
                if argv[:2] == ["prefixcache", "serve"]:
                    out.append(ServeCommand(b.line, tuple(env.items()), tuple(argv[1:])))
                elif argv[:2] == ["make", "serve"]:
                    passed = dict(w.split("=", 1) for w in argv[2:] if "=" in w)
                    out.append(ServeCommand(b.line, tuple(env.items()),
                                            ("serve", *shlex.split(passed.get("ARGS", "")))))
    return out


def listens_on(command: ServeCommand) -> int:
    args = parse_program(cli_main, list(command.argv), "serve")
    return serve_settings(args, dict(command.env)).port


def server_for(block: Block) -> dict[int, ServeCommand]:
    """The serve command behind each port the block names: the last one above it on its page."""
    ports = sorted({int(p) for p in ADDRESS.findall(block.code)})
    found = {}
    for port in ports:
        above = [c for c in serve_commands(block.page) if c.line < block.line and listens_on(c) == port]
        assert above, (f"{block.id} talks to port {port}, but no `prefixcache serve` above it on {block.page} "
                       f"listens there")
        found[port] = above[-1]
    return found


class Servers:
    """``prefixcache serve`` commands as running servers on free loopback ports, started once each, on the
    default model this session loaded."""

    def __init__(self, default_model):
        self.default_model = default_model
        self.running: dict[ServeCommand, tuple[Any, Any, threading.Thread, int]] = {}

    def port_of(self, command: ServeCommand) -> int:
        key = dataclasses.replace(command, line=0)
        if key not in self.running:
            self.running[key] = self.start(command)
        return self.running[key][3]

    def start(self, command: ServeCommand):
        import uvicorn
        from prefixcache_api import app as app_module
        from prefixcache_api.server import server_options

        from prefixcache.bench.servers import free_port

        settings = serve_settings(parse_program(cli_main, list(command.argv), "serve"), dict(command.env))
        assert settings.model is None, "a snippet's server runs the default model only"
        with mock.patch.object(app_module, "load_default_model", self.load):
            cache = app_module.build_cache(settings)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app_module.create_app(settings, cache=cache), host="127.0.0.1",
                                               port=port, log_level="warning", **server_options(settings)))
        thread = threading.Thread(target=server.run, name="snippet-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the snippet's server did not start"
            time.sleep(0.02)
        return server, cache, thread, port

    def load(self, *, dtype="float32", device="cpu", **_):
        assert str(dtype).endswith("float32") and str(device) == "cpu", "the default model as loaded: float32, CPU"
        return self.default_model

    def stop(self) -> None:
        for server, cache, thread, _ in self.running.values():
            server.should_exit = True
            thread.join(timeout=30)
            cache.close()


@pytest.fixture(scope="module")
def servers(default_model):
    """Every server the module's blocks need, started up front (module scope: their threads outlive
    each test by design)."""
    pool = Servers(default_model)
    for block in [*PYTHON, *SHELL]:
        if block.marker("no-run") is None and (block.lang == "python" or block.marker("run") is not None):
            with contextlib.suppress(AssertionError):  # a block without its server fails on its own
                for command in server_for(block).values():
                    pool.port_of(command)
    yield pool
    pool.stop()


def rewritten(block: Block, servers: Servers) -> str:
    """The block's code with each ``host:PORT`` pointing at its server's real port."""
    ports = {port: servers.port_of(command) for port, command in server_for(block).items()}
    return ADDRESS.sub(lambda m: f"127.0.0.1:{ports[int(m.group(1))]}", block.code)


def check_expectation(block: Block, stdout: str) -> None:
    expect = block.marker("expect")
    if expect is not None:
        pattern = expect[1:-1]
        assert re.search(pattern, stdout.strip(), re.MULTILINE), \
            f"{block.id}: the output does not match {pattern!r}:\n{stdout[-2000:]}"


# -- Python blocks ---------------------------------------------------------------------------
def run_python(block: Block, code: str, default_model) -> str:
    """Execute ``code`` (the block's, maybe with its ports rewritten) as a fresh ``__main__``; its stdout."""
    import prefixcache
    from prefixcache import PrefixCache

    model, tokenizer = default_model
    namespace: dict[str, Any] = {"__name__": "__main__"}
    out = io.StringIO()
    with mock.patch.object(prefixcache, "load_default_model", lambda **_: (model, tokenizer)), \
            contextlib.redirect_stdout(out):
        try:
            exec(compile(code, block.id, "exec"), namespace)  # noqa: S102 (the documentation's own code)
        finally:
            for value in namespace.values():  # a block that leaves its cache open: close it here
                if isinstance(value, PrefixCache):
                    value.close()
    return out.getvalue()


def runs_alone(block: Block) -> bool:
    return block.marker("no-run") is None and not ADDRESS.search(block.code)


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_compiles(block):
    compile(block.code, block.id, "exec")


@pytest.mark.parametrize("block", [b for b in PYTHON if runs_alone(b)], ids=lambda b: b.id)
def test_python_block_runs(block, default_model):
    check_expectation(block, run_python(block, block.code, default_model))


@pytest.mark.parametrize("block", [b for b in PYTHON if b.marker("no-run") is None and ADDRESS.search(b.code)],
                         ids=lambda b: b.id)
def test_python_client_block_runs_against_its_server(block, default_model, servers):
    check_expectation(block, run_python(block, rewritten(block, servers), default_model))


# -- shell blocks that run -------------------------------------------------------------------
#: ``curl`` fails on an HTTP error status (4xx/5xx), so a wrong key, model or route fails the block.
CURL = 'curl() { command curl --fail-with-body --max-time 120 "$@"; }\n'


@pytest.mark.parametrize("block", [b for b in SHELL if b.marker("run") is not None], ids=lambda b: b.id)
def test_shell_block_runs(block, servers):
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", CURL + rewritten(block, servers)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("K", "A", "M")})
    assert done.returncode == 0, f"{block.id}: exit {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
    check_expectation(block, done.stdout)


def test_the_checks_catch_what_they_are_for():
    """The checker itself: a wrong flag, a missing script, a missing make target and a wrong port fail."""
    where = "self-check"
    for bad in (["prefixcache", "serve", "--no-such-flag"], ["python", "examples/no_such_script.py"],
                ["make", "no-such-target"], ["python", "-m", "benchmarks.tiers", "--no-such-flag"],
                ["PREFIXCACHE_API_KEYS=not-json", "prefixcache", "serve"]):
        with pytest.raises((pytest.fail.Exception, AssertionError)):
            check_command(bad, where)
    orphan = Block("README.md", 10 ** 6, "python", 'OpenAI(base_url="http://127.0.0.1:8001/v1")\n', ())
    with pytest.raises(AssertionError, match="no `prefixcache serve`"):
        server_for(orphan)
