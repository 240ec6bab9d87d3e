"""offload.streaming.storage: pack/unpack round trip for every dtype kind, alignment, views (no copies), layout JSON."""
from __future__ import annotations

import json

import pytest
import torch

from offload.streaming import storage
from offload.streaming.storage import ALIGN, ENTRY_ALIGN, LayerLayout, pack_into, pack_layer, plan_layout, unpack_layer


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.qdata": torch.randint(0, 256, (1000, 1), dtype=torch.uint8, generator=g),
        "w.absmax": torch.randn(31, generator=g),
        "norm": torch.randn(77, generator=g).bfloat16(),
        "half": torch.randn(3, 5, generator=g).half(),
        "ids": torch.arange(-3, 10, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }


def test_round_trip_keeps_every_tensor() -> None:
    tensors = sample()
    buf, layout = pack_layer(tensors, {"format": "nf4"})
    assert buf.dtype == torch.uint8 and buf.shape == (layout.nbytes,) and layout.nbytes % ALIGN == 0
    assert all(e.offset % ENTRY_ALIGN == 0 for e in layout.entries)
    out = unpack_layer(buf, layout)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name
    end = max(e.offset + e.nbytes for e in layout.entries)
    assert int(buf[end:].sum()) == 0                                      # padding is zero


def test_unpack_returns_views_into_the_buffer() -> None:
    buf, layout = pack_layer(sample())
    views = unpack_layer(buf, layout)
    start, stop = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for name, v in views.items():
        if v.numel():
            assert start <= v.data_ptr() < stop, name
            assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    buf.zero_()                                                           # the views see the buffer's bytes
    assert not views["ids"].any() and not views["norm"].float().any()


def test_unpack_into_a_larger_slot_and_pack_into() -> None:
    tensors = sample()
    _, layout = pack_layer(tensors)
    slot = torch.full((layout.nbytes + 3 * ALIGN,), 7, dtype=torch.uint8)
    pack_into(slot, tensors, layout)
    out = unpack_layer(slot, layout)
    assert all(torch.equal(out[n], t) for n, t in tensors.items())


def test_layout_survives_json() -> None:
    _, layout = pack_layer(sample(), {"weights": {"w": {"shape": [2, 3]}}})
    again = LayerLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout
    assert again.entry("ids").shape == (13,) and again.names() == layout.names()
    assert plan_layout({n: (t.dtype, tuple(t.shape)) for n, t in sample().items()}, layout.meta) == layout


def test_bad_buffers_and_layouts_fail_loudly() -> None:
    buf, layout = pack_layer(sample())
    with pytest.raises(ValueError, match="too small"):
        unpack_layer(buf[:ENTRY_ALIGN], layout)
    with pytest.raises(ValueError, match="aligned"):
        unpack_layer(torch.zeros(layout.nbytes + 8, dtype=torch.uint8)[8:], layout)
    with pytest.raises(ValueError, match="uint8"):
        unpack_layer(buf.view(torch.int32), layout)
    bad = layout.to_dict()
    bad["entries"][1]["offset"] = bad["entries"][0]["offset"]             # overlapping entries
    with pytest.raises(ValueError, match="bad packed entry"):
        LayerLayout.from_dict(bad)
    with pytest.raises(ValueError, match="do not match"):
        pack_into(buf, {"x": torch.zeros(1)}, layout)
    with pytest.raises(TypeError):
        plan_layout({"x": (torch.float32, (1,))}, {"not json": object()})


def test_small_layers_still_take_one_aligned_block() -> None:
    _, layout = pack_layer({"x": torch.zeros(1)})
    assert layout.nbytes == storage.ALIGN


def expert_layer() -> dict[str, torch.Tensor]:
    """A layer with a dense part (interleaved with the experts in the given order) and three experts."""
    g = torch.Generator().manual_seed(3)
    out = {"norm": torch.randn(7, generator=g)}
    for e in range(3):
        out[f"x.{e}.w"] = torch.randn(5 + e, 9, generator=g)
        out[f"x.{e}.w.absmax"] = torch.randn(3, generator=g)
    out["router"] = torch.randn(3, 9, generator=g)
    return out


def test_regions_start_and_end_aligned_each_holding_its_prefix() -> None:
    tensors = expert_layer()
    regions = ("x.0.", "x.1.", "x.2.")
    buf, layout = pack_layer(tensors, {}, regions)
    assert [r.name for r in layout.regions] == list(regions)
    assert layout.dense_nbytes == layout.regions[0].offset == ALIGN              # norm and router first
    assert [e.name for e in layout.entries[:2]] == ["norm", "router"]
    end = layout.dense_nbytes
    for r in layout.regions:
        assert r.offset == end and r.offset % ALIGN == 0 and r.nbytes % ALIGN == 0      # back to back, aligned
        assert {e.name for e in layout.region_entries(r.name)} == {n for n in tensors if n.startswith(r.name)}
        end = r.offset + r.nbytes
    assert end == layout.nbytes
    out = unpack_layer(buf, layout)
    assert all(torch.equal(out[n], t) for n, t in tensors.items())
    assert LayerLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def test_one_region_alone_unpacks_from_its_own_bytes() -> None:
    tensors = expert_layer()
    buf, layout = pack_layer(tensors, {}, ("x.0.", "x.1.", "x.2."))
    r = layout.region("x.1.")
    alone = buf[r.offset:r.offset + r.nbytes].clone()                            # e.g. a slot of an expert cache
    views = storage.unpack_region(alone, layout, "x.1.")
    assert sorted(views) == ["x.1.w", "x.1.w.absmax"]
    assert all(torch.equal(v, tensors[n]) and v.untyped_storage().data_ptr() == alone.untyped_storage().data_ptr()
               for n, v in views.items())


def test_a_layer_without_regions_packs_as_before() -> None:
    tensors = expert_layer()
    _, plain = pack_layer(tensors, {})
    assert plain.regions == () and plain.dense_nbytes == plain.nbytes
    assert [e.name for e in plain.entries] == list(tensors)                        # the given order
    assert "regions" not in plain.to_dict()                                        # its manifest reads as before


@pytest.mark.parametrize("regions, why", [(("x.0.", "x.0."), "distinct"), (("x.0.", "y."), "holds no tensor")])
def test_bad_regions_are_refused(regions: tuple[str, ...], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        plan_layout({n: (t.dtype, tuple(t.shape)) for n, t in expert_layer().items()}, {}, regions)


def test_a_region_holding_another_prefix_fails_the_check() -> None:
    _, layout = pack_layer(expert_layer(), {}, ("x.0.", "x.1.", "x.2."))
    d = layout.to_dict()
    d["regions"][0]["offset"] = 0                                                  # now it starts on "norm"
    d["regions"][0]["nbytes"] = d["regions"][1]["offset"]
    with pytest.raises(ValueError, match="another region"):
        LayerLayout.from_dict(d)


class _CountingStr(str):
    calls = 0

    def startswith(self, *args, **kwargs) -> bool:           # type: ignore[override]
        _CountingStr.calls += 1
        return super().startswith(*args, **kwargs)


class _CountingTuple(tuple):
    steps = 0

    def __iter__(self):
        for x in super().__iter__():
            _CountingTuple.steps += 1
            yield x


def _expert_specs(n_experts: int) -> tuple[dict, tuple[str, ...]]:
    specs = {_CountingStr(n): (torch.float32, (4,)) for n in ("router.weight", "norm.weight")}
    for e in range(n_experts):
        for part in ("gate", "up", "down"):
            specs[_CountingStr(f"mlp.experts.{e}.{part}.weight")] = (torch.float32, (4,))
    return specs, tuple(f"mlp.experts.{e}." for e in range(n_experts))


def test_grouping_and_lookups_are_linear_in_the_experts() -> None:
    """Issue 55: plan_layout matched every tensor name against every expert prefix, and region / region_entries /
    entry scanned the layout per lookup (`specexec plan` with 8192 experts: 97 s; 65,536: nothing after 240 s).
    Counted, not timed: name tests while packing 2,000 experts, and the entries and regions walked when every
    region, its entries, every entry and every part are looked up once."""
    specs, regions = _expert_specs(2000)
    n = len(specs)
    _CountingStr.calls = 0
    lay = plan_layout(specs, {}, regions)
    lay.check()
    assert _CountingStr.calls <= 2 * n, _CountingStr.calls                     # was ~n * 1000
    assert [e.name for e in lay.region_entries("mlp.experts.7.")] == [f"mlp.experts.7.{p}.weight"
                                                                     for p in ("gate", "up", "down")]
    counted = LayerLayout(_CountingTuple(lay.entries), lay.nbytes, lay.meta, _CountingTuple(lay.regions))
    _CountingTuple.steps = 0
    for name in regions:
        r = counted.region(name)
        assert len(counted.region_entries(name)) == 3 and counted.part_index(r.offset, r.nbytes) is not None
    for e in lay.entries:
        assert counted.entry(e.name) == e
    assert _CountingTuple.steps <= 3 * (n + len(regions)), _CountingTuple.steps  # was ~n * 2000
