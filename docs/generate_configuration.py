"""Write docs/configuration.md, the flags and environment variables of the services, the endpoint picker,
the engine stand-in, the P/D sidecar and the local stack, from their parsers.

    python docs/generate_configuration.py           # (re)write docs/configuration.md
    python docs/generate_configuration.py --check   # exit 1, with a short diff, if the file is stale

Each service's `main` builds its argparse parser and hands it to `dynamo_lite.web.cli.parse_args`;
the generator runs `main` with that function replaced by one that catches the parser, so the
tables list exactly the flags the services take (a flag added to a parser shows up here, and
`tests/test_docs_site.py` fails until the page is regenerated). Help texts are the parsers' own.
The local stack (`python -m dynamo_lite.stack`) is a developer's command, not a service: its
`build_parser()` is read directly, and it takes no environment variables.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_reference import ROOT, CannotGenerate, write_or_check  # noqa: E402  (the generator beside this one)

OUTPUT = ROOT / "docs" / "configuration.md"


@dataclass(frozen=True)
class Program:
    title: str
    module: str  # its `__main__` builds the parser
    script: str  # the console script pyproject.toml installs
    environment: bool = True  # False: its `__main__.build_parser()` gives the parser, and no variables apply


PROGRAMS = (
    Program("Slot tracker", "dynamo_lite.slot_tracker", "dynamo-lite-slot-tracker"),
    Program("Indexer", "dynamo_lite.indexer", "dynamo-lite-indexer"),
    Program("Selection service", "dynamo_lite.select_service", "dynamo-lite-select-service"),
    Program("Endpoint picker", "dynamo_lite.epp", "dynamo-lite-epp"),
    Program("Engine stand-in", "dynamo_lite.mock_engine", "dynamo-lite-mock-engine"),
    Program("P/D sidecar", "dynamo_lite.pd_sidecar", "dynamo-lite-pd-sidecar"),
    Program("Local stack", "dynamo_lite.stack", "dynamo-lite-stack", environment=False),
)


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser caught")
        self.parser = parser


def service_parser(module_name: str) -> argparse.ArgumentParser:
    """The parser `module_name`'s `main` builds, caught before it parses anything."""
    module = importlib.import_module(f"{module_name}.__main__")
    if not hasattr(module, "parse_args"):
        raise CannotGenerate(f"{module_name}.__main__ no longer calls dynamo_lite.web.cli.parse_args")

    def catch(parser: argparse.ArgumentParser, *_: object, **__: object) -> argparse.Namespace:
        raise _Caught(parser)

    original = module.parse_args
    module.parse_args = catch
    try:
        module.main([])
    except _Caught as caught:
        return caught.parser
    finally:
        module.parse_args = original
    raise CannotGenerate(f"{module_name}.__main__.main() returned without parsing its arguments")


def program_parser(program: Program) -> argparse.ArgumentParser:
    if program.environment:
        return service_parser(program.module)
    parser: argparse.ArgumentParser = importlib.import_module(f"{program.module}.__main__").build_parser()
    return parser


def default_text(action: argparse.Action) -> str:
    default = action.default
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)) and not default:
        return "off"
    if default is None or default == "" or default == () or default == []:
        return "none"
    if isinstance(default, (tuple, list)):
        return "`" + ",".join(map(str, default)) + "`"
    return f"`{default}`"


def cell(text: str) -> str:
    return " ".join(text.replace("%%", "%").replace("|", "\\|").split())


def flag_rows(parser: argparse.ArgumentParser, environment: bool = True) -> list[str]:
    from dynamo_lite.web.cli import env_name

    rows = (["| flag | default | environment variable | meaning |", "|---|---|---|---|"] if environment
            else ["| flag | default | meaning |", "|---|---|---|"])
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings if flag.startswith("--"))
        meaning = action.help or ""
        if not meaning:
            raise CannotGenerate(f"{action.option_strings[0]} has no help text")
        if action.choices:
            meaning += f" (one of {', '.join(f'`{choice}`' for choice in action.choices)})"
        variable = f" `{env_name(action)}` |" if environment else ""
        rows.append(f"| {flags} | {default_text(action)} |{variable} {cell(meaning)} |")
    return rows


def render() -> str:
    lines = [
        "# Configuration: flags and environment variables",
        "",
        "<!-- Generated by docs/generate_configuration.py from the services' argument parsers. "
        "Do not edit: change the parsers, then run `python docs/generate_configuration.py`. -->",
        "",
        "Every flag can also be set by the environment variable `DYNAMO_LITE_` + the flag's name in "
        "upper case with `-` as `_`; a flag given on the command line wins, and `--help` names each "
        "variable. A value the flag would refuse stops the service with exit status 2 and a message "
        "naming the variable. On/off flags take `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`.",
        "",
        "```sh",
        "DYNAMO_LITE_PORT=9091 DYNAMO_LITE_LOG_FORMAT=json DYNAMO_LITE_ACCESS_LOG=1 dynamo-lite-slot-tracker",
        "```",
        "",
        "Installing the project (`pip install -e .`) puts a console script for each service on the "
        "venv's PATH; `python -m` runs the same program.",
        "",
    ]
    for program in PROGRAMS:
        parser = program_parser(program)
        lines += [
            f"## {program.title}",
            "",
            f"`{program.script}`, or `python -m {program.module}`: {cell(parser.description or '')}"
            + ("" if program.environment else " A developer's command: its flags take no environment variables."),
            "",
            *flag_rows(parser, program.environment),
            "",
        ]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(argv, __doc__, OUTPUT, render, script="docs/generate_configuration.py")


if __name__ == "__main__":
    sys.exit(main())
