"""tools/train-eagle-head: data (data.py), training (train.py), the saved head, the bench command."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specexec.config import EngineConfig, OffloadConfig
from specexec.drafters.choose import choose, load_drafter
from specexec.drafters.registry import parse_draft
from specexec.drafters.eagle3 import default_taps
from specexec.runtime.assembly import Runtime
from tools.eagle_head import data, train

MODELS = Path("/work/models")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/train-eagle-head", description=__doc__)
    p.add_argument("--target", default=str(MODELS / "qwen2.5-coder-1.5b-instruct"))
    p.add_argument("--draft", default=str(MODELS / "qwen2.5-coder-0.5b-instruct"),
                   help="draft model that makes generating the target's greedy answers faster (exact)")
    p.add_argument("--out", default="eagle3-head", help="directory the head is written to")
    p.add_argument("--prompts", type=int, default=len(data.PROMPTS), help="how many of the built-in instructions")
    p.add_argument("--doc-prompts", type=int, default=16, help="prompts made of passages of docs/algorithms.md")
    p.add_argument("--new-tokens", type=int, default=160, help="greedy answer tokens per prompt")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the head's own vocabulary size")
    p.add_argument("--intermediate", type=int, default=2048, help="the head's MLP width")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time test depth")
    p.add_argument("--minutes", type=float, default=30.0, help="the whole run's time, data included")
    p.add_argument("--train-seconds", type=float,
                   help="training time (default: what --minutes leaves after the data, less a minute to save)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (on a busy machine 1: spinning threads that wait for a core cost more than they give)")
    p.add_argument("--samples", help="keep the generated data in this file and reuse it when it exists")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    runtime = Runtime.load(args.target, args.draft, EngineConfig(budget=6, builder="specexec"), progress=say,
                           offload=OffloadConfig(draft_quant="int4"))
    target = runtime.engine.target
    taps = default_taps(target.args.n_layers)
    if args.samples and Path(args.samples).is_file():
        samples = [data.Sample(**d) for d in torch.load(args.samples)]
        say(f"{len(samples)} samples from {args.samples}")
    else:
        prompts = list(data.PROMPTS[:args.prompts]) + data.doc_prompts(args.doc_prompts)
        sequences = data.answers(runtime, prompts, args.new_tokens, say)
        samples = data.teacher_forced(target, sequences, taps, say)
        if args.samples:
            torch.save([vars(s) for s in samples], args.samples)
    held = samples[::8]                                 # an eighth of the samples: the held-out top-1 check
    train_set = [s for i, s in enumerate(samples) if i % 8]
    vocab = data.draft_vocabulary(train_set, args.draft_vocab)
    cfg = train.head_config(target, taps, vocab, args.intermediate)
    head = train.new_head(target, cfg, vocab)
    say(f"{sum(s.tokens.numel() for s in train_set)} training rows, {len(held)} held-out samples, head vocabulary "
        f"{vocab.numel()}, taps {taps}")
    budget = (args.train_seconds if args.train_seconds is not None
              else max(args.minutes * 60 - (time.perf_counter() - t0) - 60, 10))
    report = train.train(head, train_set, vocab, budget, args.ttt_steps, say)
    report["held_out_top1_by_depth"] = train.top1(head, held, vocab, args.ttt_steps)
    out = train.save(head, cfg, vocab, Path(args.out))
    choice = choose(parse_draft(f"eagle3:{out}"), Path(args.target), target.args)
    loaded, _ = load_drafter(choice, target, torch.float32, torch.device("cpu"))
    report["saved_vs_trained_max_logit_diff"] = train.check_saved(head, loaded, held[0])
    report |= {"head": str(out.resolve()), "rows": sum(s.tokens.numel() for s in train_set),
               "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report))
    say(f"bench: specexec bench --model {args.target} --drafts {args.draft},eagle3:{out.resolve()} "
        f"--configs specexec,no-draft --budget auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
