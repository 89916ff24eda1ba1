"""Write docs/client-reference.md from the signatures and docstrings of the gateway-facing modules.

    python docs/generate_reference.py           # (re)write docs/client-reference.md
    python docs/generate_reference.py --check   # exit 1, with a short diff, if the file is stale

Everything in the reference comes from the code: the modules' public names in source order,
signatures from `inspect.signature` (annotations as written: the modules use
`from __future__ import annotations`), and the first paragraph of each docstring. A public name
without a docstring is an error, so the reference cannot silently fall behind the code;
`tests/test_docs.py` runs `--check`.

A public name is one without a leading underscore that the module defines itself, plus the
names it imports and lists in `__all__` on purpose, listed after the module's own names in
`__all__` order (`dynamo_lite.client` defines nothing itself: it publishes names from private
modules, which the reference does not mention, and the row types of
`dynamo_lite.slot_tracker.protocols`). A re-exported constant's docstring is read from its
defining module. Type variables are typing plumbing and are left out. A constant's
docstring is the string literal right after its assignment (the convention Sphinx reads). A
re-exported class without a docstring of its own is described by a bullet "* `Name`: ..." in
the re-exporting module's docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "client-reference.md"
MODULES = ("dynamo_lite.client", "dynamo_lite.routing", "dynamo_lite.routing.scheduling", "dynamo_lite.hashing")
PACKAGE = "dynamo_lite"
# The docs page on the request flow (its title must start so) and the examples the intro points
# to; the generator fails if they are gone, so the links cannot break silently. The examples are
# named, not linked: they live outside the docs site.
FLOW_PAGE = "routing.md"
FLOW_TITLE = "Routing a request"
EXAMPLES = ("examples/quickstart.py", "examples/gateway.py")
SHORT_VALUE = 60  # a constant's value is shown when its repr is at most this long
DIFF_LINES = 40  # lines of diff `--check` prints at most


class CannotGenerate(Exception):
    """The reference cannot be generated faithfully (a name without docstring, a broken link)."""


@dataclass
class Entry:
    """One public name of a module, in the order the module's source has it."""

    name: str
    obj: Any
    kind: str  # "class", "function" or "constant"
    doc: str | None  # the full docstring (or its stand-in), cleaned
    reexported_from: str | None = None


# --- docstrings ---------------------------------------------------------------------------


def first_paragraph(doc: str | None) -> str:
    """The docstring's first paragraph on one line ("" for none)."""
    if not doc:
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())


def own_doc(obj: Any) -> str | None:
    """The object's own docstring: not inherited, not the one `dataclass` makes up."""
    if isinstance(obj, type):
        doc = obj.__dict__.get("__doc__")
        if doc and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
            return None  # dataclasses write the signature as a docstring when there is none
    else:
        doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if doc and doc.strip() else None


def bullet_doc(module: ModuleType, name: str) -> str | None:
    """The text of the bullet "* `name`: ..." in the module's docstring, if there is one."""
    doc = inspect.cleandoc(module.__doc__ or "")
    match = re.search(rf"^\* `{re.escape(name)}`: (.*?)(?=^\S|\n\n|\Z)", doc, re.MULTILINE | re.DOTALL)
    if not match:
        return None
    text = " ".join(match.group(1).split())
    return text[:1].upper() + text[1:]


# --- public names -------------------------------------------------------------------------


def public_entries(module: ModuleType) -> list[Entry]:
    """The module's public names in source order (see the module docstring for the rules)."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    exported = set(getattr(module, "__all__", ()))
    entries: list[Entry] = []
    reexports: list[Entry] = []  # listed after the module's own names
    statements = tree.body
    for index, node in enumerate(statements):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                obj = getattr(module, node.name)
                kind = "class" if isinstance(obj, type) else "function"
                entries.append(Entry(node.name, obj, kind, own_doc(obj)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            for name in names:
                if name.startswith("_") or name == "__all__":
                    continue
                obj = getattr(module, name)
                if isinstance(obj, typing.TypeVar):
                    continue
                following = statements[index + 1] if index + 1 < len(statements) else None
                doc = None
                if (
                    isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                ):
                    doc = inspect.cleandoc(following.value.value)
                entries.append(Entry(name, obj, "constant", doc))
        elif isinstance(node, ast.ImportFrom):
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__)
            for alias in node.names:
                name = alias.asname or alias.name
                if name in exported:
                    obj = getattr(module, name)
                    kind = "class" if isinstance(obj, type) else "function" if callable(obj) else "constant"
                    doc = own_doc(obj) if kind != "constant" else constant_doc(source, alias.name)
                    home = getattr(obj, "__module__", source)
                    reexports.append(Entry(name, obj, kind, doc or bullet_doc(module, name),
                                           None if is_private(home) else home))
    order = list(getattr(module, "__all__", ()))
    entries += sorted(reexports, key=lambda entry: order.index(entry.name))
    missing = exported - {entry.name for entry in entries}
    if missing:
        raise CannotGenerate(f"{module.__name__}.__all__ names {sorted(missing)}, not defined or imported there")
    return entries


def is_private(module_name: str) -> bool:
    """A module whose names are published by another (`dynamo_lite.client._client_base`)."""
    return any(part.startswith("_") for part in module_name.split("."))


def constant_doc(module_name: str, name: str) -> str | None:
    """The string literal right after `name = ...` in the module's source, if there is one."""
    module = importlib.import_module(module_name)
    statements = ast.parse(Path(module.__file__).read_text(encoding="utf-8")).body
    for node, following in zip(statements, statements[1:]):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            return inspect.cleandoc(following.value.value)
    return None


def in_package(klass: type) -> bool:
    return klass.__module__ == PACKAGE or klass.__module__.startswith(PACKAGE + ".")


@dataclass
class Member:
    """A public method or property of a class, own or inherited from a class of the package."""

    name: str
    kind: str  # "method", "async method", "classmethod", "staticmethod" or "property"
    signature: str
    doc: str | None
    defined_in: type


def class_members(cls: type) -> list[Member]:
    members: list[Member] = []
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not in_package(klass):
            continue
        for name, attribute in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            member = describe_member(name, attribute, klass)
            if member is not None:
                seen.add(name)
                members.append(member)
    return members


def describe_member(name: str, attribute: Any, klass: type) -> Member | None:
    if isinstance(attribute, property):
        returns = inspect.signature(attribute.fget).return_annotation if attribute.fget else inspect.Signature.empty
        signature = f"{name}: {render_annotation(returns)}" if returns is not inspect.Signature.empty else name
        return Member(name, "property", signature, own_doc(attribute), klass)
    if isinstance(attribute, (classmethod, staticmethod)):
        function = attribute.__func__
        kind = type(attribute).__name__
        skip_first = isinstance(attribute, classmethod)
    elif inspect.isfunction(attribute):
        function = attribute
        kind = "async method" if inspect.iscoroutinefunction(attribute) else "method"
        skip_first = True
    else:
        return None  # dataclass fields, slots, class constants
    signature = name + render_signature(inspect.signature(function), skip_first=skip_first)
    return Member(name, kind, signature, own_doc(function), klass)


def instance_attributes(cls: type) -> list[str]:
    """Public attributes the `__init__`s of the class and its package bases assign
    (`self.name = ...`), bases first."""
    if dataclasses.is_dataclass(cls):  # a dataclass's fields are its constructor's
        return []
    inits = [k.__dict__["__init__"] for k in reversed(cls.__mro__) if in_package(k) and "__init__" in k.__dict__]
    names: list[str] = []
    nodes = [node for init in inits for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init))))]
    for node in nodes:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and not target.attr.startswith("_")
                    and target.attr not in names
                ):
                    names.append(target.attr)
    return names


# --- signatures ---------------------------------------------------------------------------


def render_annotation(annotation: Any) -> str:
    # Under `from __future__ import annotations` every annotation is the source text already.
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def render_signature(signature: inspect.Signature, *, skip_first: bool = False, returns: bool = True) -> str:
    """`(a: int, *, b: str = 'x') -> None`, annotations as written, without quotes."""
    parameters = list(signature.parameters.values())[1 if skip_first else 0 :]
    parts: list[str] = []
    star_written = False
    for index, parameter in enumerate(parameters):
        kind = parameter.kind
        if kind is inspect.Parameter.KEYWORD_ONLY and not star_written:
            parts.append("*")
            star_written = True
        text = parameter.name
        if kind is inspect.Parameter.VAR_POSITIONAL:
            text = "*" + text
            star_written = True
        elif kind is inspect.Parameter.VAR_KEYWORD:
            text = "**" + text
        if parameter.annotation is not inspect.Parameter.empty:
            text += ": " + render_annotation(parameter.annotation)
        if parameter.default is not inspect.Parameter.empty:
            separator = " = " if parameter.annotation is not inspect.Parameter.empty else "="
            text += separator + render_default(parameter.default)
        parts.append(text)
        following = parameters[index + 1] if index + 1 < len(parameters) else None
        if kind is inspect.Parameter.POSITIONAL_ONLY and (
            following is None or following.kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
    text = "(" + ", ".join(parts) + ")"
    if returns and signature.return_annotation is not inspect.Signature.empty:
        text += " -> " + render_annotation(signature.return_annotation)
    return text


def render_default(value: Any) -> str:
    text = repr(value)
    if re.search(r" at 0x[0-9a-f]+", text):  # an object's address would change on every run
        raise CannotGenerate(f"default {text} has no stable rendering")
    return text


def constructor(cls: type) -> str | None:
    """`Name(parameters)` for the class's constructor, None for a builtin one (exceptions)."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    return cls.__name__ + render_signature(signature, returns=False)


# --- Markdown -----------------------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def require_doc(where: str, doc: str | None, missing: list[str]) -> str:
    text = first_paragraph(doc)
    if not text:
        missing.append(where)
    return text


def public_bases(cls: type) -> str:
    names = [base.__name__ for base in cls.__bases__ if not base.__name__.startswith("_") and base is not object]
    return f"({', '.join(names)})" if names else ""


def render_class(entry: Entry, module: ModuleType, missing: list[str]) -> list[str]:
    cls = entry.obj
    lines = ["```python", f"class {entry.name}{public_bases(cls)}"]
    signature = constructor(cls)
    if signature:
        lines.append(signature)
    lines += ["```", ""]
    if entry.reexported_from:
        lines += [f"Defined in `{entry.reexported_from}`, re-exported here.", ""]
    lines += [require_doc(f"{module.__name__}.{entry.name}", entry.doc, missing), ""]
    contexts = []
    if any(in_package(k) and "__aenter__" in vars(k) for k in cls.__mro__):
        contexts.append("`async with`")
    if any(in_package(k) and "__enter__" in vars(k) for k in cls.__mro__):
        contexts.append("`with`")
    if contexts:
        lines += [f"Usable as a context manager ({', '.join(contexts)}): it closes on exit.", ""]
    attributes = instance_attributes(cls)
    if attributes:
        lines += ["Attributes: " + ", ".join(f"`{name}`" for name in attributes) + ".", ""]
    members = class_members(cls)
    for member in members:
        where = f"{module.__name__}.{entry.name}.{member.name}"
        prefix = {"async method": "async ", "classmethod": "classmethod ", "staticmethod": "staticmethod ",
                  "property": "property "}.get(member.kind, "")
        lines += [f"- `{prefix}{member.signature}`", "", "  " + require_doc(where, member.doc, missing), ""]
    return lines


def render_entry(entry: Entry, module: ModuleType, missing: list[str]) -> list[str]:
    lines = [f"### `{entry.name}`", ""]
    if entry.kind == "class":
        return lines + render_class(entry, module, missing)
    if entry.kind == "function":
        prefix = "async def " if inspect.iscoroutinefunction(entry.obj) else "def "
        lines += ["```python", prefix + entry.name + render_signature(inspect.signature(entry.obj)), "```", ""]
    else:
        value = repr(entry.obj)
        shown = f"{entry.name} = {value}" if len(value) <= SHORT_VALUE else entry.name
        lines += ["```python", shown, "```", ""]
    return lines + [require_doc(f"{module.__name__}.{entry.name}", entry.doc, missing), ""]


def flow_link() -> str:
    page = ROOT / "docs" / FLOW_PAGE
    title = page.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip() if page.is_file() else ""
    if not title.startswith(FLOW_TITLE):
        raise CannotGenerate(f"docs/{FLOW_PAGE} is gone or not titled {FLOW_TITLE!r}...: update FLOW_PAGE")
    return f"[{title}]({FLOW_PAGE})"


def example_lines() -> list[str]:
    lines = []
    for path in EXAMPLES:
        file = ROOT / path
        if not file.is_file():
            raise CannotGenerate(f"{path} is gone: update EXAMPLES")
        summary = first_paragraph(ast.get_docstring(ast.parse(file.read_text(encoding="utf-8"))))
        if not summary:
            raise CannotGenerate(f"{path} has no module docstring to describe it by")
        lines.append(f"- `{path}`: {summary}")
    return lines


def render_errors(modules: list[ModuleType], entries: dict[str, list[Entry]], missing: list[str]) -> list[str]:
    lines = ["## Errors", ""]
    for module in modules:
        for entry in entries[module.__name__]:
            if entry.kind != "class" or not issubclass(entry.obj, BaseException):
                continue
            lines += [f"- [`{entry.name}`](#{anchor(entry.name)}) (`{module.__name__}`)", ""]
            if not entry.doc:
                missing.append(f"{module.__name__}.{entry.name}")
                continue
            for paragraph in entry.doc.split("\n\n"):
                lines += ["  " + " ".join(paragraph.split()), ""]
            attributes = instance_attributes(entry.obj)
            if attributes:
                lines += ["  Attributes: " + ", ".join(f"`{name}`" for name in attributes) + ".", ""]
    return lines


def render() -> str:
    modules = [importlib.import_module(name) for name in MODULES]
    entries = {module.__name__: public_entries(module) for module in modules}
    missing: list[str] = []
    lines = [
        "# Client reference: `dynamo_lite.client`, `dynamo_lite.routing`, `dynamo_lite.routing.scheduling`, "
        "`dynamo_lite.hashing`",
        "",
        "<!-- Generated by docs/generate_reference.py from the modules' signatures and docstrings. "
        "Do not edit: change the docstrings, then run `python docs/generate_reference.py`. -->",
        "",
        "What a gateway imports to route requests over the slot tracker and the indexer:",
        "",
    ]
    for module in modules:
        lines.append(f"- [`{module.__name__}`](#{anchor(module.__name__)}): {first_paragraph(module.__doc__)}")
    lines += [
        "",
        f"The request flow, step by step: {flow_link()}. Runnable programs are in the repository's "
        "`examples/`, among them:",
        "",
        *example_lines(),
        "",
        "Signatures show annotations as written in the source. Every public name is listed in source "
        "order with the first paragraph of its docstring; `help()` on a name gives the rest.",
        "",
    ]
    lines += render_errors(modules, entries, missing)
    for module in modules:
        lines += [f"## `{module.__name__}`", "", inspect.cleandoc(module.__doc__ or ""), ""]
        for entry in entries[module.__name__]:
            lines += render_entry(entry, module, missing)
    if missing:
        names = ", ".join(dict.fromkeys(missing))
        raise CannotGenerate(f"public names without a docstring (add one): {names}")
    headings = [line for line in lines if line.startswith("#")]
    duplicates = sorted({h for h in headings if headings.count(h) > 1})
    if duplicates:
        raise CannotGenerate(f"duplicate headings (their anchors would collide): {duplicates}")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None, *, out: Callable[[str], Any] = print) -> int:
    return write_or_check(argv, __doc__, OUTPUT, render, out=out)


def write_or_check(
    argv: list[str] | None, doc: str | None, output: Path, render: Callable[[], str],
    *, script: str = "docs/generate_reference.py", out: Callable[[str], Any] = print,
) -> int:
    """The command line of a docs generator: write `output` from `render()`, or with `--check`
    exit 1, with a short diff, when the committed file differs (2 when it cannot be generated)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    args = parser.parse_args(argv)
    name = output.relative_to(ROOT)
    try:
        text = render()
    except CannotGenerate as error:
        out(f"{name}: {error}")
        return 2
    if not args.check:
        output.write_text(text, encoding="utf-8")
        out(f"wrote {name}")
        return 0
    current = output.read_text(encoding="utf-8") if output.exists() else ""
    if current == text:
        return 0
    diff = list(difflib.unified_diff(
        current.splitlines(), text.splitlines(),
        f"{name} (committed)", "(generated from the code)", lineterm="", n=1,
    ))
    out("\n".join(diff[:DIFF_LINES]))
    if len(diff) > DIFF_LINES:
        out(f"... {len(diff) - DIFF_LINES} more diff lines")
    out(f"{name} is stale: run `python {script}`")
    return 1


if __name__ == "__main__":
    sys.exit(main())
