"""specexec: a small resident draft grows a large token tree; the target verifies it in one pass.

The target's weights may stream from RAM or SSD layer by layer (the `offload` package), which makes one pass
cost about the same for one token as for a thousand: that is what the big tree pays for. Greedy output equals
the target-only decode token for token; sampling keeps the target's distribution (docs/algorithms.md §5).

Public API (exactly `specexec.__all__`; each name is imported on first use, so `import specexec` stays cheap):

- `Runtime`: a loaded target (+ draft), the tokenizer and the engine; `Runtime.load(model, draft, config)`.
- `Engine`: the decoding loop over token ids (prefill, then draft tree -> one target pass -> accept).
- `EngineConfig`: tree budget and builder, verifier, device, dtype, max_new_tokens.
- `SamplingParams`: temperature, top-k/p, min-p, penalties, seed (the default is greedy).
- `OffloadConfig`: how the target is stored and where its layers live (quant, offload, budgets, KV).
- `ModelArgs`: a model's shape as read from its config.json.
- `ConfigError`: every invalid setting raises it, with one line saying what to change.
- `TreeBuilder`: what a tree builder is (specexec/builders/base.py).
- `make_builder`: a builder by name ("specexec", "chain", "static", "dynamic", ...), with its options.
- `Transformer`: the resident Llama-family network (specexec/network/model.py).
- `load_model`: a checkpoint directory -> a resident `Transformer` in eval mode.
- `read_args`: a checkpoint directory -> its `ModelArgs`.
- `resolve_model_path`: a path, a catalogue name or a hub id -> a local checkpoint directory.
- `load_tokenizer`: a checkpoint directory -> its tokenizer.

Example (random-weight checkpoints written on the spot, nothing downloaded): a draft/target pair decodes
exactly what the target alone decodes.

>>> import tempfile
>>> from pathlib import Path
>>> from specexec import EngineConfig, Runtime
>>> from specexec.checkpoints.demo_models import write_model, write_perturbed
>>> root = Path(tempfile.mkdtemp())
>>> target = write_model(root / "target", n_layers=2, hidden=64, intermediate=128)
>>> draft = write_perturbed(root / "draft", target, perturb=0.01)
>>> rt = Runtime.load(str(target), str(draft), EngineConfig(budget=16, max_new_tokens=8))
>>> prompt = rt.encode("Hello")
>>> ids = [t for step in rt.generate_ids(prompt) for t in step]
>>> alone = rt.variant(rt.config, use_draft=False)
>>> ids == [t for step in alone.generate_ids(prompt) for t in step]
True

Does not know: how any of these work; it only says where each lives (docs/layout.md draws the whole tree).
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Runtime": "specexec.runtime.assembly",
    "Engine": "specexec.decoding.engine",
    "EngineConfig": "specexec.config",
    "SamplingParams": "specexec.config",
    "OffloadConfig": "specexec.config",
    "ModelArgs": "specexec.config",
    "ConfigError": "specexec.options",
    "TreeBuilder": "specexec.builders.base",
    "make_builder": "specexec.runtime.assembly",
    "Transformer": "specexec.network.model",
    "load_model": "specexec.checkpoints.loading",
    "read_args": "specexec.checkpoints.loading",
    "resolve_model_path": "specexec.checkpoints.loading",
    "load_tokenizer": "specexec.runtime.tokenizer",
}

__all__ = list(_WHERE)
__version__ = "0.1.0"          # the one place the version is written (pyproject.toml reads it from here)


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'specexec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
