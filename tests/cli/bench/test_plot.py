"""`--plot FILE.png|svg` on `specexec bench`, `bench stream` and `bench builders` (cli/bench/plot.py): the lines drawn
are the JSON rows (read back from the Figure), the file is a valid PNG/SVG of the promised size whose embedded rows
equal what `--json` printed, and a missing matplotlib or a bad file name is one line (exit 2) before anything runs."""
from __future__ import annotations

import json
import struct
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from cli.bench import plot  # noqa: E402
from cli.main import main  # noqa: E402

PX = (int(plot.FIG_SIZE[0] * plot.DPI), int(plot.FIG_SIZE[1] * plot.DPI))
DC = "{http://purl.org/dc/elements/1.1/}"


def png_info(path: Path) -> tuple[tuple[int, int], dict[str, str]]:
    """((width, height), text chunks) of a PNG file; asserts the signature and chunk CRCs."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, size, text = 8, None, {}
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt":
            key, value = body.split(b"\0", 1)
            text[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, rest = body.split(b"\0", 1)
            text[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, rest = body.split(b"\0", 1)
            compressed, rest = rest[0], rest[2:]
            value = rest.split(b"\0", 2)[2]
            text[key.decode("latin-1")] = (zlib.decompress(value) if compressed else value).decode("utf-8")
        pos += 12 + n
    return size, text


def svg_info(path: Path) -> tuple[tuple[str, str], str]:
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    desc = next(e for e in root.iter() if e.tag == DC + "description")
    return (root.attrib["width"], root.attrib["height"]), desc.text


def embedded_rows(path: Path) -> list[dict]:
    if path.suffix == ".png":
        size, text = png_info(path)
        assert size == PX
        return json.loads(text["Description"])["rows"]
    size, desc = svg_info(path)
    assert size == (f"{plot.FIG_SIZE[0] * 72:g}pt", f"{plot.FIG_SIZE[1] * 72:g}pt")
    return json.loads(desc)["rows"]


def lines(ax) -> dict[str, tuple[list, list]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}


BENCH_ROWS = [
    {"config": "specexec budget=16", "budget": 16, "builder": "specexec", "tok_s": 5.0, "tokens_per_pass": 2.0},
    {"config": "specexec budget=4", "budget": 4, "builder": "specexec", "tok_s": 4.0, "tokens_per_pass": 1.5},
    {"config": "specexec budget=64 builder=chain", "budget": 64, "builder": "chain", "tok_s": 3.0,
     "tokens_per_pass": 1.8},
    {"config": "specexec budget=auto", "budget": "auto", "builder": "specexec", "tok_s": 5.5, "tokens_per_pass": 2.2},
    {"config": "no-draft", "budget": None, "builder": None, "tok_s": 2.5, "tokens_per_pass": 1.0},
    {"config": "hf-offload", "budget": None, "builder": None, "tok_s": 0.5, "tokens_per_pass": None},
]


def test_bench_figure_draws_the_rows(tmp_path: Path) -> None:
    fig = plot.bench_figure(BENCH_ROWS, "t")
    speed, per_pass = (lines(ax) for ax in fig.axes)
    assert speed["specexec"] == ([4, 16], [4.0, 5.0])                 # sorted by budget
    assert speed["specexec builder=chain"] == ([64], [3.0])
    assert speed["no-draft"][1] == [2.5, 2.5] and speed["hf-offload"][1] == [0.5, 0.5]
    assert speed["specexec budget=auto"][1] == [5.5, 5.5]
    assert per_pass["specexec"] == ([4, 16], [1.5, 2.0]) and per_pass["no-draft"][1] == [1.0, 1.0]
    assert "hf-offload" not in per_pass                              # no tokens-per-pass: nothing drawn
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_xlabel() == "tree budget (tokens)"
    for name in ("b.png", "b.svg"):
        assert embedded_rows(plot.save(fig, tmp_path / name, BENCH_ROWS, "t")) == BENCH_ROWS


def test_stream_figure_has_the_bandwidth_floor() -> None:
    rows = [{"tokens": 64, "seconds_per_pass": 0.5, "bytes_per_pass": 2_000_000_000, "tier_peak_gbps": 8.0},
            {"tokens": 1, "seconds_per_pass": 0.3, "bytes_per_pass": 2_000_000_000, "tier_peak_gbps": 10.0},
            {"tokens": 4, "seconds_per_pass": 0.31, "bytes_per_pass": 2_000_000_000, "tier_peak_gbps": None}]
    drawn = lines(plot.stream_figure(rows, "s").axes[0])
    assert drawn["measured seconds per pass"] == ([1, 4, 64], [0.3, 0.31, 0.5])
    assert drawn["bytes per pass ÷ tier bandwidth"] == ([1, 64], [0.2, 0.25])


def test_builders_figure_has_a_panel_column_per_temperature() -> None:
    rows = [{"builder": "target only", "budget": None, "temperature": t, "tok_s": 2.0, "tokens_per_pass": 1.0}
            for t in (0, 0.6)]
    rows += [{"builder": b, "budget": n, "temperature": t, "tok_s": n / 4 + k, "tokens_per_pass": 1 + n / 16}
             for t in (0, 0.6) for k, b in enumerate(("specexec", "chain")) for n in (4, 12)]
    fig = plot.builders_figure(rows, "b")
    assert len(fig.axes) == 4 and [ax.get_title() for ax in fig.axes] == ["T = 0", "T = 0.6", "T = 0", "T = 0.6"]
    top_right = lines(fig.axes[1])
    assert top_right["chain"] == ([4, 12], [2.0, 4.0]) and top_right["target only"][1] == [2.0, 2.0]
    assert lines(fig.axes[2])["specexec"] == ([4, 12], [1.25, 1.75])


# ------------------------------------------------------------------------------------------ the commands

def test_bench_plot_matches_the_json_rows(capsys, tiny_pair, tiny_perturbed_draft, tmp_path: Path) -> None:
    out = tmp_path / "bench.png"
    code = main(["bench", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--dtype", "float32",
                 "--limit", "1", "--max-new-tokens", "6", "--warmup", "0", "--budgets", "4,8",
                 "--configs", "specexec,no-draft", "--json", "--plot", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads(captured.out)["rows"]
    assert embedded_rows(out) == rows
    speed = lines(plot.bench_figure(rows, "x").axes[0])
    assert speed["specexec"] == ([4, 8], [r["tok_s"] for r in rows[:2]])
    assert f"plot written to {out}" in captured.err


def test_bench_builders_plot_svg(capsys, tiny_pair, tiny_perturbed_draft, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "builders.svg"
    code = main(["bench", "builders", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft),
                 "--dtype", "float32", "--limit", "1", "--max-new-tokens", "6", "--warmup", "0", "--budgets", "4,8",
                 "--builders", "specexec,chain", "--temperatures", "0,0.6", "--json", "--plot", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert embedded_rows(out) == json.loads(captured.out)["rows"]


def test_bench_stream_plot_png(capsys, tmp_path: Path) -> None:
    out = tmp_path / "stream.png"
    assert main(["bench", "stream", "--synthetic", "1b", "--layers", "2", "--distinct", "1", "--tokens", "1,4",
                 "--offload", "ram", "--device", "cpu", "--dir", str(tmp_path), "--json", "--plot", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert embedded_rows(out) == rows and all(plot.stream_floor(r) for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--model", "/nonexistent", "--plot", "x.jpg"], "must end in .png or .svg"),
    (["bench", "stream", "--synthetic", "1b", "--plot", "/nonexistent/x.png"], "does not exist"),
])
def test_bad_plot_target_is_one_line(capsys, argv, message) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_missing_matplotlib_is_one_line_before_anything_runs(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # import matplotlib -> ImportError
    assert main(["bench", "--model", "/nonexistent", "--no-draft", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
