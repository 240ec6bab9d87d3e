"""What takes part in a decoding step besides the engine's five stages: the companions' protocol (protocol.py),
the engine's companions and their order (roster.py), and the companions with a file of their own: the gate's
pilot (gate.py), an MoE target's experts (experts.py), a drafter's feed from the target (feeding.py). A new
per-step concern (a hybrid state, a drafter's need) is one more companion here, not a branch in the loop.
"""
