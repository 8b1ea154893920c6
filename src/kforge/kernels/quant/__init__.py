"""Quantized formats and their kernels: FP8 (E4M3/E5M2, per tensor, row or block), INT4
group-wise, MXFP4 and NVFP4. `formats` holds the plain-PyTorch reference of each format
(round to nearest, ties to even; the packed layouts); every kernel here matches it bit for bit."""
