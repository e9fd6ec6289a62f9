"""The ``prefixcache`` command: ``serve`` (the OpenAI-compatible proxy), ``admin`` (cache admin on
every replica), ``bench`` (the benchmark) and ``plan`` (the capacity planner).

Each subcommand is registered by one ``_add_<name>`` function on the shared subparsers.
``serve`` flags are generated from the proxy's ``Settings`` fields, so a flag, its
``PREFIXCACHE_*`` env var and its default are defined once; a flag given on the command
line overrides the env var.
"""
from __future__ import annotations

import argparse
import errno
import logging
import re
import socket
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from prefixcache.errors import ConfigError, ModelLoadError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.handler(args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description="Prompt-prefix KV caching for Hugging Face "
                                     "causal LMs.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(commands)
    _add_admin(commands)
    _add_bench(commands)
    _add_plan(commands)
    return parser


# -- plan ----------------------------------------------------------------------------
def _add_plan(commands: argparse._SubParsersAction) -> None:
    from prefixcache.planner import cli as planner

    parser = commands.add_parser(
        "plan", help="replay a request log or a trace: hit rate against KV budget and TTL",
        description="Replay a request log (prefixcache serve --request-log) or a Mooncake-format trace through the "
                    "real trie and eviction policy at every budget and TTL; report token and request hit rates, "
                    "evictions, bytes held and the smallest budget within 2 points of unlimited.")
    planner.add_arguments(parser)
    parser.set_defaults(handler=planner.run)


# -- bench ---------------------------------------------------------------------------
def _add_bench(commands: argparse._SubParsersAction) -> None:
    from prefixcache import bench

    parser = commands.add_parser(
        "bench", help="benchmark prefixcache side by side with plain generate(), manual reuse and generate_batch",
        description="Run named shared-prefix workloads against several systems in one process; write a markdown "
                    "table, JSON and a PNG plot.")
    bench.add_arguments(parser)
    parser.set_defaults(handler=bench.run)


# -- admin ---------------------------------------------------------------------------
def _add_admin(commands: argparse._SubParsersAction) -> None:
    admin = commands.add_parser(
        "admin", help="prewarm, flush or read stats on every replica (a router does not forward /v1/cache)",
        description="Send one cache admin call to every replica with the admin key; print each replica's "
                    "answer and the aggregate as JSON. Exit code 1 if any replica failed.")
    admin.add_argument("--replicas", required=True, type=_url_list, metavar="URL,URL...",
                       help="every replica's own base URL (not the router's)")
    admin.add_argument("--admin-key", default=None, help="the replicas' admin key [PREFIXCACHE_ADMIN_KEY]")
    admin.add_argument("--tenant", default=None,
                       help="act on this tenant only (default: every tenant; a prewarm: the admin key's own tenant)")
    admin.add_argument("--timeout", type=float, default=300.0, help="seconds per replica call (default: %(default)g)")
    actions = admin.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("stats", help="hit counters and bytes: per replica and summed")
    actions.add_parser("flush", help="drop cached prefixes on every replica")
    prewarm = actions.add_parser("prewarm", help="prefill and keep one prefix on every replica")
    source = prewarm.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="a text prefix")
    source.add_argument("--messages-file", help="a JSON file holding a list of chat messages")
    prewarm.add_argument("--model", default=None, help="the served model name (checked by each replica)")
    prewarm.add_argument("--pin", action="store_true", help="keep it until flushed or its TTL ends")
    prewarm.add_argument("--ttl-seconds", type=float, default=None, help="idle expiry of this prefix")
    admin.set_defaults(handler=_admin)


def _admin(args: argparse.Namespace) -> int:
    import json
    import os

    from prefixcache.admin import FanOut

    key = args.admin_key or os.environ.get("PREFIXCACHE_ADMIN_KEY")
    if not key:
        print("prefixcache admin: give --admin-key or set PREFIXCACHE_ADMIN_KEY", file=sys.stderr)
        return 2
    with FanOut(args.replicas, key, timeout=args.timeout) as fan:
        if args.action == "stats":
            report = fan.stats(args.tenant)
        elif args.action == "flush":
            report = fan.flush(args.tenant)
        else:
            body: dict[str, Any] = {"pin": args.pin}
            if args.prompt is not None:
                body["prompt"] = args.prompt
            else:
                try:
                    with open(args.messages_file, encoding="utf-8") as f:
                        body["messages"] = json.load(f)
                except (OSError, ValueError) as exc:  # a missing file or not JSON: one line, not a traceback
                    print(f"prefixcache admin: cannot read --messages-file {args.messages_file}: {exc}", file=sys.stderr)
                    return 2
            body |= {k: v for k, v in (("model", args.model), ("ttl_seconds", args.ttl_seconds)) if v is not None}
            report = fan.prewarm(body, args.tenant)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def _url_list(text: str) -> list[str]:
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise argparse.ArgumentTypeError(f"expected comma-separated http(s) URLs, got {text!r}")
    return urls


# -- serve ---------------------------------------------------------------------------
def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI- and Anthropic-compatible proxy (default model: the embedded SmolLM2-135M-Instruct)",
        usage="%(prog)s [-h] [--FLAG VALUE ...]",  # the flags' list would bury an error message under 70 lines
        description="Run the OpenAI- and Anthropic-compatible proxy. Every flag can also be set as an env var "
                    "(shown in brackets).")
    try:
        from prefixcache_api.settings import ENV_PREFIX, NONE_WORDS, Settings
    except ImportError:  # the proxy's dependencies are missing: the command says so when run
        serve.set_defaults(handler=_serve_unavailable)
        return
    for name, field in Settings.model_fields.items():
        flag = _serve_flag(name)
        default = _default_text(name, field.get_default(call_default_factory=True))
        help_text = f"{field.description}{default} [{ENV_PREFIX}{name.upper()}]".replace("%", "%%")
        if name == "api_keys":
            serve.add_argument(flag, dest=name, action="append", metavar="KEY=TENANT", type=_key_pair,
                               default=argparse.SUPPRESS, help=f"{help_text} (repeatable)")
            continue
        kind, choices, optional = _flag_type(field.annotation)
        if kind is bool:
            serve.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
        else:
            serve.add_argument(flag, dest=name, type=_nullable(kind, NONE_WORDS) if optional else kind, choices=choices,
                               default=argparse.SUPPRESS, help=help_text + (" ('none' to unset)" if optional else ""))
    serve.set_defaults(handler=_serve)


def _serve_flag(name: str) -> str:
    """The ``prefixcache serve`` flag of a ``Settings`` field (``api_keys`` is given one key at a time)."""
    return "--api-key" if name == "api_keys" else "--" + name.replace("_", "-")


def _default_text(name: str, default: Any) -> str:
    """`` (default: ...)`` for a flag's help; nothing for an unset one, whose help says what unset means."""
    if default is None or default == {}:
        return ""
    if isinstance(default, bool):
        return f" (default: {str(default).lower()})"
    if name.endswith("bytes") and isinstance(default, int) and default >= 1024:
        from prefixcache.planner.units import format_size

        return f" (default: {default} = {format_size(default)})"
    return f" (default: {default})"


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from prefixcache_api import Settings, build_cache, create_app
    from prefixcache_api.server import server_options
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    if "api_keys" in overrides:
        overrides["api_keys"] = dict(overrides["api_keys"])
    try:
        settings = Settings(**overrides)
    except (ValidationError, SettingsError) as exc:
        print(f"prefixcache serve: invalid settings:\n{_settings_error(exc)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # a port already taken is said before the model loads (tens of seconds), not after
        with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((settings.host, settings.port))
    except OSError as exc:
        hint = {errno.EADDRINUSE: "; another server holds it: stop it, or choose another port (--port, "
                                  "PREFIXCACHE_PORT)",
                errno.EACCES: "; ports below 1024 need root: choose another (--port, PREFIXCACHE_PORT)",
                errno.EADDRNOTAVAIL: "; no interface of this machine has that address (--host, PREFIXCACHE_HOST)"}
        print(f"prefixcache serve: cannot listen on {settings.host}:{settings.port}: {exc}{hint.get(exc.errno, '')}",
              file=sys.stderr)
        return 3
    try:
        cache = build_cache(settings)  # loaded before binding, so a bad --model fails fast with a clear message
    except (ModelLoadError, ConfigError) as exc:
        print(f"prefixcache serve: {exc}", file=sys.stderr)
        return 1
    keys = len(settings.api_keys)
    mode = f"multi-tenant mode ({keys} tenant key{'s' * (keys != 1)}" + \
        (", an admin key)" if settings.admin_key is not None else ")")
    if settings.local_mode:
        mode = "local single-tenant mode (no API keys" + (", every caller admin)" if settings.local_admin else
                                                          "; --local-admin opens /metrics and all-tenant stats)")
    logging.getLogger("prefixcache.cli").info("starting %s on http://%s:%d/v1 in %s", cache.model_id or "model",
                                              settings.host, settings.port, mode)
    try:
        uvicorn.run(create_app(settings, cache=cache), host=settings.host, port=settings.port,
                    log_level=settings.log_level, **server_options(settings))
    finally:
        cache.close()
    return 0


def _settings_error(exc: Exception) -> str:
    """One line per problem, naming the setting as its flag and env var (no pydantic boilerplate, no traceback)."""
    from prefixcache_api.settings import ENV_PREFIX
    from pydantic import ValidationError

    def where(name: str) -> str:
        return f"{name} ({_serve_flag(name)}, {ENV_PREFIX}{name.upper()})"

    if not isinstance(exc, ValidationError):  # an env var of a JSON-valued setting that does not parse
        field = (re.findall(r'field "(\w+)"', str(exc)) or [""])[0]
        example = f"; e.g. {ENV_PREFIX}API_KEYS='{{\"sk-...\": \"team-a\"}}'" if field == "api_keys" else ""
        return f"  {where(field) if field else 'a setting'}: not valid JSON ({exc.__cause__ or exc}){example}"
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ())]
        message = error.get("msg", "").removeprefix("Value error, ")
        lines.append(f"  {where(loc[0])}: {message}" if loc else f"  {message}")
    return "\n".join(lines)


def _serve_unavailable(args: argparse.Namespace) -> int:
    print("prefixcache serve: the proxy's dependencies are not installed (fastapi, uvicorn, pydantic-settings, "
          "prometheus-client); reinstall the checkout with `pip install .`.", file=sys.stderr)
    return 1


def _flag_type(annotation: Any) -> tuple[Any, list[str] | None, bool]:
    """(argparse type, choices, accepts None) for a Settings field annotation."""
    args = typing.get_args(annotation)
    optional = (typing.get_origin(annotation) in (typing.Union, types.UnionType)) and type(None) in args
    if optional:
        annotation = next(a for a in args if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return str, [str(a) for a in typing.get_args(annotation)], optional
    if annotation in (bool, int, float):
        return annotation, None, optional
    return str, None, optional


def _nullable(kind: Any, none_words: Sequence[str]):
    def parse(text: str) -> Any:
        return None if text.lower() in none_words else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _key_pair(text: str) -> tuple[str, str]:
    key, sep, tenant = text.partition("=")
    if not sep or not key or not tenant:
        raise argparse.ArgumentTypeError(f"expected KEY=TENANT, got {text!r}")
    return key, tenant


if __name__ == "__main__":
    raise SystemExit(main())
