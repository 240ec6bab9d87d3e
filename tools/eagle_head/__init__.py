"""Train a small EAGLE-3 head for a target on this machine's CPU from the target's own greedy answers to
built-in prompts, save it in the published layout (`--draft eagle3:DIR` loads it), and print the command that
benchmarks it against a draft model on the held-out built-in prompts. A developer tool, not the product:
`tools/train-eagle-head --help`."""
