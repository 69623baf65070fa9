"""Placement: where each leg of a request goes, and why, decided in one place (``decision.py``)
over the roles' host sets, their policies and what the lookups found; ``request/`` carries it
out. It imports nothing of ``request/``: the decision can be made without executing it."""
