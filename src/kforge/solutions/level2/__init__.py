"""Level 2 solutions: one file per problem in `kforge.problems.level2`, same file name."""
