"""Level 2 problems: fusions of two or more ops, where the win is the traffic between them."""
