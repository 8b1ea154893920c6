"""Level 1 solutions: one file per problem in `kforge.problems.level1`, same file name."""
