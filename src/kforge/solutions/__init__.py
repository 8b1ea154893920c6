"""kforge's own solutions to the built-in problem suites: `solutions/levelN/<name>.py` defines
`ModelNew` for `problems/levelN/<name>.py`, built from kforge's kernels
(`kforge suite level1 --solutions builtin`)."""
