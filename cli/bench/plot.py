"""Pictures of the benchmarks, for `--plot FILE.png|svg`.

- `specexec bench`: tok/s (left) and tokens per target pass (right) against the tree budget, one line per
  builder's specexec rows; baselines (no-draft, hf-offload, hf-assisted, llama.cpp) and `budget=auto` rows are
  horizontal lines, since they have no budget of their own.
- `bench stream`: seconds per pass against tree tokens (both axes log), with the streaming floor bytes per pass
  ÷ the tier's measured bandwidth as a second line: where the two meet, the pass is bound by streaming.
- `bench builders`: one column of panels per temperature, tok/s on top and tokens per pass below, one line
  per builder, the target alone as a horizontal line.

Every picture is FIG_SIZE at DPI (1000 x 600 pixels in PNG; 720 x 432 pt in SVG) and carries the rows it was
drawn from as JSON in its metadata ("Description": a PNG text chunk, the SVG's Dublin Core description), so a
picture posted on its own still says what it shows. matplotlib is an optional extra (`pip install
'specexec[plot]'`), imported only when a plot is asked for; without it `--plot` fails in one line before any
benchmark runs. Only the object-oriented Figure API is used (no pyplot, no GUI backend, no global state).

Does not know: how the numbers were measured (cli/bench*.py).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from cli.bench.table import BASELINES, EXTERNAL
from specexec.options import ConfigError

FORMATS = ("png", "svg")
FIG_SIZE = (10.0, 6.0)            # inches
DPI = 100


def check_target(path: str | None) -> Path | None:
    """The --plot path, checked before a benchmark starts: a .png or .svg in an existing directory, and
    matplotlib importable. ConfigError (one line) otherwise."""
    if path is None:
        return None
    out = Path(path).expanduser()
    if out.suffix.lower().lstrip(".") not in FORMATS:
        raise ConfigError(f"--plot {path}: the file name must end in .png or .svg")
    if not out.parent.is_dir():
        raise ConfigError(f"--plot {path}: directory {out.parent} does not exist")
    _matplotlib()
    return out


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from None
    return matplotlib


def _figure(title: str, rows: int = 1, cols: int = 2):
    _matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIG_SIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    fig.suptitle(title, fontsize=10)
    return fig, axes


def save(fig, path: Path, rows: list[dict], title: str) -> Path:
    """Write `fig` as PNG or SVG (by suffix) with the rows as JSON in its metadata."""
    fmt = path.suffix.lower().lstrip(".")
    data = json.dumps({"rows": rows}, separators=(",", ":"), ensure_ascii=True)
    fig.savefig(path, format=fmt, dpi=DPI, metadata={"Title": title, "Description": data})
    return path


def _budget_axis(ax, budgets: list[int], ylabel: str) -> None:
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(budgets)), [str(b) for b in sorted(set(budgets))])
    ax.set_xlabel("tree budget (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


# ----------------------------------------------------------------------------------------- specexec bench

def _series_name(row: dict) -> str:
    builder = row.get("builder") or "specexec"
    return "specexec" if builder == "specexec" else f"specexec builder={builder}"


def bench_figure(rows: list[dict], title: str):
    """tok/s and tokens per pass against the budget (see the module doc)."""
    fig, axes = _figure(title)
    swept = [r for r in rows if isinstance(r.get("budget"), int) and r["config"] not in BASELINES
             and not r["config"].startswith(EXTERNAL)]
    flat = [r for r in rows if r not in swept]
    series: dict[str, list[dict]] = defaultdict(list)
    for r in swept:
        series[_series_name(r)].append(r)
    for ax, key, label in ((axes[0][0], "tok_s", "tokens / s"), (axes[0][1], "tokens_per_pass",
                                                                   "tokens per target pass")):
        for k, (name, group) in enumerate(series.items()):
            pts = sorted((r["budget"], r[key]) for r in group if r[key] is not None)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name, color=f"C{k}")
        for k, r in enumerate(flat):
            if r.get(key) is not None:
                ax.axhline(r[key], linestyle="--", color=f"C{len(series) + k}", label=r["config"])
        _budget_axis(ax, [r["budget"] for r in swept], label)
    axes[0][0].legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------- bench stream

def stream_floor(row: dict) -> float | None:
    """Seconds a pass needs for its bytes at the tier's measured bandwidth (None when it was not measured)."""
    peak = row.get("tier_peak_gbps")
    return row["bytes_per_pass"] / (peak * 1e9) if peak else None


def stream_figure(rows: list[dict], title: str):
    fig, axes = _figure(title, 1, 1)
    ax = axes[0][0]
    rows = sorted(rows, key=lambda r: r["tokens"])
    ax.plot([r["tokens"] for r in rows], [r["seconds_per_pass"] for r in rows], marker="o",
            label="measured seconds per pass")
    floor = [(r["tokens"], stream_floor(r)) for r in rows if stream_floor(r) is not None]
    if floor:
        ax.plot([x for x, _ in floor], [y for _, y in floor], linestyle="--", marker="x",
                label="bytes per pass ÷ tier bandwidth")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tree tokens per pass")
    ax.set_ylabel("seconds per pass")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------- bench builders

def builders_figure(rows: list[dict], title: str):
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = _figure(title, 2, len(temps))
    names = list(dict.fromkeys(r["builder"] for r in rows if r["budget"] is not None))
    for col, t in enumerate(temps):
        at_t = [r for r in rows if r["temperature"] == t]
        for row_i, (key, label) in enumerate((("tok_s", "tokens / s"), ("tokens_per_pass", "tokens per pass"))):
            ax = axes[row_i][col]
            for k, name in enumerate(names):
                pts = sorted((r["budget"], r[key]) for r in at_t
                             if r["builder"] == name and r["budget"] is not None and r[key] is not None)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name, color=f"C{k}")
            for r in at_t:
                if r["budget"] is None and r.get(key) is not None:
                    ax.axhline(r[key], linestyle="--", color="black", label=r["builder"])
            _budget_axis(ax, [r["budget"] for r in at_t if r["budget"] is not None], label)
            ax.set_title(f"T = {t:g}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    return fig
