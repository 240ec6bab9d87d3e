"""Drafters that ship with a model or beside it and draft from the target's hidden states: EAGLE-3 heads
(eagle3.py) and MTP layers; their checkpoint layouts as published, read into the one network of
specexec/network/drafter.py (load.py)."""
