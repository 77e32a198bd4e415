"""No import cycles between gpufrac's modules: `python tools/import_cycles.py` (make lint runs it).

import-linter (pyproject.toml's contracts) checks which package may import which; this checks
that no module reaches itself through imports. Every import counts, as in import-linter: a lazy
import inside a function, one under TYPE_CHECKING. Each cycle is printed as its modules (a
strongly connected component of the import graph), one shortest loop through them and every
import between them with its line, so that the import to drop can be picked. Exit status 1 when
there is a cycle.
"""

from __future__ import annotations

import argparse
import sys

import grimp


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The modules that import each other in a loop, one sorted list per loop group (a module
    is in one when it reaches itself: it imports, step by step, a module that imports it)."""
    seen: set[str] = set()
    groups = []
    for module in sorted(graph.modules):
        if module in seen:
            continue
        group = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        if group:
            group.add(module)
            seen |= group
            groups.append(sorted(group))
    return groups


def _lines(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    return ", ".join(f"l.{d['line_number']}" for d in details) or "?"


def describe(graph: grimp.ImportGraph, group: list[str]) -> str:
    """One cycle group, readable: its modules, a shortest loop, the imports inside it."""
    members = set(group)
    start = group[0]
    # A shortest loop through the first module: to one of its imports in the group, and back.
    loop: tuple[str, ...] = ()
    for nxt in sorted(graph.find_modules_directly_imported_by(start) & members):
        back = graph.find_shortest_chain(importer=nxt, imported=start)
        if back and (not loop or len(back) + 1 < len(loop)):
            loop = (start, *back)
    out = [f"{len(group)} modules: {', '.join(group)}", f"  e.g. {' -> '.join(loop)}", "  imports inside it:"]
    for importer in group:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            out.append(f"    {importer} -> {imported} ({_lines(graph, importer, imported)})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("package", nargs="?", default="gpufrac", help="the package to check (gpufrac)")
    args = parser.parse_args(argv)
    graph = grimp.build_graph(args.package, include_external_packages=False, cache_dir=None)
    groups = cycles(graph)
    if not groups:
        print(f"import cycles: none among {len(graph.modules)} modules of {args.package}")
        return 0
    print(f"import cycles: {len(groups)} in {args.package} (each must be broken: imports point one way)")
    for n, group in enumerate(groups, 1):
        print(f"\ncycle {n}: {describe(graph, group)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
