"""Level 1: single operators."""
