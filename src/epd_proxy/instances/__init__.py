"""Who the instances are and whether they serve: one ``Instance`` with all its state,
its health state machine, the pools, the probes, load signals, the roster (pure decisions and
the membership shell), DNS discovery and the roster shared between ``--workers`` processes.

The lifecycle of an instance, and who moves each edge, is drawn in ``instance.py``."""
