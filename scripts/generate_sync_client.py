"""Write shared/client/_sync_client.py, the sync clients' methods, from shared/client/_async_client.py.

    python scripts/generate_sync_client.py           # (re)write shared/client/_sync_client.py
    python scripts/generate_sync_client.py --check   # exit 1 if the committed file is stale

The async clients are the source: each route method is written once, with its signature,
docstring and request body, and the sync one is the same text with `async def` as `def`, no
`await`, `aclose` as `close` and `Async` dropped from the names (`AsyncSlotTrackerClient` ->
`SlotTrackerClient`, `httpx.AsyncClient` -> `httpx.Client`), as httpcore generates its sync
classes. Type checkers and IDEs then see every sync method with its own types. What differs
beyond those words (the transports, the async-only `lean=` option) is written by hand in
shared/client/_client_base.py. `tests/test_client.py` runs `--check`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "shared" / "client" / "_async_client.py"
OUTPUT = ROOT / "shared" / "client" / "_sync_client.py"
HEADER = '''"""The sync clients' route methods. Generated from _async_client.py: do not edit.

Change `shared/client/_async_client.py`, then run `python scripts/generate_sync_client.py`.
"""
'''
# In order; each applies to the whole text, word-bounded so no longer name is cut.
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\bawait ", ""),
    (r"\baclose\b", "close"),
    (r"\b_Async([A-Z]\w*)", r"_\1"),
    (r"\bAsync([A-Z]\w*)", r"\1"),
)


def generate(source: str) -> str:
    """The sync module's text for the async module's text."""
    docstring = re.match(r'"""(?:.|\n)*?"""\n', source)
    if docstring is None:
        raise ValueError(f"{SOURCE.name} must start with its docstring")
    text = source[docstring.end():]
    for pattern, replacement in SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text)
    return HEADER + text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    args = parser.parse_args(argv)
    text = generate(SOURCE.read_text(encoding="utf-8"))
    name = OUTPUT.relative_to(ROOT)
    if args.check:
        if OUTPUT.exists() and OUTPUT.read_text(encoding="utf-8") == text:
            return 0
        print(f"{name} is stale: run `python scripts/generate_sync_client.py`")
        return 1
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
