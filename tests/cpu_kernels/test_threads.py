"""The threads a run takes: physical cores from sysfs (hyper-threads once, the affinity mask, a cgroup quota),
fewer on an oversubscribed machine, --threads as given, and what the load line says."""
from __future__ import annotations

from pathlib import Path

from cpu_kernels.threads import choose, physical_cores


def _sysfs(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cores.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_physical_cores_count_hyperthreads_once_within_the_mask_and_the_quota(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path / "cpu", {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0), 5: (1, 0)})
    none = tmp_path / "no-cgroup"
    assert physical_cores({0, 1, 2, 3, 4, 5}, sysfs, none) == 3     # two packages' core 0 are two cores
    assert physical_cores({0, 2}, sysfs, none) == 1                 # siblings of one core
    assert physical_cores({7, 8}, sysfs, none) == 2                 # no topology: one per logical CPU
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert physical_cores({0, 1, 2, 3, 4, 5}, sysfs, quota) == 2    # 1.5 CPUs of quota: 2 threads
    quota.write_text("max 100000\n")
    assert physical_cores({0, 1, 2, 3, 4, 5}, sysfs, quota) == 3


def test_the_default_gives_up_the_excess_load_and_says_so_once() -> None:
    assert choose(cores=8, load=3.0).count == 8 and "busy" not in choose(cores=8, load=3.0).note()
    assert choose(cores=8, load=None, measure_load=False).count == 8
    busy = choose(cores=2, load=7.9)
    assert busy.count == 1 and busy.busy
    assert busy.note() == "1 thread · machine busy: load 7.9 on 2 cores, threads cut to 1 (--threads N sets them)"
    assert choose(cores=16, load=20.0).count == 12
    given = choose(4, cores=2, load=7.9)
    assert given.count == 4 and given.note() == "4 threads · machine busy: load 7.9 on 2 cores"
