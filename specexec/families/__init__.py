"""Model families: which Hugging Face architectures specexec runs, and how each one's config.json becomes the
named maths options of ModelArgs (specexec/config.py).

Every difference between families (q/k norms, biases, sliding windows, soft-capping, fused projections,
mixture-of-experts routing, ...) is a named option of ModelArgs that one family module reads from config.json;
the network (specexec/network/model.py) branches on those options, never on a family's name. `registry.py` holds the
one table of architectures; `model_args(cfg)` is the entry point; specexec/checkpoints/weight_map.py maps a
family's checkpoint tensor names onto the network's (with the WEIGHT_RULES its module lists).
"""
from specexec.families.registry import architectures, family_names, model_args

__all__ = ["architectures", "family_names", "model_args"]
