"""`specexec models`: list the models.yaml catalogue (recommended pairs, defaults) and which models are on this
machine, looked up offline in the Hugging Face cache and under $SPECEXEC_MODEL_DIRS.

Table on stdout (it is the answer), then the supported families and their config.json architectures; `--json`
prints one line {"catalog": PATH, "models": [...], "supported": [{"family", "architectures"}]} instead.

The families' names and their table (`family_names_line`, `families_markdown`) are made here from the families
registry for `specexec --help`, this command and the README (tools/readme-families writes it there).

Does not know: how the catalogue is parsed or checked, or where models are looked for (specexec.checkpoints.catalog).
"""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from specexec.checkpoints.catalog import DIRS_ENV, Catalog, load_catalog
from specexec.families.registry import summaries, supported


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("models", help="list known models and recommended draft/target pairs",
                       description="List the models.yaml catalogue and which models are present locally "
                                   f"(Hugging Face cache, ${DIRS_ENV}). Nothing is downloaded.")
    p.add_argument("--catalog", metavar="FILE", help="another models.yaml (default: the shipped one, or "
                                                     "$SPECEXEC_MODELS_YAML)")
    p.add_argument("--local", action="store_true", help="only the models present on this machine")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    return p


def rows(catalog: Catalog, local_only: bool = False) -> list[dict]:
    out = []
    for e in catalog:
        path = e.local_path()
        if local_only and path is None:
            continue
        out.append({"name": e.name, "hub": e.hub, "family": e.family, "params": e.params, "drafts": list(e.drafts),
                    "budget": e.budget, "quant": e.quant, "notes": e.notes,
                    "local_path": str(path) if path is not None else None})
    return out


WIDE = 200                         # columns from which a table shows local paths and Hub ids


def table(found: list[dict], source: str, width: int = WIDE) -> Table:
    """The catalogue as a table `width` columns wide: from WIDE on with each local path and Hub id; narrower
    (a terminal) local as yes/no and the Hub id only when it fits (`--json` has everything)."""
    wide = width >= WIDE
    t = Table(title=f"models ({source})", title_justify="left", show_edge=False, pad_edge=False)
    cols = ["name", "params", "family", "drafts (best first)", "budget", "quant", "local"]
    hub = wide or width >= 150
    longest = max((len(r["name"]) for r in found), default=4)
    for col in cols + (["hub id"] if hub else []):
        t.add_column(col, justify="right" if col in ("params", "budget") else "left",
                     overflow="fold" if col == "drafts (best first)" else "ellipsis",
                     min_width=longest if col == "name" else None, no_wrap=col == "name")
    for r in found:
        local = ("[green]yes[/]" + (f" {r['local_path']}" if wide else "")) if r["local_path"] else "[dim]no[/]"
        row = [r["name"], r["params"], r["family"], ", ".join(r["drafts"]) or "[dim]-[/]", str(r["budget"]),
               r["quant"], local]
        t.add_row(*row, *([r["hub"] or "[dim]local only[/]"] if hub else []))
    return t


def family_names_line() -> str:
    """Every supported family's name, in registry order: "llama, mistral, ..."."""
    return ", ".join(family for families, _, _ in summaries() for family in families)


README_BEGIN = "<!-- the families registry's table: tools/readme-families writes it; edit specexec/families/ -->"
README_END = "<!-- end of the families registry's table -->"


def families_markdown() -> str:
    """The README's table of supported models, one row per family module, between its two marker lines."""
    rows = ["| family | config.json architectures | what differs from Llama (each a named option, tested against "
            "transformers) |", "|---|---|---|"]
    rows += [f"| {', '.join(families)} | {', '.join(f'`{a}`' for a in archs)} | {text} |"
             for families, archs, text in summaries()]
    return "\n".join([README_BEGIN, *rows, README_END])


def run(args: argparse.Namespace) -> int:
    catalog = load_catalog(args.catalog)
    found = rows(catalog, args.local)
    families = [{"family": fam, "architectures": archs} for fam, archs in supported()]
    if args.json:
        print(json.dumps({"catalog": catalog.source, "models": found, "supported": families},
                         separators=(",", ":")), flush=True)
        return 0
    out = Console(soft_wrap=True)
    if not out.is_terminal:                    # a file or a pipe: wide enough that no cell is cut
        out.width = max(out.width, 200)
    out.print(table(found, catalog.source, out.width))
    out.print("supported families (config.json architectures): " + "; ".join(
        f"{f['family']} ({', '.join(f['architectures'])})" for f in families), highlight=False)
    present = sum(r["local_path"] is not None for r in found)
    Console(stderr=True).print(f"{present} of {len(found)} present locally · `--model NAME` uses a name, its "
                               f"first draft, budget and quant · add directories with ${DIRS_ENV}",
                               style="dim", highlight=False)
    return 0
