"""Level 3 solutions: one file per problem in `kforge.problems.level3`, same file name."""
