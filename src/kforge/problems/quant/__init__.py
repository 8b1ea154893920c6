"""Problems of `kforge bench quant`: a low-precision kernel against the best PyTorch path on
the SAME numbers. The inputs are drawn in the quantized format with power-of-two scales, so
their dequantized values are exact in bf16: the fp8 or bf16 library call and our kernel
compute one product, and gate 1 compares them at bf16 tolerance."""
