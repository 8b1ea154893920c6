"""Built-in problems, KernelBench-format files grouped by level (1: single ops, 2: fusions, 3: blocks)."""
