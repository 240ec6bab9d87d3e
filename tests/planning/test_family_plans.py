"""The Hub's own config.json of Gemma 2 27B / 2B, Gemma 3 27B (multimodal) / 1B and Phi-4 (specexec/checkpoints/configs/, copied
from the Hub; nothing is downloaded) read into the options transformers would use, and `specexec plan` of the
two Gemma pairs in NF4 on a 12 GB and a 16 GB card: both fit, the larger card keeps more layers resident, and
Gemma 2's soft-capped attention (plain maths over every key) plans far shorter prefill passes than Gemma 3's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from cli.main import main
from specexec.checkpoints.loading import read_args
from specexec.config import LayerKind

CONFIGS = SHIPPED_CONFIGS


def test_gemma_and_phi_configs_read_as_transformers_would() -> None:
    g2 = read_args(CONFIGS / "gemma-2-27b-it")
    assert (g2.n_layers, g2.attn_softcap, g2.logit_softcap, g2.sliding_window) == (46, 50.0, 30.0, 4096)
    assert g2.attn_scale == 144 ** -0.5 and g2.tie_word_embeddings and g2.embed_scale and g2.sandwich_norms
    assert g2.layer_kinds[:2] == (LayerKind(4096), LayerKind()) and g2.mlp_act == "gelu_tanh"
    g3 = read_args(CONFIGS / "gemma-3-27b-it")
    kinds = g3.layer_kinds
    assert g3.vocab_size == 262208 and g3.n_layers == 62 and g3.eos_token_ids == (1, 106)   # transformers' defaults
    assert [i for i, k in enumerate(kinds) if k.window is None] == list(range(5, 62, 6))
    assert kinds[0] == LayerKind(1024, "local") and g3.local_rope_theta == 10000.0 and g3.rope_theta == 1e6
    assert g3.rope_scaling_dict == {"factor": 8.0, "rope_type": "linear"} and g3.local_rope_scaling is None
    assert g3.attn_scale == 168 ** -0.5 and g3.attn_softcap is None and g3.logit_softcap is None and g3.qk_norm
    g1 = read_args(CONFIGS / "gemma-3-1b-it")
    assert g1.sliding_window == 512 and g1.vocab_size == 262144 and g1.attn_scale == 256 ** -0.5
    phi = read_args(CONFIGS / "phi-4")
    assert (phi.fused_qkv, phi.fused_gate_up, phi.rope_dim, phi.rope_scaling, phi.sliding_window) == \
        (True, True, None, None, None)
    assert (phi.rope_theta, phi.vocab_size, phi.n_kv_heads, phi.tie_word_embeddings) == (250000.0, 100352, 10, False)


def plan(capsys, target: str, draft: str, card: str) -> dict:
    assert main(["plan", "--model", str(CONFIGS / target), "--draft", str(CONFIGS / draft), "--gpu-memory", card,
                 "--ram-budget", "64GB", "--quant", "nf4", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("target, draft", [("gemma-2-27b-it", "gemma-2-2b-it"), ("gemma-3-27b-it", "gemma-3-1b-it")])
def test_gemma_27b_nf4_plans_on_12_and_16_gb(capsys, target: str, draft: str) -> None:
    small, large = plan(capsys, target, draft, "12GB"), plan(capsys, target, draft, "16GB")
    assert large["resident_layers"] > small["resident_layers"]
    assert large["predicted_seconds_per_pass"] < small["predicted_seconds_per_pass"]
    if target.startswith("gemma-2"):
        assert small["prefill_tokens"] < 512             # capped scores over the whole prefix cost memory
    else:
        assert small["prefill_tokens"] >= 2048
