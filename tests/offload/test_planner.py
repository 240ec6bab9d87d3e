"""offload.planner: which tier each layer gets for given budgets (pure function, made-up sizes), the overrides,
the one-line errors for impossible budgets, and the text/summary of a plan. Also the OffloadConfig checks."""
from __future__ import annotations

import pytest

from offload.memory_plan import GB, Bandwidths, Needs, PlanError
from offload.planner import _fit_prefix, _Sums, default_budgets, plan
from specexec.config import OffloadConfig
from specexec.options import ConfigError

MB = 10**6


def needs(n: int = 10, layer: int = 100 * MB, fixed: int = 300 * MB, slots: int = 2, bounce: int = 2) -> Needs:
    """n layers of `layer` bytes; fixed costs split over draft / KV / activations."""
    fixed_costs = (("draft", fixed // 3), ("KV caches", fixed // 3), ("activations", fixed - 2 * (fixed // 3)))
    return Needs((layer,) * n, fixed_costs, slots, bounce)


def counts(p) -> tuple[int, int, int]:
    return len(p.layers_in("resident")), len(p.layers_in("ram")), len(p.layers_in("ssd"))


# ------------------------------------------------------------------------------------------------ CUDA

def test_cuda_everything_fits_stays_resident_without_slots() -> None:
    p = plan(needs(), "cuda", ram_budget=0, gpu_budget=2 * GB)
    assert counts(p) == (10, 0, 0)
    assert not p.streams and p.n_slots == 0 and p.device_bytes == 300 * MB + 1000 * MB
    assert p.expected_s == 0.0


def test_cuda_budgets_fill_gpu_then_ram_then_ssd() -> None:
    # GPU: 300 fixed + 200 slots + 3 layers = 800 <= 850; RAM: 2 bounce (200) + 4 layers (400) <= 650; rest SSD.
    p = plan(needs(), "cuda", ram_budget=650 * MB, gpu_budget=850 * MB)
    assert counts(p) == (3, 4, 3)
    assert [t for t in p.tiers if t != "resident"] == ["ram"] * 4 + ["ssd"] * 3
    assert p.device_bytes == 800 * MB and p.host_bytes == 600 * MB
    assert p.slot_bytes == 100 * MB and p.n_bounce == 2


def test_cuda_resident_layers_are_spread_among_the_streamed_ones() -> None:
    """A pass computes its layers in order: resident layers first would compute while every slot is full and the
    link idles. They are spread instead (none first, gaps even), the streamed ones in their order, streamed KV
    companions with their layers; every budget holds the same bytes. Uneven layers keep the planner's prefix."""
    n = Needs((100 * MB,) * 20, (("draft", 50 * MB),), 2, 2, companion_bytes=(10 * MB,) * 20)
    p = plan(n, "cuda", ram_budget=10 * GB, gpu_budget=1000 * MB)
    res = p.layers_in("resident")
    assert 0 < len(res) < 20 and res[0] > 0, p.tiers
    gaps = [b - a for a, b in zip(res, res[1:])]
    assert max(gaps) - min(gaps) <= 1, res
    assert p.device_bytes <= 1000 * MB and p.tier_bytes("resident") == len(res) * 100 * MB
    assert all(not p.streamed_companions[i] for i in res)
    uneven = Needs((50 * MB, 300 * MB, 100 * MB, 100 * MB, 150 * MB), (("draft", 0),), 2, 2)
    assert plan(uneven, "cuda", ram_budget=10 * GB, gpu_budget=650 * MB).tiers[0] == "resident"


def test_cuda_no_bounce_buffers_when_ram_holds_every_streamed_layer() -> None:
    p = plan(needs(), "cuda", ram_budget=700 * MB, gpu_budget=850 * MB)
    assert counts(p) == (3, 7, 0)
    assert p.n_bounce == 0 and p.host_bytes == 700 * MB


def test_cuda_expected_seconds_follow_the_bandwidths() -> None:
    p = plan(needs(), "cuda", ram_budget=650 * MB, gpu_budget=850 * MB, bandwidths=Bandwidths(ram=10e9, ssd=1e9))
    assert p.expected_s == pytest.approx(400 * MB / 10e9 + 300 * MB / 1e9)


@pytest.mark.parametrize("mode, want", [("none", (10, 0, 0)), ("ram", (0, 10, 0)), ("ssd", (0, 0, 10))])
def test_cuda_offload_mode_overrides_the_budgets(mode: str, want: tuple[int, int, int]) -> None:
    p = plan(needs(), "cuda", ram_budget=100 * GB, gpu_budget=100 * GB, mode=mode)
    assert counts(p) == want
    assert p.mode == mode


def test_cuda_gpu_budget_too_small_for_fixed_costs_and_slots_says_what_fits() -> None:
    with pytest.raises(PlanError) as e:
        plan(needs(), "cuda", ram_budget=100 * GB, gpu_budget=400 * MB)
    msg = str(e.value)
    assert "\n" not in msg and "--gpu-budget 0.40 GB" in msg and "at least 0.50 GB" in msg
    assert "draft (0.10 GB)" in msg and "2 streaming slots (0.20 GB)" in msg


def test_offload_none_that_does_not_fit_names_how_many_layers_would() -> None:
    with pytest.raises(PlanError, match=r"--offload auto .*at most 5 of 10 fit resident"):
        plan(needs(), "cuda", ram_budget=100 * GB, gpu_budget=800 * MB, mode="none")


def test_offload_ram_that_does_not_fit_the_ram_budget() -> None:
    with pytest.raises(PlanError, match=r"--ram-budget 0.50 GB cannot hold 10 pinned layers.*--offload ssd"):
        plan(needs(), "cuda", ram_budget=500 * MB, gpu_budget=100 * GB, mode="ram")


def test_ssd_needs_room_for_bounce_buffers() -> None:
    with pytest.raises(PlanError, match=r"--ram-budget .* cannot hold 2 SSD bounce buffers"):
        plan(needs(), "cuda", ram_budget=150 * MB, gpu_budget=100 * GB, mode="ssd")


def test_uneven_layers_size_slots_by_the_largest_streamed_one() -> None:
    n = Needs((50 * MB, 300 * MB, 100 * MB, 100 * MB, 150 * MB), (("draft", 0),), 2, 2)
    p = plan(n, "cuda", ram_budget=10 * GB, gpu_budget=650 * MB)
    # 700 MB do not fit; 2 slots of the largest layer take 600 MB, so only the first layer (50) stays resident
    assert p.tiers == ("resident", "ram", "ram", "ram", "ram")
    assert p.slot_bytes == 300 * MB


# ------------------------------------------------------------------------------------------------ CPU

def test_cpu_ram_budget_bounds_everything_and_the_rest_streams_from_ssd() -> None:
    # 300 fixed + 200 slots + 4 resident layers = 900 <= 950; the other 6 stream from the SSD.
    p = plan(needs(), "cpu", ram_budget=950 * MB)
    assert p.tiers == ("resident",) * 4 + ("ssd",) * 6
    assert p.gpu_budget is None and p.n_bounce == 0 and p.host_bytes == 0
    assert p.device_bytes == 900 * MB


def test_cpu_never_picks_the_ram_tier_on_its_own() -> None:
    for budget in (600, 900, 1250, 1299):
        p = plan(needs(), "cpu", ram_budget=budget * MB)
        assert "ram" not in p.tiers
    assert counts(plan(needs(), "cpu", ram_budget=1300 * MB)) == (10, 0, 0)


def test_cpu_gpu_budget_is_ignored_with_a_warning() -> None:
    p = plan(needs(), "cpu", ram_budget=950 * MB, gpu_budget=1 * MB)
    assert p.gpu_budget is None and counts(p) == (4, 0, 6)
    assert any("--gpu-budget means nothing without CUDA" in w for w in p.warnings)
    assert "warning: --gpu-budget" in p.describe()


def test_cpu_budget_too_small_for_fixed_costs() -> None:
    with pytest.raises(PlanError, match=r"--ram-budget 0.40 GB cannot hold .* at least 0.50 GB"):
        plan(needs(), "cpu", ram_budget=400 * MB)


def test_cpu_offload_ram_counts_the_region_and_the_slots() -> None:
    p = plan(needs(), "cpu", ram_budget=1500 * MB, mode="ram")
    assert counts(p) == (0, 10, 0) and p.host_bytes == 1000 * MB
    with pytest.raises(PlanError):
        plan(needs(), "cpu", ram_budget=1400 * MB, mode="ram")


# ------------------------------------------------------------------------------------------------ misc

def test_describe_and_summary() -> None:
    p = plan(needs(), "cuda", ram_budget=650 * MB, gpu_budget=850 * MB)
    text = p.describe()
    assert "resident (GPU)" in text and "RAM tier (pinned)" in text and "SSD tier" in text
    assert "3 layers [1,5,8]" in text and "[0,2..4]" in text and "[6..7,9]" in text and "s per pass" in text
    s = p.summary()
    assert (s["resident_layers"], s["ram_layers"], s["ssd_layers"]) == (3, 4, 3)
    assert s["ssd_bytes"] == 300 * MB and s["device_bytes"] == 800 * MB


def test_bad_arguments() -> None:
    with pytest.raises(PlanError, match="unknown offload mode"):
        plan(needs(), "cpu", ram_budget=GB, mode="disk")
    with pytest.raises(PlanError, match="needs a GPU budget"):
        plan(needs(), "cuda", ram_budget=GB)
    assert issubclass(PlanError, ValueError)


def test_default_budgets_leave_a_margin() -> None:
    import psutil

    b = default_budgets("cpu")
    assert b.gpu is None and 0 <= b.ram < psutil.virtual_memory().available


def test_offload_config_validates_flags() -> None:
    c = OffloadConfig.from_flags(quant="nf4", offload="ssd", ram_budget="2GB", gpu_budget="512MiB")
    assert (c.quant, c.offload, c.ram_budget, c.gpu_budget) == ("nf4", "ssd", 2 * 10**9, 512 * 2**20)
    assert OffloadConfig() == OffloadConfig.from_flags()
    for kw in ({"quant": "q4"}, {"offload": "disk"}, {"draft_quant": "auto"}, {"ram_budget": "lots"},
               {"gpu_budget": "0GB"}, {"cache_dir": " "}):
        with pytest.raises(ConfigError):
            OffloadConfig.from_flags(**kw)


# ------------------------------------------------------------------------------------------------ ledger, read-ahead

def ledger_sums_match(p) -> None:
    led = p.ledger()
    assert sum(led["device"].values()) == p.device_bytes and sum(led["host"].values()) == p.host_bytes
    assert sum(led["ssd"].values()) == p.tier_bytes("ssd")


def test_cuda_read_ahead_grows_into_ram_left_over() -> None:
    p = plan(needs(), "cuda", ram_budget=100 * GB, gpu_budget=850 * MB, mode="ssd")
    assert p.n_bounce == p.read_ahead == 8 and p.host_bytes == 8 * 100 * MB and p.n_slots == 2
    ledger_sums_match(p)
    few = plan(needs(n=3), "cuda", ram_budget=100 * GB, gpu_budget=850 * MB, mode="ssd")
    assert few.n_bounce == 3                                            # never more than the SSD layers
    some = plan(needs(), "cuda", ram_budget=550 * MB, gpu_budget=100 * GB, mode="ssd")
    assert some.n_bounce == 5                                           # as deep as 550 MB allows


def test_read_ahead_never_displaces_a_layer() -> None:
    # auto: RAM holds 4 layers + 2 bounce buffers (600 of 650 MB); the 50 MB left cannot hold a third buffer
    p = plan(needs(), "cuda", ram_budget=650 * MB, gpu_budget=850 * MB)
    assert counts(p) == (3, 4, 3) and p.n_bounce == 2
    ledger_sums_match(p)


def test_cpu_read_ahead_is_slots_grown_into_ram_left_over() -> None:
    p = plan(needs(), "cpu", ram_budget=10 * GB, mode="ssd")
    assert p.n_slots == p.read_ahead == 8 and p.n_bounce == 0 and p.device_bytes == 300 * MB + 8 * 100 * MB
    ledger_sums_match(p)
    auto = plan(needs(), "cpu", ram_budget=950 * MB)
    assert counts(auto) == (4, 0, 6) and auto.n_slots == 2            # RAM went to resident layers


def test_host_fixed_costs_come_out_of_the_ram_budget_first() -> None:
    n = Needs((100 * MB,) * 10, (("draft", 100 * MB),), 2, 2, host_fixed=(("target embed (host RAM)", 200 * MB),))
    p = plan(n, "cuda", ram_budget=650 * MB, gpu_budget=700 * MB)
    # GPU: 100 fixed + 200 slots + 4 layers; RAM: 200 embed + 2 bounce (200) + 2 layers (200) = 600 <= 650
    assert counts(p) == (4, 2, 4) and p.host_bytes == 600 * MB
    assert p.ledger()["host"]["target embed (host RAM)"] == 200 * MB
    ledger_sums_match(p)
    with pytest.raises(PlanError, match=r"cannot hold target embed \(host RAM\) \(0.20 GB\)"):
        plan(n, "cuda", ram_budget=150 * MB, gpu_budget=700 * MB, mode="ssd")
    with pytest.raises(ValueError, match="on CPU every fixed cost is RAM"):
        plan(n, "cpu", ram_budget=10 * GB)


def test_plan_error_carries_what_fell_short() -> None:
    with pytest.raises(PlanError) as e:
        plan(needs(), "cuda", ram_budget=100 * GB, gpu_budget=400 * MB)
    assert (e.value.flag, e.value.needed, e.value.budget) == ("--gpu-budget", 500 * MB, 400 * MB)
    assert "2 streaming slots" in e.value.what


# ------------------------------------------------------------------------------------------------ companions
# A layer's companion (its KV cache rows): on the device with it, or in RAM travelling with it each pass.

def kv_needs(companion: int = 40 * MB, residue: int = 1 * MB, mode: str = "auto", **kw) -> Needs:
    """needs() with a companion per layer."""
    base = needs(**kw)
    n = len(base.layer_bytes)
    return Needs(base.layer_bytes, base.fixed_bytes, base.n_slots, base.n_bounce, companion_bytes=(companion,) * n,
                 companion_residue=(residue,) * n, companion_name="KV", companions=mode)


def test_companions_stay_on_the_device_while_they_fit() -> None:
    p = plan(kv_needs(), "cuda", ram_budget=10 * GB, gpu_budget=2 * GB)
    assert counts(p) == (10, 0, 0) and p.companions_streamed == []
    assert p.device_bytes == 300 * MB + 10 * 140 * MB and p.ledger()["device"]["KV"] == 400 * MB


def test_short_of_device_memory_the_companions_of_streamed_layers_go_to_ram() -> None:
    """1390 MB: 300 fixed + 200 slots. With every companion (20 MB each) on the device, 6 layers fit (1300 MB)
    and 4 stream (400 MB a pass). Streaming the KV of the 3 streamed layers (2 stages of 20 MB stay) keeps a
    7th layer resident: 300 MB of weights + 60 MB of KV a pass."""
    p = plan(kv_needs(companion=20 * MB, residue=0), "cuda", ram_budget=10 * GB, gpu_budget=1390 * MB,
             bandwidths=Bandwidths(ram=1e9))
    plain = plan(kv_needs(companion=20 * MB, residue=0, mode="device"), "cuda", ram_budget=10 * GB,
                 gpu_budget=1390 * MB, bandwidths=Bandwidths(ram=1e9))
    assert counts(plain) == (6, 4, 0) and plain.companions_streamed == []
    assert counts(p) == (7, 3, 0) and p.companions_streamed == [i for i, t in enumerate(p.tiers) if t != "resident"]
    assert p.expected_s == pytest.approx((300 + 60) * MB / 1e9) and plain.expected_s == pytest.approx(0.4)
    assert p.companion_bytes(True) == 60 * MB == p.ledger()["host"]["KV (streamed)"]
    assert p.ledger()["device"]["KV stages"] == 2 * 20 * MB == p.stage_bytes
    assert p.ledger()["device"]["KV"] == 7 * 20 * MB and p.device_bytes == 1380 * MB
    assert p.host_bytes == 300 * MB + 60 * MB
    assert f"KV streamed with 3 layers [{','.join(map(str, p.companions_streamed))}]" in p.describe()
    assert "KV (streamed)" in p.describe()


def test_the_residue_of_a_streamed_companion_stays_on_the_device() -> None:
    p = plan(kv_needs(companion=20 * MB, residue=2 * MB), "cuda", ram_budget=10 * GB, gpu_budget=1390 * MB)
    assert p.stage_bytes == 2 * 20 * MB + len(p.companions_streamed) * 2 * MB
    assert p.device_bytes <= 1390 * MB


def test_companions_stream_only_when_that_pays() -> None:
    """A gain under COMPANION_GAIN keeps every companion on the device (fewer moving parts)."""
    tiny = kv_needs(companion=1 * MB, residue=0)
    p = plan(tiny, "cuda", ram_budget=10 * GB, gpu_budget=1000 * MB)
    assert p.companions_streamed == []


def test_nothing_fits_without_streaming_companions() -> None:
    """Companions that alone overflow the device: they must stream (and only the stages stay)."""
    big = kv_needs(companion=150 * MB, residue=1 * MB)
    with pytest.raises(PlanError):
        plan(kv_needs(companion=150 * MB, mode="device"), "cuda", ram_budget=10 * GB, gpu_budget=1000 * MB)
    p = plan(big, "cuda", ram_budget=10 * GB, gpu_budget=1000 * MB)
    assert p.streams and len(p.companions_streamed) >= 6 and p.device_bytes <= 1000 * MB


def test_streamed_companions_need_ram() -> None:
    with pytest.raises(PlanError, match="--ram-budget") as e:
        plan(kv_needs(companion=150 * MB), "cuda", ram_budget=300 * MB, gpu_budget=1000 * MB, mode="ssd")
    assert "KV of" in str(e.value)


def test_stream_mode_streams_every_streamed_layers_companion_also_on_cpu() -> None:
    for device, budgets in (("cuda", {"gpu_budget": 850 * MB}), ("cpu", {})):
        p = plan(kv_needs(mode="stream"), device, ram_budget=10 * GB if device == "cuda" else 2 * GB,
                 mode="ssd", **budgets)
        assert p.companions_streamed == list(range(10))
        assert p.stage_bytes == p.n_slots * 40 * MB + 10 * MB               # a stage per slot (CPU: deepened)
        if device == "cpu":                                                 # one budget: RAM holds it all
            assert p.device_bytes + p.host_bytes <= p.ram_budget


def test_cpu_auto_never_streams_companions() -> None:
    p = plan(kv_needs(), "cpu", ram_budget=1200 * MB)
    assert p.streams and p.companions_streamed == []
    assert p.device_bytes == 300 * MB + 400 * MB + p.tier_bytes("resident") + p.n_slots * 100 * MB


def test_running_sums_fit_as_many_layers_as_the_plain_walk() -> None:
    """_Sums.fit (a bisect over prefix sums) answers what _fit_prefix's walk answers, zero-size layers and
    negative rooms included."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        sizes = tuple(rng.choice([0, 5, rng.randint(1, 50)]) for _ in range(rng.randint(0, 10)))
        sums, start = _Sums.of(Needs(sizes)), rng.randint(0, len(sizes))
        room = rng.randint(-20, 200)
        assert sums.fit(start, room) == _fit_prefix(sizes[start:], room), (sizes, start, room)


def test_an_80_layer_plan_reads_each_companion_a_few_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning tries every number of resident layers; each try reads running sums, not every layer again
    (the O(n^2) planner read 80 companions 15,118 times here; now 434, most of them the Plan's own totals)."""
    reads = []
    companion = Needs.companion
    monkeypatch.setattr(Needs, "companion", lambda self, i: reads.append(i) or companion(self, i))
    needs = Needs((int(0.45 * GB),) * 80, (("embed", 2 * GB), ("draft", 5 * GB)),
                  companion_bytes=(40 * 2**20,) * 80, companion_residue=(2**20,) * 80)
    p = plan(needs, "cuda", 20 * GB, 22 * GB)
    assert 0 < len(p.layers_in("resident")) < 80 and p.layers_in("ram") and p.layers_in("ssd")
    assert len(reads) <= 8 * 80, len(reads)


# ------------------------------------------------------------------------------------------------ sub-regions

def moe_needs(reads: tuple[float, ...] | None = None, n: int = 10) -> Needs:
    """10 layers of 100 MB: a 20 MB dense region and 8 sub-regions of 10 MB; a pass reads 4 of 8 uncached ones,
    fewer as the cache holds more (the caller's estimate)."""
    from offload.memory_plan import Parts

    reads = reads or (4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0)
    return Needs((100 * MB,) * n, needs().fixed_bytes, parts=Parts(tuple(range(n)), 10 * MB, 8, reads, "expert"))


def test_a_streamed_layer_costs_its_dense_region_and_the_parts_read() -> None:
    p = plan(moe_needs(), "cuda", ram_budget=10 * GB, gpu_budget=500 * MB, bandwidths=Bandwidths(ram=10e9, ssd=1e9))
    assert counts(p) == (0, 10, 0) and p.cached_parts == 0             # 300 fixed + 2 slots: nothing left over
    assert p.expected_s == pytest.approx(10 * (20 + 4 * 10) * MB / 10e9)    # not 10 x 100 MB
    assert p.pass_bytes("ram") == pytest.approx(600 * MB) and p.tier_bytes("ram") == 1000 * MB


def test_device_memory_left_over_caches_the_most_read_parts_of_each_streamed_layer() -> None:
    # 300 fixed + 200 slots + 1 resident layer = 600 of 690: 90 MB left, one 10 MB part of each of the 9
    # streamed layers (a second resident layer does not fit; one saves more than the cache its bytes would buy)
    p = plan(moe_needs(), "cuda", ram_budget=10 * GB, gpu_budget=690 * MB, bandwidths=Bandwidths(ram=10e9, ssd=1e9))
    assert counts(p) == (1, 9, 0) and p.cached_parts == 1 and p.parts_streamed == 9
    ledger_sums_match(p)
    assert p.device_bytes == 690 * MB and p.part_cache_bytes == 90 * MB
    assert p.ledger()["device"]["expert cache"] == 90 * MB and "expert cache" in p.describe()
    assert p.expected_s == pytest.approx(9 * (20 + 3.5 * 10) * MB / 10e9)
    assert plan(moe_needs(), "cuda", ram_budget=10 * GB, gpu_budget=650 * MB).cached_parts == 0


def test_the_cache_competes_with_resident_layers_for_the_fastest_pass() -> None:
    """With reads that barely fall as the cache grows, resident layers win; with reads that fall fast (hot
    parts), the same memory goes to the cache. Either way the plan is the cheapest of the candidates."""
    flat = plan(moe_needs((4.0,) * 8 + (0.0,)), "cuda", ram_budget=10 * GB, gpu_budget=900 * MB)
    steep = plan(moe_needs((4.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.0)), "cuda", ram_budget=10 * GB,
                 gpu_budget=900 * MB)
    assert len(flat.layers_in("resident")) > len(steep.layers_in("resident"))
    assert steep.cached_parts >= 1 and steep.expected_s < flat.expected_s


def test_cpu_parts_cache_takes_what_the_resident_layers_leave() -> None:
    p = plan(moe_needs(), "cpu", ram_budget=300 * MB + 200 * MB + 2 * 100 * MB + 90 * MB)
    assert counts(p) == (2, 0, 8) and p.cached_parts == 1                # 90 MB left: 8 streamed x 10 MB
    assert p.device_bytes <= p.ram_budget
    assert p.expected_s == pytest.approx(8 * (20 + 3.5 * 10) * MB / p.bandwidths.ssd)


def test_parts_need_one_read_figure_per_cache_size() -> None:
    from offload.memory_plan import Parts

    with pytest.raises(ValueError, match="9 entries"):
        Parts((0,), 10, 8, (1.0, 0.0))
