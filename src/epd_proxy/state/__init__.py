"""State shared by every process of the proxy: the few single-use values only a proxy knows
(docs/architecture.md, "What is known, and where it lives"), behind one small interface."""
