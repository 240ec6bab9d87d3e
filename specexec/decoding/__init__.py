"""The decoding loop: the engine's five stages (engine.py), the prompt's passes and --budget auto's calibration
(prompt_passes.py), what the target says at a tree's nodes (target_logits.py), index uploads without host syncs
(uploads.py) and the non-finite check (finite.py). The engine's companions are specexec/companions/.

Empty on purpose: importing the package imports no module of it."""
