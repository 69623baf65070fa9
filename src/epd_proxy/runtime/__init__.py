"""Processes: the composition root (``build``), serving and shutdown (``serve``), the
``--workers`` supervisor (``workers``) and configuration reload (``reload``)."""
