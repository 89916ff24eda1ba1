"""Write the route references (docs/reference/*-api.md) from the services' OpenAPI documents.

    python docs/generate_routes.py           # (re)write docs/reference/*-api.md
    python docs/generate_routes.py --check   # exit 1, with a short diff, if one is stale

The OpenAPI documents (`openapi/*.yaml`) are what the services serve at `/openapi.json` and
what the schema tests check the running services against, so a reference generated from them
stays in step with the routes: per route its summary and description, its query parameters,
its body's fields (type, required, default, meaning) and every status it answers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_reference import ROOT, CannotGenerate, write_or_check  # noqa: E402  (the generator beside this one)

METHODS = ("get", "post", "put", "delete", "patch", "head")


@dataclass(frozen=True)
class ApiPage:
    source: str  # the OpenAPI document, from the repository root
    output: str  # the page, from docs/


PAGES = (
    ApiPage("openapi/slot_tracker.yaml", "reference/slot-tracker-api.md"),
    ApiPage("openapi/indexer.yaml", "reference/indexer-api.md"),
    ApiPage("openapi/select_service.yaml", "reference/select-service-api.md"),
)


class Document:
    """An OpenAPI document with its local `$ref`s resolved on demand."""

    def __init__(self, path: Path) -> None:
        self.data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))

    def resolve(self, node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            node = self._lookup(node["$ref"])
        return node

    def _lookup(self, ref: str) -> Any:
        if not ref.startswith("#/"):
            raise CannotGenerate(f"only local references are supported: {ref}")
        node: Any = self.data
        for part in ref[2:].split("/"):
            node = node[part]
        return node

    def type_text(self, schema: Any) -> str:
        """A short type: `string`, `integer (u64)`, `array of integer`, `Name` for a named object."""
        if isinstance(schema, dict) and "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            target = self.resolve(schema)
            if target.get("type") == "object" or "properties" in target:
                return name
            return self.type_text(target)
        schema = schema or {}
        if "allOf" in schema and len(schema["allOf"]) == 1:
            return self.type_text(schema["allOf"][0])
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return " or ".join(self.type_text(option) for option in schema[key])
        kind = schema.get("type", "any")
        if isinstance(kind, list):
            kind = " or ".join(kind)
        if kind == "array":
            return f"array of {self.type_text(schema.get('items', {}))}"
        if kind == "integer" and "maximum" in schema:
            return f"integer ≤ {schema['maximum']}" if "minimum" not in schema else (
                f"integer {schema['minimum']}..{schema['maximum']}")
        if "enum" in schema:
            return " \\| ".join(f"`{value}`" for value in schema["enum"])
        return str(kind)

    def description(self, schema: Any) -> str:
        """The field's own description, else its referenced schema's (through `allOf`)."""
        if isinstance(schema, dict) and schema.get("description"):
            return str(schema["description"])
        target = self.resolve(schema)
        if isinstance(target, dict) and "allOf" in target and len(target["allOf"]) == 1:
            return self.description(target["allOf"][0])
        return str(target.get("description", "")) if isinstance(target, dict) else ""


def cell(text: str) -> str:
    return " ".join(str(text).replace("|", "\\|").split())


def body_rows(document: Document, schema: Any) -> list[str]:
    schema = document.resolve(schema)
    properties = schema.get("properties")
    if not properties:
        return [f"Body: {cell(document.type_text(schema))}. {cell(document.description(schema))}".rstrip(". ") + ".", ""]
    required = set(schema.get("required", ()))
    rows = ["| field | type | required | meaning |", "|---|---|---|---|"]
    for name, field in properties.items():
        meaning = document.description(field)
        resolved = document.resolve(field)
        default = field.get("default", resolved.get("default") if isinstance(resolved, dict) else None)
        if default is not None:
            meaning = f"{meaning} Default: `{default}`.".strip()
        rows.append(f"| `{name}` | {cell(document.type_text(field))} | {'yes' if name in required else 'no'} "
                    f"| {cell(meaning)} |")
    return rows + [""]


def operation_lines(document: Document, path: str, method: str, operation: dict[str, Any]) -> list[str]:
    lines = [f"## `{method.upper()} {path}`", ""]
    if operation.get("summary"):
        lines += [cell(operation["summary"]) + ".", ""]
    if operation.get("description"):
        lines += [" ".join(str(operation["description"]).split()), ""]
    parameters = [document.resolve(parameter) for parameter in operation.get("parameters", ())]
    if parameters:
        lines += ["| query parameter | type | meaning |", "|---|---|---|"]
        for parameter in parameters:
            lines.append(f"| `{parameter['name']}` | {cell(document.type_text(parameter.get('schema', {})))} "
                         f"| {cell(parameter.get('description', ''))} |")
        lines.append("")
    body = operation.get("requestBody")
    if body:
        content = document.resolve(body).get("content", {})
        media = content.get("application/json") or next(iter(content.values()), {})
        lines += body_rows(document, media.get("schema", {}))
    lines += ["| status | answer |", "|---|---|"]
    for status, response in operation.get("responses", {}).items():
        lines.append(f"| {status} | {cell(document.resolve(response).get('description', ''))} |")
    return lines + [""]


def render_page(page: ApiPage) -> str:
    document = Document(ROOT / page.source)
    info = document.data.get("info", {})
    lines = [
        f"# Route reference: {info.get('title', page.source)}",
        "",
        f"<!-- Generated by docs/generate_routes.py from {page.source}. Do not edit: change the "
        "OpenAPI document, then run `python docs/generate_routes.py`. -->",
        "",
        str(info.get("description", "")).strip(),
        "",
        f"The service serves this document at `GET /openapi.json` (source: `{page.source}`); the "
        "schema tests check the running service against it.",
        "",
    ]
    paths = document.data.get("paths", {})
    if not paths:
        raise CannotGenerate(f"{page.source} has no paths")
    for path, item in paths.items():
        for method in METHODS:
            if method in item:
                lines += operation_lines(document, path, method, item[method])
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    status = 0
    for page in PAGES:
        output = ROOT / "docs" / page.output
        output.parent.mkdir(parents=True, exist_ok=True)
        status = max(status, write_or_check(argv, __doc__, output, lambda page=page: render_page(page),
                                            script="docs/generate_routes.py"))
    return status


if __name__ == "__main__":
    sys.exit(main())
