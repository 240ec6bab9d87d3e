"""Acceptance: how a verified tree's drafted tokens are judged. rules.py (the exact rules and which is exact for
which drafting), relaxed.py (--accept relaxed: LOSSY, LANTERN's rule), parsing.py (--accept's text -> an
Acceptance, torch-free; the values' bounds are options.py's, which the configs check below this package),
choice.py (the rule a call runs: `rule_for`, pure). This __init__ imports nothing."""
