"""The project's names the GPU check uses, in one place: a module that moves is one edit here. Also the small
fixtures the steps share: tiny checkpoints, a prefilled cache, a random draft of a real architecture's shapes,
a watch over host synchronisations.

Does not know: which step uses what.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from cli.bench.components.stream import StreamBench, layer_layout, make_plan, measure, synthetic_args  # noqa: F401
from offload.streaming.storage import ALIGN  # noqa: F401
from specexec.network.attention import TreeMask
from specexec.builders import draft_graphs  # noqa: F401
from specexec.builders.base import DraftState  # noqa: F401
from specexec.builders.registry import make_builder  # noqa: F401
from specexec.config import EngineConfig, OffloadConfig, SamplingParams  # noqa: F401

RAM_BUDGET = 16 * 10**9          # every plan inside the check: an explicit RAM budget, not psutil's available
RAM_BUDGET_TEXT = "16GB"         # memory (a lent machine's may start small and grow)
from specexec.decoding.engine import Engine  # noqa: F401
from specexec.kv.cache import KVCache
from specexec.network.model import Transformer, on_meta
from specexec.runtime.assembly import Runtime  # noqa: F401
from specexec.checkpoints.demo_models import write_model, write_perturbed  # noqa: F401
from specexec.checkpoints.loading import load_model  # noqa: F401
from specexec.runtime.offloaded import quantize_layers
from tests.graph_watch import ReaderDuringCapture  # noqa: F401
from tests.sync_count import SyncCounter
from tests.tiny_models import DRAFT_PERTURB, prompt, write_tiny_model  # noqa: F401


def tiny_pair(root: Path, n_layers: int = 2) -> tuple[Path, Path]:
    """(a tiny random target checkpoint, a perturbed copy of it as the draft) under `root`."""
    target = write_tiny_model(root / "target", "llama", seed=0, n_layers=n_layers)
    return target, write_tiny_model(root / "draft", perturb=DRAFT_PERTURB, base=target, seed=1)


def prefilled(model: Transformer, n: int, capacity: int, seed: int = 0) -> KVCache:
    """A KV cache of `model` holding n committed random tokens (one causal pass)."""
    a, p = model.args, next(model.parameters())
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, p.dtype, p.device)
    ids = torch.randint(7, a.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).to(p.device)
    with torch.inference_mode():
        model(ids[None], torch.arange(n, device=p.device)[None], TreeMask(0), cache)
    cache.advance(n)
    return cache


def last_logits(model: Transformer, ids: list[int], one_row: bool) -> torch.Tensor:
    """fp32 logits [V] after `ids`: from one causal pass over all of them (one_row False: a prefill-shaped
    pass), or a prefill of all but the last then a one-row pass of the last (how target-only decoding runs)."""
    dev = next(model.parameters()).device
    cache = model.new_cache(len(ids) + 1)
    t = torch.tensor(ids, device=dev)
    with torch.inference_mode():
        if one_row:
            model(t[None, :-1], torch.arange(len(ids) - 1, device=dev)[None], TreeMask(0), cache)
            cache.advance(len(ids) - 1)
            h = model(t[None, -1:], torch.tensor([[len(ids) - 1]], device=dev), TreeMask(len(ids) - 1), cache)
        else:
            h = model(t[None], torch.arange(len(ids), device=dev)[None], TreeMask(0), cache)
        return model.logits(h[:, -1:]).reshape(-1)


def random_draft(arch: str, n_layers: int, vocab: int, fmt: str, dtype: torch.dtype, device: str = "cuda"
                 ) -> Transformer:
    """A random-weight draft of Llama-3 `arch` shapes (bench stream's table) with `vocab` tokens on `device`,
    its decoder linears in `fmt` with the draft's batch-dependent kernels allowed (row_exact False)."""
    args = replace(synthetic_args(arch, n_layers), vocab_size=vocab)
    with on_meta():
        model = Transformer(args)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.init_rope(device)
    quantize_layers(model, fmt, row_exact=False)
    return model.eval().requires_grad_(False)


class SyncWatch:
    """Host synchronisations while active: CUDA's sync debug mode (each synchronizing call warns) on a GPU,
    the dispatch counter of tests/sync_count.py on a CPU (what a GPU would pay). `count` reads it now."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._records: list = []
        self._cpu = SyncCounter()

    def __enter__(self) -> "SyncWatch":
        if self.cuda:
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._cpu.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)
        else:
            self._cpu.__exit__(*exc)

    @property
    def count(self) -> int:
        if self.cuda:
            return sum("synchroniz" in str(w.message) for w in self._records)
        return self._cpu.total

    def kinds(self) -> dict[str, int]:
        """What synchronized, by kind (CUDA: the warning's first words; CPU: the op)."""
        if not self.cuda:
            return dict(self._cpu.ops)
        out: dict[str, int] = {}
        for w in self._records:
            key = str(w.message)[:60]
            out[key] = out.get(key, 0) + 1
        return out
