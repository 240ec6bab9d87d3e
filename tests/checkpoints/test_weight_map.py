"""The weight-name mapping (specexec/families/weights.py, offload/formats/tensor_source.py): checkpoint names ->
our parameters, with parts of fused tensors. A Llama checkpoint rewritten with q/k/v fused into one tensor
(as Phi-3 ships it) and a map that splits it loads to the same numbers, resident and through the layer cache;
unknown names and clashes are refused in one line."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.cache.store import LayerCache
from offload.formats.checkpoint import CheckpointError
from offload.formats.tensor_source import TensorSource
from specexec.families.weights import WeightMap, default_rules, ignore, rename, split
from specexec.checkpoints.loading import load_model, read_args
from specexec.checkpoints.naming import layer_names
from specexec.runtime.offloaded import build_offloaded


def test_ops_and_their_shapes_from_the_header() -> None:
    t = torch.arange(2 * 6 * 4.0).view(2, 6, 4)
    for ops in [(("slice", 1, 2, 6, 2),), (("select", 0, 1),), (("transpose", 1, 2), ("slice", -1, 0, 3, 1))]:
        src = TensorSource("x", ops)
        assert tuple(src.apply(t).shape) == src.shape((2, 6, 4)) and src.apply(t).is_contiguous()
    assert torch.equal(TensorSource("x", (("slice", 1, 1, 6, 2),)).apply(t), t[:, 1::2])
    assert TensorSource("x").to_json() == "x"
    with pytest.raises(ValueError, match="unknown tensor op"):
        TensorSource("x", (("reshape", 3),))


def _fused(src: Path, dest: Path) -> tuple[Path, int, int]:
    """A copy of a Llama checkpoint whose layers hold one fused `self_attn.qkv.weight` [q; k; v]."""
    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    q_rows = k_rows = 0
    for name in [n for n in tensors if n.endswith("self_attn.q_proj.weight")]:
        base = name.removesuffix("q_proj.weight")
        parts = [tensors.pop(base + f"{p}_proj.weight") for p in "qkv"]
        q_rows, k_rows = parts[0].shape[0], parts[1].shape[0]
        tensors[base + "qkv.weight"] = torch.cat(parts).contiguous()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest, q_rows, k_rows


def test_a_fused_tensor_split_by_the_map_loads_the_same_numbers(tiny_llama: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, q, k = _fused(tiny_llama, tmp_path / "fused")
    pieces = {"q": (0, q), "k": (q, q + k), "v": (q + k, q + 2 * k)}
    rule = split(r"model\.layers\.(\d+)\.self_attn\.qkv\.weight",
                 *[(rf"layers.\1.self_attn.{p}_proj.weight", (("slice", 0, a, b, 1),)) for p, (a, b) in pieces.items()])
    monkeypatch.setattr("specexec.checkpoints.loading.weight_map", lambda a: WeightMap((rule,) + default_rules(a)))
    want, got = load_model(tiny_llama), load_model(path)
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    args = read_args(path)
    names = layer_names(path, args)
    assert names[1].tensors["self_attn.k_proj.weight"] == TensorSource(
        "model.layers.1.self_attn.qkv.weight", (("slice", 0, q, q + k, 1),))
    cache = LayerCache.open_or_build(path, names, "none", torch.float32, cache_root=tmp_path / "c", progress=False)
    model = build_offloaded(path, args, cache, ["ram", "ssd"], torch.device("cpu"), torch.float32)
    ids = torch.randint(7, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    try:
        with torch.inference_mode():
            assert torch.equal(model.logits(model(ids, torch.arange(12)[None])),
                               want.logits(want(ids, torch.arange(12)[None])))
    finally:
        model.close()
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.qkv.weight'"):
        load_model(path)                                # the plain map does not know the fused name


def test_unused_and_clashing_names() -> None:
    wm = WeightMap((ignore(r"vision\..*"), rename(r"a\.(\w+)", r"x.\1"), rename(r"b\.(\w+)", r"x.\1")))
    assert wm.outputs("vision.tower") == [] and wm.outputs("c.y") is None
    found, unknown = wm.sources(["a.w", "vision.tower", "c.y"])
    assert list(found) == ["x.w"] and unknown == ["c.y"]
    with pytest.raises(ValueError, match="'a.w' and 'b.w' both map to 'x.w'"):
        wm.sources(["a.w", "b.w"])
