#!/usr/bin/env python3
"""Generated sections of the README and docs/: where a script's figures land in a page.

A section is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in a page. Its
owner script renders it with a pure function (committed JSON in, markdown out) and writes it with
``update(NAME)`` after writing the JSON; the registry (``docs_registry.py``) says which script
renders which section of which page from which JSON.

    .venv/bin/python scripts/doc_sections.py            # re-render every section from the JSON
    .venv/bin/python scripts/doc_sections.py --check    # list the sections that differ (exit 1)
    .venv/bin/python scripts/doc_sections.py --list     # page, section, owner script, JSON

``tests/test_docs.py`` checks that every committed section equals its rendering, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "docs" / "figures"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _span(text: str, name: str, where: str) -> tuple[int, int]:
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where}: needs exactly one '{begin}' followed by one '{end}'; add the "
                         "two marker lines where the section belongs")
    return text.index(begin) + len(begin), text.index(end)


def read_section(text: str, name: str, where: str = "page") -> str:
    """The body between the markers, without the newlines that frame it."""
    lo, hi = _span(text, name, where)
    return text[lo:hi].strip("\n")


def replace_section(text: str, name: str, body: str, where: str = "page",
                    append: bool = False) -> str:
    """``text`` with section ``name`` replaced by ``body``; a body rendered with its own markers
    around it is taken without them. With ``append``, a page without the section's markers
    gets it at its end (a report a script starts itself)."""
    begin, end = markers(name)
    body = body.strip("\n")
    if body.startswith(begin) and body.endswith(end):
        body = body[len(begin):-len(end)].strip("\n")
    if append and begin not in text and end not in text:
        return text.rstrip("\n") + "\n\n" + begin + "\n" + body + "\n" + end + "\n"
    lo, hi = _span(text, name, where)
    return text[:lo] + "\n" + body + "\n" + text[hi:]


def write_section(page: Path, name: str, body: str, append: bool = False) -> bool:
    """Replace section ``name`` of ``page`` in place; True when the page changed."""
    old = page.read_text()
    new = replace_section(old, name, body, str(page), append)
    if new != old:
        tmp = page.with_name(f".{page.name}.{os.getpid()}.tmp")
        tmp.write_text(new)
        os.replace(tmp, page)
    return new != old


def load_json(rel: str, root: Path = REPO):
    path = root / rel
    if not path.is_file():
        raise FileNotFoundError(f"{rel}: the JSON this section renders from is missing; run its "
                                "owner script (`scripts/doc_sections.py --list`)")
    return json.loads(path.read_text())


def render(section, root: Path = REPO) -> str:
    return section.render(*(load_json(rel, root) for rel in section.data))


def update(*names: str, figures: Path | str = FIGURES) -> None:
    """Re-render the named sections, and every other section that reads one of their JSON files
    (the README's figures), from the committed JSON. A script whose figures went to another
    directory than docs/figures (``--docs <dir>``) leaves the pages alone."""
    if Path(figures).resolve() != FIGURES.resolve():
        print(f"figures written to {figures}, not docs/figures: sections {', '.join(names)} of the "
              "pages left as they are")
        return
    from docs_registry import SECTIONS, by_name
    data = {rel for name in names for rel in by_name(name).data}
    for sec in SECTIONS:
        if sec.name in names or data & set(sec.data):
            changed = write_section(REPO / sec.page, sec.name, render(sec))
            print(f"{sec.page}: section {sec.name} {'rewritten' if changed else 'unchanged'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if any differs")
    p.add_argument("--list", action="store_true", help="print the registry")
    p.add_argument("names", nargs="*", help="only these sections (default: all)")
    a = p.parse_args(argv)
    from docs_registry import SECTIONS, by_name
    sections = [by_name(n) for n in a.names] if a.names else SECTIONS
    if a.list:
        for s in sections:
            print(f"{s.page:24s} {s.name:18s} {s.script:34s} {', '.join(s.data)}")
        return 0
    stale = []
    for s in sections:
        page = REPO / s.page
        body = render(s)
        if a.check:
            if replace_section(page.read_text(), s.name, body, s.page) != page.read_text():
                stale.append(f"{s.page}: {s.name}")
        elif write_section(page, s.name, body):
            print(f"{s.page}: section {s.name} rewritten")
    if stale:
        print("differ from their rendering (run scripts/doc_sections.py):\n  " + "\n  ".join(stale))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
