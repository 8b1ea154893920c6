"""Level 3 problems: whole blocks of today's models (a Llama-3-8B decoder layer at prefill and
at decode against a KV cache, a Mixtral MoE feed-forward layer, DeepSeek-V3's MoE layer at
prefill and at decode, a ViT-L/16 block, a GELU MLP stack, a small GPT), written as a user writes them in eager PyTorch, in bf16.

Each defines its weights in Model.__init__ from get_init_inputs() (a solution builds the
same ones under the same seed), flops and bytes_moved from the module-level sizes, a
tolerance for bf16 carried through a block, and tiny_sizes (hidden 64, 4 heads of 16, 2 KV
heads, MLP 128, odd token counts) for CPU runs. No forbidden ops: the point of a block is
the whole block, and a solution may use any library call it can beat.
"""
