"""The names --expert-trim accepts (names only, no torch: configs check them while being built).

experts: a streamed MoE target verifies the nodes of a grown tree worth the experts they pull in
(specexec/tuning/expert_trim.select); nodes: as many best-scoring nodes as the same predicted pass time holds
(the node-count baseline); off: the tree as grown.

Does not know: what the modes do (specexec/expert_passes.py).
"""
from __future__ import annotations

TRIM_MODES = ("experts", "nodes", "off")
