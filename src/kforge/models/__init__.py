"""Models that run on kforge's kernels: a Llama-3 engine (llama/), sampling, the batch scheduler."""
