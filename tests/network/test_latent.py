"""Multi-head latent attention (specexec/network/latent.py, specexec/kv/latent.py) beyond what every MoE family is
tested for in tests/core/test_moe.py and tests/core/test_family_builders.py (logits, trees with the split and
the dense mask, greedy ids with every builder, resident, SSD with the latent rows streamed, RAM with
--experts cpu, the expert cache):
- the cache holds one row of kv_lora_rank + qk_rope_head_dim values per token and layer, what the planner counts,
  against what plain attention of the same heads would hold (DeepSeek-V3, Kimi-K2 as published);
- an 8,192-token prompt gives transformers' greedy ids (YaRN x4 past the original 4,096 positions);
- the sparse-attention successors are refused with one line naming their attention;
- a config.json whose latent ranks do not match the stored tensors is refused with one line naming the tensor.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from offload.formats.checkpoint import CheckpointError
from specexec.checkpoints.loading import load_model
from specexec.families import model_args
from specexec.kv.latent import plain_row_bytes
from specexec.options import ConfigError
from specexec.planning.sizes import kv_bytes
from tests.network.model_reference import hf_model
from tests.tiny_models import write_tiny_model

CONFIGS = SHIPPED_CONFIGS


def test_the_cache_holds_one_latent_row_per_token_and_layer(tiny_deepseek_v3: Path) -> None:
    model = load_model(tiny_deepseek_v3)
    a, m = model.args, model.args.latent
    cache = model.new_cache(100)
    assert cache.nbytes == 100 * a.n_layers * (m.kv_rank + m.rope_dim) * 4 == kv_bytes(a, 100, 4)
    plain = a.n_layers * plain_row_bytes(a, 100, 4)                  # 4 heads x (16 + 8 + 12) values
    assert (cache.nbytes, plain) == (100 * 3 * 40 * 4, 100 * 3 * 4 * 36 * 4)


@pytest.mark.parametrize("parts", [1, 2])
def test_rows_of_one_and_two_parts_read_back_what_was_written(parts: int) -> None:
    """A K/V row store (2 parts) and a latent one (1 part: the row is both key and value): written at tree
    slots, kept, read back."""
    from specexec.kv.cache import KVCache

    cache = KVCache(2, 1, 8, 16, torch.float32, "cpu", parts=parts)
    g = torch.Generator().manual_seed(parts)
    k, v = torch.randn(1, 1, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    cache.write(1, torch.arange(5), k, v if parts == 2 else None)
    cache.keep(torch.tensor([1, 3]))
    got_k, got_v = cache.view(1, 2)
    assert torch.equal(got_k, k[:, :, [1, 3]]) and torch.equal(got_v, (v if parts == 2 else k)[:, :, [1, 3]])
    assert cache.nbytes == 2 * 16 * parts * 8 * 4


@pytest.mark.parametrize("name, latent, plain", [("deepseek-v3", 70_272, 4_997_120),
                                                 ("kimi-k2-instruct", 70_272, 2_498_560)])
def test_published_latent_caches_per_token(name: str, latent: int, plain: int) -> None:
    """bf16 bytes per token: 61 layers x (512 + 64) x 2 for the latent, 61 x heads x (192 + 128) x 2 plain."""
    args = model_args(json.loads((CONFIGS / name / "config.json").read_text()))
    assert kv_bytes(args, 1, 2) == latent and args.n_layers * plain_row_bytes(args, 1, 2) == plain
    factor = 40 if name == "deepseek-v3" else 32                    # YaRN, mscale_all_dim 1: the score scale
    assert args.attn_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(factor) + 1) ** 2)


@pytest.mark.parametrize("arch, words", [("DeepseekV32ForCausalLM", "DeepSeek sparse attention"),
                                         ("GlmMoeDsaForCausalLM", "DeepSeek sparse attention"),
                                         ("DeepseekV4ForCausalLM", "compressed sparse attention")])
def test_sparse_attention_successors_are_refused_naming_their_attention(arch: str, words: str) -> None:
    cfg = json.loads((CONFIGS / "deepseek-v3" / "config.json").read_text()) | {"architectures": [arch]}
    with pytest.raises(ConfigError, match=words) as err:
        model_args(cfg)
    assert "\n" not in str(err.value) and arch in str(err.value)


@pytest.mark.parametrize("field, tensor", [("kv_lora_rank", "kv_a_proj_with_mqa"), ("q_lora_rank", "q_a_proj"),
                                           ("qk_rope_head_dim", "q_b_proj"), ("v_head_dim", "kv_b_proj")])
def test_latent_ranks_that_do_not_match_the_tensors_are_one_line(field: str, tensor: str, tiny_deepseek_v3: Path,
                                                                  tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_deepseek_v3, tmp_path / "ds"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {field: cfg[field] + 8}))
    with pytest.raises(CheckpointError, match=f"self_attn.{tensor}.weight has shape") as err:
        load_model(path)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_an_8k_prompt_gives_transformers_greedy_ids(tiny_root: Path) -> None:
    """2 layers (one dense, one routed), YaRN x4 over an original 128 positions, 8,192 prompt tokens: the
    runtime (chunked prefill over the latent cache, then a perturbed draft's trees) gives transformers'
    generate ids. About a minute on each side."""
    from specexec.config import EngineConfig, OffloadConfig
    from specexec.runtime.assembly import Runtime

    path = write_tiny_model(tiny_root / "deepseek-8k", "deepseek_v3", seed=28, n_layers=2,
                            max_position_embeddings=16384)
    draft = write_tiny_model(tiny_root / "deepseek-8k-draft", perturb=0.01, base=path, seed=29)
    ids = torch.randint(7, 300, (8192,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = hf_model(path).generate(ids[None], max_new_tokens=16, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, 8192:].tolist()
    rt = Runtime.load(str(path), str(draft), EngineConfig(budget=8, dtype="float32"),
                      offload=OffloadConfig(quant="none", offload="none", context=8300))
    try:
        got = [t for step in rt.generate_ids(ids.tolist(), 16) for t in step]
    finally:
        rt.engine.close()
    assert got == want[:len(got)] and (len(got) == 16 or got[-1] in rt.engine.eos_ids)
