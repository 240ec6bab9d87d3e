"""specexec/tuning/expert_trim.py: which nodes of a grown tree a streamed MoE pass should verify."""
from __future__ import annotations

import torch

from specexec.tree import TokenTree
from specexec.tuning.expert_trim import TreeCost, node_budget, score_values, select

L, E = 2, 8


def onehot(*experts: int) -> torch.Tensor:
    """P [L, E]: a row routed to these experts in every layer."""
    p = torch.zeros(L, E)
    p[:, list(experts)] = 1.0
    return p


def cost(expert_s: float = 0.1, base: float = 0.05, draft: float = 0.0) -> TreeCost:
    return TreeCost(torch.full((L,), expert_s), torch.zeros(L, E, dtype=torch.bool), lambda rows: base, draft)


def test_a_flat_cost_keeps_the_whole_tree() -> None:
    """Nothing to move (every expert held) and a flat base: the dense special case, every node is kept."""
    tree = TokenTree.from_lists(list(range(9)), [-1, 0, 0, 1, 1, 2, 3, 6, 7], [0.0] + [-3.0] * 8)
    held = TreeCost(torch.full((L,), 0.1), torch.ones(L, E, dtype=torch.bool), lambda rows: 0.05)
    probs = torch.stack([onehot(i % E) for i in range(9)])
    keep = select(tree, score_values(tree.scores), probs, held)
    assert keep.tolist() == list(range(9))


def test_a_node_whose_experts_the_tree_reads_anyway_is_kept_and_an_equal_one_that_pulls_new_ones_is_not() -> None:
    # root -> a (experts 0, 1 like the root), root -> b (experts 6, 7: new), each with acceptance 0.3
    tree = TokenTree.from_lists([10, 11, 12], [-1, 0, 0], [0.0, -1.2, -1.2])
    probs = torch.stack([onehot(0, 1), onehot(0, 1), onehot(6, 7)])
    keep = select(tree, score_values(tree.scores), probs, cost())
    assert keep.tolist() == [0, 1]
    assert node_budget(tree, probs, cost(), cost().seconds(probs[keep])) >= 1


def test_kept_sets_are_ancestor_closed() -> None:
    g = torch.Generator().manual_seed(0)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 40)]
    tree = TokenTree.from_lists(list(range(40)), parents, [0.0] + (-torch.rand(39, generator=g) * 4).tolist())
    for d in range(1, 40):
        tree.scores[d] = tree.scores[parents[d]] - abs(float(tree.scores[d])) - 0.01      # scores fall along paths
    probs = torch.softmax(torch.randn(40, L, E, generator=g), -1) * 2
    keep = set(select(tree, score_values(tree.scores), probs, cost(0.02)).tolist())
    assert 0 in keep and all(parents[v] in keep for v in keep if v)


def test_a_saturating_union_keeps_growing_past_a_dip() -> None:
    """Two experts per layer only: the first nodes pay for new experts, after that every node is free. A
    greedy that stopped at the first node lowering the rate would keep the root alone."""
    tree = TokenTree.from_lists(list(range(6)), [-1, 0, 1, 2, 3, 4], [0.0, -0.9, -1.0, -1.1, -1.2, -1.3])
    probs = torch.stack([torch.full((L, E), 0.0)] * 6)
    probs[0, :, 0] = 1.0                          # the root reads expert 0, node 1 expert 1, the rest 0 or 1
    probs[1, :, 1] = 1.0
    probs[2:, :, 0] = 1.0
    keep = select(tree, score_values(tree.scores), probs, cost(0.5))
    assert keep.tolist() == list(range(6))


def test_seconds_with_independent_rows_is_the_product_formula() -> None:
    probs = torch.full((3, L, E), 0.25)
    c = TreeCost(torch.full((L,), 1.0), torch.zeros(L, E, dtype=torch.bool), lambda rows: 0.0, gamma=1.0)
    assert abs(c.seconds(probs) - L * E * (1 - 0.75 ** 3)) < 1e-9
    discounted = TreeCost(c.expert_s, c.held, c.base, gamma=0.5)
    assert discounted.seconds(probs) < c.seconds(probs)              # correlated rows read fewer experts
