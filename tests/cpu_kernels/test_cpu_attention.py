"""Batch-invariant CPU attention (cpu_kernels/attend.py): the compiled kernel and its pure-torch
twin agree with an fp64 softmax over each row's slots; each of them gives a row the same bits whatever the other
rows (a tree pass against one-token passes over the same slots); fp32 and bf16, GQA, strided caches.
"""
from __future__ import annotations

import pytest
import torch

from cpu_kernels import attend, build


@pytest.fixture(params=["kernel", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel":
        if build.library() is None:
            pytest.skip(build.status())
    else:
        monkeypatch.setattr(attend, "library", lambda: None)
    return request.param


def _case(T: int, P: int, H: int = 4, Hkv: int = 2, D: int = 24, seed: int = 0):
    """q [1, H, T, D]; k, v [1, Hkv, S, D] views of a longer cache (strided); a random tree's slot lists."""
    g = torch.Generator().manual_seed(seed)
    S = P + T
    q = torch.randn(1, T, H, D, generator=g).transpose(1, 2)                     # strided like the model's
    k, v = (torch.randn(1, Hkv, S + 7, D, generator=g)[:, :, :S] for _ in range(2))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
    tree = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        tree[i, i] = True
        if p >= 0:
            tree[i] |= tree[p]
    seen = torch.cat([torch.ones(T, P, dtype=torch.bool), tree], dim=1)[None]
    return q, k, v, seen


def _fp64(q, k, v, seen, scale):
    Hkv, G = k.shape[1], q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~seen[:, None], float("-inf"))
    return torch.softmax(s, -1) @ vv


@pytest.mark.parametrize("T,P,D,scale", [(1, 5, 24, 0.3), (7, 0, 24, 0.3), (16, 33, 24, 0.3), (9, 130, 24, 0.3),
                                         (3, 200, 128, 0.1), (2, 300, 128, 0.2)])
def test_agrees_with_an_fp64_softmax(impl, T: int, P: int, D: int, scale: float) -> None:
    """Heads of 24 and 128 (the dot products' 8-wide and 32-wide steps), rows of up to 300 slots (the softmax's
    8-lane exp and its scalar tail)."""
    q, k, v, seen = _case(T, P, D=D)
    idx, lens = attend.slot_lists(seen)
    got = attend.attend_rows(q, k, v, idx, lens, scale)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _fp64(q, k, v, seen, scale), rtol=0, atol=2e-6)


def test_a_key_far_above_the_rest_takes_all_the_weight(impl) -> None:
    """Scores 100+ below the row's maximum (the kernel's exp clamps its argument at -87): their weights are 0 to
    fp32, and the row's output is that one key's value."""
    q, k, v, seen = _case(1, 40, D=128)
    k[0, :, 17] = 8 * q[0, ::2, 0] / q[0, ::2, 0].norm(dim=-1, keepdim=True) * 128 ** 0.5
    idx, lens = attend.slot_lists(seen)
    got = attend.attend_rows(q[:, ::2], k, v, idx, lens, 1.0)
    torch.testing.assert_close(got[0, :, 0], v[0, :, 17], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_bits_of_its_one_token_pass(impl, dtype: torch.dtype) -> None:
    """Row t of a tree pass == a one-token pass whose cache holds just the slots row t sees, in order."""
    T, P = 12, 20
    q, k, v, seen = (t.to(dtype) if t.is_floating_point() else t for t in _case(T, P, seed=3))
    idx, lens = attend.slot_lists(seen)
    full = attend.attend_rows(q, k, v, idx, lens, 0.25)
    assert full.dtype == dtype
    for t in range(T):
        sl = seen[0, t].nonzero().flatten()
        one_seen = torch.ones(1, 1, len(sl), dtype=torch.bool)
        one = attend.attend_rows(q[:, :, t:t + 1], k[:, :, sl], v[:, :, sl], *attend.slot_lists(one_seen), 0.25)
        assert torch.equal(one[:, :, 0], full[:, :, t]), t


@pytest.mark.parametrize("S", [5, 20])
def test_a_nan_key_makes_its_rows_nan(impl, S: int) -> None:
    """A NaN score stays NaN through the softmax's exp (its clamp does not turn it into a weight): the rows that
    see the key come out NaN, as in torch, never as plausible numbers. S 20: the 8-lane exp; 5: the scalar tail."""
    q, k, v, seen = _case(1, S - 1, D=16)
    k[0, :, 3, 0] = float("nan")
    got = attend.attend_rows(q, k, v, *attend.slot_lists(seen), 0.25)
    assert got.isnan().all()


@pytest.mark.parametrize("T", [1, 5])
def test_the_thread_count_never_changes_a_bit(T: int) -> None:
    """The kernel hands each thread a KV head's query heads together, or some of them where the KV heads are fewer
    than the threads (8 query heads on 2 KV heads: 1 to 4 heads a task here); every head's arithmetic is the same
    sequence either way."""
    if build.library() is None:
        pytest.skip(build.status())
    q, k, v, seen = _case(T, 37, H=8, Hkv=2, D=64, seed=6)
    idx, lens = attend.slot_lists(seen)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 3, 8):
            torch.set_num_threads(threads)
            outs.append(attend.attend_rows(q, k, v, idx, lens, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_the_kernel_and_the_torch_twin_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    if build.library() is None:
        pytest.skip(build.status())
    q, k, v, seen = _case(10, 40, H=6, Hkv=3, D=64, seed=5)
    idx, lens = attend.slot_lists(seen)
    compiled = attend.attend_rows(q, k, v, idx, lens, 0.125)
    monkeypatch.setattr(attend, "library", lambda: None)
    torch.testing.assert_close(attend.attend_rows(q, k, v, idx, lens, 0.125), compiled, rtol=0, atol=1e-6)


def test_slot_lists_keep_each_rows_slots_in_order() -> None:
    seen = torch.tensor([[[True, False, True, True], [False, True, False, False]]])
    idx, lens = attend.slot_lists(seen)
    assert lens.tolist() == [[3, 1]] and idx[0, 0].tolist() == [0, 2, 3] and idx[0, 1, 0] == 1
