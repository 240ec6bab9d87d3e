"""The weight-name mapping's family-level naming (specexec/checkpoints/weight_map.py): where a checkpoint keeps the
decoder (Gemma 3's multimodal checkpoints nest it under language_model.model.* or model.language_model.*, with
the head beside it or at the top level), and the stored tensors a family deliberately leaves unread (the vision
tower and projector, RoPE's inv_freq, a tied head's copy): never read, never "unexpected"; any other stored
name the model does not use is refused in one line. (The per-expert pieces of fused tensors are tested with the
MoE families, tests/network/test_moe.py and tests/offload/formats/test_mxfp4.py.)"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.formats.checkpoint import CheckpointError, SafetensorsCheckpoint
from specexec.checkpoints.loading import load_model, read_args
from specexec.checkpoints.weight_map import checkpoint_prefix, checkpoint_refs, unused_tensors
from tests.tiny_models import family_model

VISION = ["vision_tower.vision_model.embeddings.patch_embedding.weight",
          "multi_modal_projector.mm_input_projection_weight",
          "model.vision_tower.vision_model.post_layernorm.weight",
          "model.multi_modal_projector.mm_soft_emb_norm.weight"]


def test_where_each_layout_keeps_the_decoder_and_its_head(tiny_root: Path) -> None:
    gemma = read_args(family_model(tiny_root, "gemma3_mm"))
    llama = dataclasses.replace(gemma, family="llama")
    hub = ["language_model.model.layers.0.mlp.up_proj.weight", "language_model.lm_head.weight"]
    v5 = ["model.language_model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    assert checkpoint_prefix(gemma, hub) == ("language_model.model.", "language_model.")
    assert checkpoint_prefix(gemma, v5) == ("model.language_model.", "")
    assert checkpoint_prefix(gemma, ["model.layers.0.mlp.up_proj.weight"]) == ("model.", "")
    assert checkpoint_prefix(llama, hub) == ("", "")               # only Gemma's module names these prefixes
    refs = checkpoint_refs(gemma, ["layers.0.mlp.up_proj.weight", "embed_tokens.weight", "lm_head.weight"], hub)
    assert [r.name for r in refs.values()] == [
        "language_model.model.layers.0.mlp.up_proj.weight", "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight"]
    assert checkpoint_refs(gemma, ["lm_head.weight"], v5)["lm_head.weight"].name == "lm_head.weight"


def test_unused_tensors_are_the_familys_and_the_shared_ones(tiny_root: Path) -> None:
    gemma = read_args(family_model(tiny_root, "gemma3_mm"))
    tied = dataclasses.replace(gemma, tie_word_embeddings=True)
    llama = dataclasses.replace(gemma, family="llama")
    stored = VISION + ["language_model.model.layers.0.self_attn.rotary_emb.inv_freq", "language_model.lm_head.weight",
                       "language_model.model.layers.0.mlp.up_proj.weight", "vision_extra.weight"]
    shared = {"language_model.model.layers.0.self_attn.rotary_emb.inv_freq"}
    assert unused_tensors(gemma, stored) == set(VISION) | shared
    assert unused_tensors(tied, stored) == set(VISION) | shared | {"language_model.lm_head.weight"}
    assert unused_tensors(llama, stored) == shared                 # a Llama's vision_tower.* is no known tensor


def _renamed(src: Path, dest: Path, rename) -> Path:
    shutil.copytree(src, dest)
    tensors = load_file(src / "model.safetensors")
    save_file({rename(n): t for n, t in tensors.items()}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_the_vision_tower_is_never_read_and_another_stored_tensor_is_refused(
        tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = family_model(tiny_root, "gemma3_mm")                  # as transformers saves it: the Hub's layout
    stored = load_file(path / "model.safetensors")
    vision = [n for n in stored if "vision" in n or "multi_modal_projector" in n]
    assert vision and any(n.startswith("language_model.model.layers.") for n in stored)
    read: list[str] = []
    get = SafetensorsCheckpoint.get
    monkeypatch.setattr(SafetensorsCheckpoint, "get", lambda self, name: read.append(name) or get(self, name))
    model = load_model(path)
    assert read and not set(read) & set(vision)
    assert len(read) == len(dict(model.named_parameters()))        # every parameter once, nothing more
    monkeypatch.undo()

    v5 = _renamed(path, tmp_path / "v5", lambda n: "model.language_model." + n.removeprefix("language_model.model.")
                  if n.startswith("language_model.model.") else n.removeprefix("language_model."))
    for (name, a), (_, b) in zip(model.state_dict().items(), load_model(v5).state_dict().items()):
        assert torch.equal(a, b), name
    extra = _renamed(path, tmp_path / "extra", lambda n: n.replace(".mlp.up_proj.", ".mlp.extra.")
                     if ".layers.0.mlp.up_proj." in n else n)
    with pytest.raises(CheckpointError, match="unexpected tensor 'language_model.model.layers.0.mlp.extra.weight'"):
        load_model(extra)
