"""Numerics, the package's lowest layer: stored weight formats (FP8 block, MXFP4, NVFP4) and their reference
dequantization, the exact roundings and the model's trained fake quant, the activation quantizers of the `act_quant`
modes and the codecs of the decode state's compact entries. Pure functions, testable in float64; they import
nothing else of dsv4_jax, and everything else (the kernels included) builds on them."""

from .formats import (Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, dequantize, dequantize_blocks,  # noqa: F401
                      is_quantized, weight_bytes, weight_shape)
from .nvfp4 import mxfp4_to_nvfp4, mxfp4_to_nvfp4_is_exact, quantize_nvfp4  # noqa: F401
