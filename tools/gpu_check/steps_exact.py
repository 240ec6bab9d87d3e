"""Exactness on the device: greedy decoding with the draft against the target alone (`--no-draft`).

fp32 (a CPU run) must match token for token. bf16 on CUDA may differ only at a measured near-tie: at the first
token where the two runs part, the target's top-two gap there (from a one-row pass, as target-only decoding
computes it) must be within what rounding moves, i.e. at most twice the change of those two logits between
that one-row pass and a many-row pass over the same tokens (how a tree or prefill computes them), or 2^-6 of
the top logit, whichever is larger. Any other difference is a bug.

Does not know: why rounding differs (kernels, summation order); the draft's quality.
"""
from __future__ import annotations

from tools.gpu_check.registry import Context, step

NEW_TOKENS = 96
PROMPTS = (3, 4, 5, 6)
REL_TIE = 2.0 ** -6


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


def near_tie(model, context: list[int], want: int, got: int) -> dict:
    """The target's view of the position where target-only chose `want` and the tree run `got`."""
    from tools.gpu_check import project as P

    one = P.last_logits(model, context, one_row=True)
    many = P.last_logits(model, context, one_row=False)
    gap = float(one[want] - one[got])
    noise = max(abs(float(one[want] - many[want])), abs(float(one[got] - many[got])))
    bound = max(2 * noise, REL_TIE * max(1.0, abs(float(one[want]))))
    return {"gap": round(gap, 5), "noise": round(noise, 5), "bound": round(bound, 5), "near_tie": gap <= bound}


@step("greedy", budget_s=20)
def greedy(ctx: Context) -> None:
    """Greedy with a draft equals `--no-draft`: exactly in fp32 (CPU), in bf16 (CUDA) but at measured near-ties."""
    import torch

    from tools.gpu_check import project as P

    dtype = "bfloat16" if ctx.cuda else "float32"
    target_path = P.write_model(ctx.tmp / "target", n_layers=4, hidden=256, n_heads=4, n_kv_heads=2)
    draft_path = P.write_perturbed(ctx.tmp / "draft", target_path, 0.05)
    target = P.load_model(target_path, ctx.device, dtype)
    draft = P.load_model(draft_path, ctx.device, dtype)
    budget = 64 if ctx.cuda else 16                                      # two shared cores: a smaller tree
    spec = P.Engine(target, draft, P.EngineConfig(budget=budget, device=ctx.device), P.make_builder("specexec"))
    alone = P.Engine(target, None, P.EngineConfig(budget=1, device=ctx.device), None)
    parted, equal = [], 0
    prompts, n_new = (PROMPTS, NEW_TOKENS) if ctx.cuda else (PROMPTS[:2], 32)     # two cores: fewer tokens
    with torch.inference_mode():
        for seed in prompts:
            ids = P.prompt(seed)
            got = [t for s in spec.generate(ids, n_new) for t in s][:n_new]
            want = [t for s in alone.generate(ids, n_new) for t in s][:n_new]
            j = first_difference(got, want)
            if j is None:
                equal += 1
                continue
            parted.append({"prompt": seed, "at": j, **near_tie(target, ids + want[:j], want[j], got[j])})
    ctx.figure("dtype", dtype)
    ctx.figure("prompts_equal", f"{equal}/{len(prompts)}")
    ctx.figure("tokens_per_prompt", n_new)
    ctx.figure("first_differences", parted)
    if not ctx.cuda:
        ctx.check("fp32: every token equals the target alone's", not parted, parted, [])
    else:
        bad = [p for p in parted if not p["near_tie"]]
        ctx.check("bf16: differences only at measured near-ties", not bad, bad, [])
