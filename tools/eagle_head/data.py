"""The training data of a small EAGLE-3 head: the target's own greedy answers to built-in prompts (none of them in
specexec/prompts/builtin.jsonl, which the benchmark uses as held-out prompts), generated exactly (speculative
decoding with a draft model gives the target's greedy tokens), then one teacher-forced target pass over each
prompt + answer that keeps the three tapped layers' inputs and the target's argmax at every position.

Does not know: the head, training.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specexec.network.attention import TreeMask

ROOT = Path(__file__).resolve().parents[2]

# Instructions of the benchmark's kinds (chat, code, reasoning, summaries), none of them a benchmark prompt.
PROMPTS = (
    "What are some tips for keeping houseplants alive in a dark apartment?",
    "Write a polite email declining an invitation to a friend's wedding because of a work trip.",
    "How do I start running if I have never exercised before? Give me a four-week plan.",
    "Explain the difference between a virus and a bacterium in simple words.",
    "Suggest a weekly meal plan for a vegetarian on a budget.",
    "What should I look for when buying a used bicycle?",
    "Describe how a bill becomes a law in a parliamentary democracy.",
    "Give me advice on how to ask my manager for a raise.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python class for a stack with push, pop, peek and is_empty, with docstrings.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Write a Python script that counts the words in a text file and prints the ten most common ones.",
    "Implement binary search in Python and explain its time complexity.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a Python decorator is and write one that times a function.",
    "Write a Rust function that reverses the words of a sentence.",
    "A train leaves at 9:40 and arrives at 13:15. How long is the journey? Explain step by step.",
    "If three pencils cost 75 cents, how much do eleven pencils cost? Show your reasoning.",
    "A rectangle has a perimeter of 30 cm and its length is twice its width. Find its area.",
    "Is it possible for a week to contain two Mondays? Explain your answer carefully.",
    "There are 12 socks in a drawer, 6 black and 6 white. How many must I take to be sure of a matching pair?",
    "A shop discounts a jacket by 20% and then by another 10%. What is the total discount?",
)

DOC_TASKS = ("Summarise the following text in a few sentences:", "Explain the following passage to a newcomer:",
             "List the main points of this text:")


def doc_prompts(n: int, words: int = 140) -> list[str]:
    """n prompts asking about passages of this repository's own documentation (docs/algorithms.md)."""
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "algorithms.md").read_text())
    tokens = text.split(" ")
    step = max(words, (len(tokens) - words) // max(n, 1))
    return [f"{DOC_TASKS[i % len(DOC_TASKS)]}\n\n{' '.join(tokens[i * step:i * step + words])}" for i in range(n)]


@dataclass
class Sample:
    """One prompt + answer: tokens [T]; taps [T, k*D] (the tapped layers' inputs at each position, layer order);
    argmax [T] (the target's greedy next token after each position)."""

    tokens: torch.Tensor
    taps: torch.Tensor
    argmax: torch.Tensor


def answers(runtime, prompts: list[str], new_tokens: int, say) -> list[list[int]]:
    """The target's greedy answer to each prompt (chat template), as prompt ids + answer ids."""
    out = []
    t0 = time.perf_counter()
    for i, text in enumerate(prompts):
        ids = runtime.encode(text, chat=True)
        got = [t for step in runtime.generate_ids(ids, new_tokens) for t in step]
        out.append(ids + got)
        say(f"answers {i + 1}/{len(prompts)} ({time.perf_counter() - t0:.0f} s)")
    return out


@torch.no_grad()
def teacher_forced(target, sequences: list[list[int]], taps: tuple[int, ...], say) -> list[Sample]:
    """One cached target pass per sequence (as the engine's prefill runs it) keeping `taps` and the argmax."""
    samples = []
    plain = target.execution
    target.run_as(replace(plain, taps=taps))
    try:
        for i, seq in enumerate(sequences):
            ids = torch.tensor(seq)
            cache = target.new_cache(ids.numel() + 1)
            hidden = target(ids[None], torch.arange(ids.numel())[None], TreeMask(0), cache)[0]
            tapped = torch.cat([t[0] for t in target.tapped], dim=-1).float().clone()
            argmax = torch.cat([target.logits(hidden[s:s + 256]).argmax(-1) for s in range(0, ids.numel(), 256)])
            samples.append(Sample(ids, tapped, argmax))
            say(f"target states {i + 1}/{len(sequences)}")
    finally:
        target.run_as(plain)
        target.drop_tapped()
    return samples


def draft_vocabulary(samples: list[Sample], size: int) -> torch.Tensor:
    """The head's vocabulary: the `size` tokens the target predicts most often in the samples, sorted ids."""
    counts = torch.bincount(torch.cat([s.argmax for s in samples]))
    keep = counts.topk(min(size, int((counts > 0).sum()))).indices
    return keep.sort().values
