"""Problems of `kforge bench moe`: the grouped GEMMs of a mixture-of-experts layer in DeepGEMM's
two layouts (bf16, and FP8 with block scales) against PyTorch's grouped and per-expert GEMMs,
and DeepSeek-V3's MoE layer against the best PyTorch composition (torch routing, a sort by
expert, torch._grouped_mm). The experts' weights are the Model's (get_init_inputs: one copy
for the reference and one for the candidate), so a round's fresh inputs are the activations
alone and a decode shape's weights still come from HBM on every call (each dwarfs the L2)."""
