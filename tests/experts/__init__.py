"""MoE experts: the engine's expert companion (routing learnt, trees trimmed), the streamed expert pass and its
device cache, experts run on the CPU, and the self-draft's hot copies."""
