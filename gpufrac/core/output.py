"""`-o json|yaml|wide` for the listing commands, the way kubectl spells it, and their tables.

Every listing command builds one document (the `-o json` form) and a table; `-o yaml`
is the same document as YAML, `-o wide` the table with more columns. `--json` stays an
alias of `-o json` for scripts written before `-o` existed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import yaml

FORMATS = ("json", "yaml", "wide")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        help="json or yaml: the whole document; wide: the table with more columns",
    )
    p.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")


def output_format(args: argparse.Namespace) -> str:
    """'json', 'yaml', 'wide' or '' (the plain table)."""
    return str(getattr(args, "output", None) or "")


def render(
    args: argparse.Namespace,
    doc: Mapping[str, Any],
    table: Callable[[bool], str],
    *,
    sort_keys: bool = False,
) -> str:
    """The command's output: `table(wide)` for the tables, the document for json/yaml."""
    fmt = output_format(args)
    if fmt == "json":
        return json.dumps(doc, indent=2, sort_keys=sort_keys)
    if fmt == "yaml":
        # JSON's types only (a round trip through JSON), so YAML and JSON say the same thing.
        plain = json.loads(json.dumps(doc))
        return yaml.safe_dump(plain, sort_keys=sort_keys, default_flow_style=False).rstrip()
    return table(fmt == "wide")


def table(rows: list[list[str]], align_right: Iterable[int] = ()) -> list[str]:
    """Fixed-width columns separated by two spaces; the last column is not padded."""
    right = set(align_right)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else (c if i == len(r) - 1 else c.ljust(w))
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
