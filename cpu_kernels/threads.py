"""How many CPU threads a run uses: the physical cores this process may run on (as the kernels see them), and
fewer when other programs keep them busy.

The compiled kernels (ops, attend, block) and torch's own operators both take their thread count from
torch.get_num_threads(), so one `torch.set_num_threads(n)` sets all of them; `choose` decides n. A core's
hyper-threads count once (the kernels are bound by memory and the vector units two siblings share), cores
outside the affinity mask or above a cgroup CPU quota do not count. On a machine whose load average exceeds its
cores, OpenMP's barriers wait for a core other programs hold: a 3M-parameter target went from 70 tok/s at one
thread to 1.4-2.7 at two (load 8 on 2 cores), so the default then gives up the excess: the cores less (load - cores), at least
one.

Does not know: torch (the caller sets the threads), the commands, what a run computes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP_MAX = Path("/sys/fs/cgroup/cpu.max")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity mask; every CPU where the OS has no such call)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None, sys_cpu: Path = SYS_CPU, cgroup_max: Path = CGROUP_MAX) -> int:
    """Physical cores among `cpus` (default: allowed_cpus()): distinct (package, core) pairs where sysfs says
    them, else one per logical CPU; at most a cgroup v2 CPU quota (cpu.max) rounded up; at least 1."""
    cpus = allowed_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))                    # no topology: a logical CPU is all we know
    count = max(1, len(cores))
    try:
        quota, period = cgroup_max.read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def load_average() -> float | None:
    """The 1-minute load average, None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class Threads:
    """The threads a run uses and why: `given` (--threads N) or chosen from `cores` and `load`."""

    count: int
    cores: int
    load: float | None
    given: bool

    @property
    def busy(self) -> bool:
        """Other programs keep more than the cores busy (the load average exceeds them)."""
        return self.load is not None and self.load > self.cores

    def note(self) -> str:
        """What the load line says: the threads, and once, when the machine is oversubscribed, that it is."""
        text = f"{self.count} thread{'s' * (self.count != 1)}"
        if self.busy:
            text += f" · machine busy: load {self.load:.1f} on {self.cores} cores" + (
                "" if self.given else f", threads cut to {self.count} (--threads N sets them)")
        return text


def choose(given: int | None = None, cores: int | None = None, load: float | None = None,
           measure_load: bool = True) -> Threads:
    """--threads N as given, else the physical cores; on an oversubscribed machine (load average above the
    cores) the cores less the excess, at least 1 (load 8 on 2 cores: 1 thread; 20 on 16: 12)."""
    cores = physical_cores() if cores is None else cores
    load = load_average() if load is None and measure_load else load
    if given is not None:
        return Threads(given, cores, load, True)
    excess = 0 if load is None or load <= cores else math.floor(load - cores + 0.5)
    return Threads(max(1, cores - excess), cores, load, False)
