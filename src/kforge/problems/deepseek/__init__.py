"""Problems of DeepSeek's attention and decoding (issue 34): MLA decode over a paged latent
cache against a PyTorch composition of the same computation."""
