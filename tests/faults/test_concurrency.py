"""Several real `specexec convert` processes and one layer cache (tests/offload/test_cache.py covers the same locking
in-process with threads and a fake lock holder; here the builders are real processes, forked by the fork server
of faults_helpers: their own pid, descriptors, flocks and signals, without importing torch again).

- Two processes converting the same checkpoint into the same root at once: the one that gets the lock builds
  (the phase hook holds it mid-build until the other is seen waiting, so the overlap is certain), the other
  says whom it waits for, then reuses the result; the bytes equal an undisturbed build.
- A builder SIGKILLed mid-build leaves its lock file (naming it) and a half-written temporary dir: the next run
  does not wait (the kernel dropped the flock), removes the leftover and builds the same bytes.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from cli.main import main
from tests.faults.faults_helpers import cache_dir, entries, fork_cli, layer_digests, wait_for

pytestmark = pytest.mark.timeout(120)
CONVERT = ("convert", "--quant", "none", "--no-progress")


def convert(model: Path, root: Path) -> list[str]:
    return [*CONVERT, "--model", str(model), "--out", str(root)]


@pytest.fixture(scope="module")
def killed_builder(tiny_pair, tmp_path_factory):
    """A builder that SIGKILLs itself before writing its 2nd layer; started when the module starts so it runs
    alongside the first test."""
    where = tmp_path_factory.mktemp("killed")
    proc = fork_cli(convert(tiny_pair[0], where / "cache"), where / "proc", hook="write@2:KILL")
    yield proc, where / "cache"
    proc.kill()


@pytest.fixture(scope="module")
def reference(tiny_pair, tmp_path_factory) -> tuple[tuple[str, list[str]], int]:
    """(layer_digests of an undisturbed build, the size of its first layer)."""
    root = tmp_path_factory.mktemp("reference")
    assert main([*convert(tiny_pair[0], root)]) == 0
    final = cache_dir(tiny_pair[0], root)
    first = json.loads((final / "manifest.json").read_text())["layers"][0]["nbytes"]
    return layer_digests(final), first


@pytest.mark.slow
def test_two_builders_at_once_one_builds_the_other_waits_and_reuses(tiny_pair, killed_builder, reference,
                                                                     tmp_path) -> None:
    root, release = tmp_path / "cache", tmp_path / "release"
    final = cache_dir(tiny_pair[0], root)
    procs = [fork_cli(convert(tiny_pair[0], root), tmp_path / f"proc{k}", hook="write@1:hold", release=release)
             for k in range(2)]
    try:
        # whichever takes the lock first holds it mid-build (before its first layer) until the other waits
        wait_for(lambda: entries(root)["temp"] != [], 60, "a builder to start writing")
        pid = int(entries(root)["temp"][0].rsplit("-", 1)[1])
        builder = [p.pid for p in procs].index(pid)
        other = procs[1 - builder]
        wait_for(lambda: f"waiting for process {pid}" in other.err, 60, "the other process to wait", other)
        assert not final.exists()
        release.touch()
        codes = [p.wait() for p in procs]
    finally:
        release.touch()
        for proc in procs:
            proc.kill()
    assert codes == [0, 0], [p.err for p in procs]
    assert procs[builder].out.startswith(f"{final} (built)"), procs[builder].out
    assert other.out.startswith(f"{final} (already up to date)"), other.out
    assert "Traceback" not in procs[0].err + other.err and "error" not in procs[builder].err + other.err
    assert entries(root) == {"final": [final.name], "temp": [], "lock": [f"{final.name}.lock"]}
    assert layer_digests(final) == reference[0]


def test_builder_killed_mid_build_is_recovered_by_the_next_run(tiny_pair, killed_builder, reference,
                                                               capsys) -> None:
    proc, root = killed_builder
    assert proc.wait() == -signal.SIGKILL, proc.err
    final = cache_dir(tiny_pair[0], root)
    leftover = f".{final.name}.tmp-{proc.pid}"
    assert entries(root) == {"final": [], "temp": [leftover], "lock": [f"{final.name}.lock"]}
    assert (root / ".locks" / f"{final.name}.lock").read_text().strip() == str(proc.pid)  # names the dead holder
    assert (root / leftover / "layers.bin").stat().st_size == reference[1]           # one layer written, no more

    assert main(convert(tiny_pair[0], root)) == 0
    out, err = capsys.readouterr()
    assert "waiting" not in err                                                   # the stale lock was free
    assert out.startswith(f"{final} (built)")
    assert entries(root) == {"final": [final.name], "temp": [], "lock": [f"{final.name}.lock"]}
    assert layer_digests(final) == reference[0]
