"""`python -m kforge.models.deepseek`: plain vs speculative generation on random weights (generate.main)."""

from kforge.models.deepseek.generate import main

main()
