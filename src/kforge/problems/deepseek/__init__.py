"""Problems of DeepSeek's attention and decoding: MLA decode over a paged latent
cache against a PyTorch composition of the same computation."""
