"""The tree pass's short convolution (GatedDeltaNet._tree_conv) against conv1d's, in bf16 (issue 62, finding 6).

conv1d (the causal pass, prefill) and transformers sum the taps in fp32 and round once; every product of two bf16
values is exact in fp32. On each root-to-leaf path the tree pass must equal, bit for bit, that sum taken oldest tap
first and cast once (the same arithmetic by construction, on any CPU); conv1d's own kernel may order its fp32 sum
otherwise, so against it the test allows a rare one-step rounding difference (summing in bf16 misses on ~half).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specexec.config import LinearArgs, ModelArgs
from specexec.network.linear_attention import GatedDeltaNet, TreePlan

LA = LinearArgs(k_heads=2, v_heads=4, k_dim=16, v_dim=16, conv_kernel=4)


def test_the_tree_convolution_equals_conv1d_in_bf16_on_every_path() -> None:
    torch.manual_seed(0)
    args = ModelArgs(family="qwen3_next", vocab_size=8, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                     intermediate_size=64, linear=LA)
    layer = GatedDeltaNet(args).to(torch.bfloat16)
    C, K, L = LA.conv_dim, LA.conv_kernel, 9
    # A tree of 6 nodes: 0 -> 1 -> 4 and 0 -> 2 -> 3 -> 5, after L committed tokens.
    parent = [-1, 0, 0, 2, 1, 3]
    anc = torch.eye(6, dtype=torch.bool)
    depth = [0] * 6
    for i, p in enumerate(parent):
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    positions = L + torch.tensor(depth)
    plan = TreePlan(L, anc, positions, torch.arange(L, L + 6), True)
    mixed = torch.randn(6, C).bfloat16() * 3
    window = torch.randn(C, K - 1).bfloat16() * 3
    out = layer._tree_conv(mixed, mixed, plan.taps(positions, K), window)
    for leaf in (4, 5):
        path = anc[leaf].nonzero()[:, 0]
        full = torch.cat([window, mixed[path].transpose(0, 1)], dim=-1)
        ref = F.conv1d(full[None], layer.conv1d.weight, groups=C)[0].transpose(0, 1)
        w = layer.conv1d.weight[:, 0].float()
        exact = sum(full[:, m:m + len(path)].float() * w[:, m:m + 1] for m in range(K)).bfloat16().transpose(0, 1)
        assert torch.equal(out[path], exact), (out[path] - exact).abs().max()
        assert ref.dtype == torch.bfloat16
        near = torch.isclose(out[path].float(), ref.float(), rtol=2 ** -7, atol=0)
        assert near.all() and (out[path] != ref).float().mean() <= 0.02
