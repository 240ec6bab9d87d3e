"""Positional acceptance vectors (Sequoia's p_k): measured on a draft/target pair, cached per pair.

p_k is the probability that, at a node on the accepted path, the k-th child the static builder proposes
(docs/algorithms.md §9; measuring them: §14) is the one the target accepts; 1 - sum(p) is the chance that none
is. The static builder turns the vector into its tree shape. It is measured the way that builder drafts and is verified:
- temperature 0: children are the draft's top-k, the target takes its argmax, so p_k is the share of
  positions where the target's token is the draft's k-th most likely one;
- temperature > 0: children are k draws without replacement from the processed q (Gumbel-top-k, draw order)
  verified by V5 (verify.accept_rrs_without_replacement, the very rule the engine runs) against the processed
  p, so p_k is the share of (position, draw) pairs where the k-th drawn child was accepted.
Positions are the continuations the target itself produced for a prompt set (teacher forcing: one forward of
each model over prompt + continuation gives p and q at every position at once).

The file format (the only one; `save` writes it, `load_table` reads it for the static builder):
    {"vectors": {"<temperature>": {"acceptance": [p_1, ..., p_k], <metadata: positions, prompts, ...>}, ...}}
The pair's vectors are cached under <cache>/acceptance/<pair fingerprint>.json; `--builder static` reads the
file for its pair when it exists (or any file given as its acceptance_file option) and picks the vector
measured at the nearest temperature (builders/static.py). The single-vector files the static builder once
wrote ({"acceptance": [...]} or a bare list) are refused with a ConfigError saying how to rewrite them; pair
caches were always in this format.

Does not know: how the continuations were generated, the CLI, tree shapes.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from specexec.config import SamplingParams
from specexec.network.model import LOGIT_CHUNK, Transformer
from specexec.options import ConfigError
from specexec.sampling import gumbel_topk, process_logits
from specexec.tree import TokenTree
from specexec.tuning.store import read_json, store_path, write_json
from specexec.acceptance.rules import accept_rrs_without_replacement

POSITIONS = 16           # length of a measured vector (children per node the static shape may use)


def pair_fingerprint(target_path: str | Path, draft_path: str | Path, target_args: object, draft_args: object,
                     draft_vocab: object = None) -> str:
    """What a pair's acceptance depends on: both checkpoints (path and shapes) and a trimmed draft head."""
    parts = [str(Path(target_path).resolve()), str(Path(draft_path).resolve()), repr(target_args),
             repr(draft_args), repr(draft_vocab)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def default_path(fingerprint: str) -> Path:
    """The pair's cached vectors: <cache root>/acceptance/<fingerprint>.json (specexec/tuning/store.py)."""
    return store_path("acceptance", fingerprint)


@torch.no_grad()
def position_log_probs(model: Transformer, ids: Sequence[int], start: int, sampling: SamplingParams) -> Tensor:
    """Teacher-forced processed log-probs of the next token at positions start-1 .. len(ids)-2, i.e. the
    distributions the tokens ids[start:] were drawn from: float32 [len(ids) - start, V]."""
    dev = next(model.parameters()).device
    tokens = torch.tensor(list(ids), device=dev)
    hidden = model(tokens[None], torch.arange(tokens.numel(), device=dev)[None])[0]
    rows = torch.arange(start - 1, tokens.numel() - 1, device=dev)
    return torch.cat([process_logits(model.logits(hidden, rows[i:i + LOGIT_CHUNK]), sampling)
                      for i in range(0, rows.numel(), LOGIT_CHUNK)])


def greedy_rank_counts(logp: Tensor, logq: Tensor, k: int = POSITIONS) -> Tensor:
    """T = 0: logp, logq [T, V]; counts [k + 1]: how often the target's argmax is the draft's top-(i+1)
    token (index k: outside the draft's top-k). Ties in q rank by token id, as torch.topk does on CPU."""
    target = logp.argmax(dim=-1)
    top = torch.topk(logq, min(k, logq.shape[-1]), dim=-1).indices         # [T, k]
    hit = top == target[:, None]
    rank = torch.where(hit.any(dim=-1), hit.float().argmax(dim=-1), torch.full_like(target, k))
    return torch.bincount(rank, minlength=k + 1)[: k + 1].double()


def sampled_rank_counts(logp: Tensor, logq: Tensor, k: int = POSITIONS, draws: int = 4,
                        generator: torch.Generator | None = None) -> Tensor:
    """T > 0: for each position, `draws` times: k children drawn from q without replacement, verified by V5
    against p; counts [k + 1] of which child was accepted (index k: none)."""
    counts = torch.zeros(k + 1, dtype=torch.float64)
    p_all, q_all = logp.exp(), logq.exp()
    for t in range(logp.shape[0]):
        p, q = p_all[t], q_all[t]
        for _ in range(draws):
            toks, _keys = gumbel_topk(logq[t], k, generator)
            tree = TokenTree.from_lists([0, *toks.tolist()], [-1] + [0] * toks.numel(), device=logp.device)
            acc = accept_rrs_without_replacement(tree, lambda node: p, lambda node: q, generator)
            counts[acc.nodes[1] - 1 if len(acc.nodes) > 1 else k] += 1
    return counts


def measure(target: Transformer, draft: Transformer, sequences: Sequence[tuple[Sequence[int], int]],
            sampling: SamplingParams, k: int = POSITIONS, draws: int = 4,
            generator: torch.Generator | None = None) -> tuple[list[float], int]:
    """The acceptance vector p_1..p_k over `sequences` = (prompt + continuation ids, continuation start);
    returns (vector, number of positions measured)."""
    counts = torch.zeros(k + 1, dtype=torch.float64)
    for ids, start in sequences:
        if start < 1 or start >= len(ids):
            continue
        logp = position_log_probs(target, ids, start, sampling)
        logq = position_log_probs(draft, ids, start, sampling).to(logp.device)
        counts += (greedy_rank_counts(logp, logq, k) if sampling.greedy
                   else sampled_rank_counts(logp, logq, k, draws, generator))
    total = float(counts.sum())
    if total == 0:
        return [], 0
    return [round(float(c) / total, 6) for c in counts[:k]], int(total if sampling.greedy else total // draws)


def save(path: Path, temperature: float, vector: list[float], **meta: object) -> None:
    """Add (or replace) the vector for `temperature` in the pair's file, keeping the others."""
    data = read(path) or {}
    vectors = dict(data.get("vectors", {}))
    vectors[f"{float(temperature):g}"] = {"acceptance": list(vector), **meta}
    write_json(path, {"vectors": vectors}, indent=1)


def read(path: Path) -> dict | None:
    """The pair's file, or None when absent or unreadable (a damaged cache is re-measured, never trusted)."""
    return read_json(path)


def load_table(path: str | Path) -> dict[float, tuple[float, ...]]:
    """{temperature: acceptance vector} from an acceptance file; ConfigError (one line) for a file that cannot
    be read, is not in this module's format, or holds a vector that is not probabilities summing to <= 1."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the acceptance file {path}: {e}") from None
    vectors = data.get("vectors") if isinstance(data, dict) else None
    if not isinstance(vectors, dict) or not vectors:
        raise ConfigError(f'{path} is not an acceptance file {{"vectors": {{"<temperature>": {{"acceptance": '
                          '[...]}}}; measure one with `specexec bench accept`, or put a bare vector under the '
                          'temperature it was measured at')
    try:
        temps = [float(t) for t in vectors]
    except ValueError:
        raise ConfigError(f"{path}: temperatures must be numbers, got {list(vectors)}") from None
    return {t: _checked(path, v.get("acceptance") if isinstance(v, dict) else None)
            for t, v in zip(temps, vectors.values())}


def _checked(path: str | Path, vec: object) -> tuple[float, ...]:
    if (not isinstance(vec, list) or not vec or any(isinstance(a, bool) or not isinstance(a, (int, float))
                                                    or not 0 <= a <= 1 for a in vec) or sum(vec) > 1.0 + 1e-6):
        raise ConfigError(f"{path}: the acceptance vector must be a non-empty list of probabilities summing to "
                          f"at most 1, got {vec!r}")
    return tuple(float(a) for a in vec)
