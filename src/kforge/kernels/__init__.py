"""Kernel families: one folder each, one kernel or ladder rung per file (CUDA sources beside their Python launcher)."""
