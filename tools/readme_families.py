"""Write (or with --check, compare) the README's table of supported models, made from the families registry
by cli/catalog.families_markdown: the text between its two marker lines is replaced, nothing else.

Does not know: what a family is; the registry (specexec/families/registry.py) does.
"""
from __future__ import annotations

import sys
from pathlib import Path

from cli.catalog import README_BEGIN, README_END, families_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def rewritten(text: str) -> str:
    """The README text with its families table replaced by the registry's."""
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    return text[:start] + families_markdown() + text[end:]


def main(argv: list[str]) -> int:
    text = README.read_text(encoding="utf-8")
    new = rewritten(text)
    if "--check" in argv:
        print("README's families table is current" if new == text else "README's families table is stale: "
              "run tools/readme-families")
        return int(new != text)
    README.write_text(new, encoding="utf-8")
    print(f"{README}: families table {'unchanged' if new == text else 'rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
