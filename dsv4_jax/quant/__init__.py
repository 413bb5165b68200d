"""Weight formats, activation quantizers and the matmul dispatcher."""

from .formats import (Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, dequantize, dequantize_blocks,  # noqa: F401
                      is_quantized, weight_bytes, weight_shape)
from .linear import (ACT_QUANT_MODES, group_linear, grouped_linear, grouped_linear_joined,  # noqa: F401
                     grouped_linear_pair, linear, linear_joined, linear_pair)
from .nvfp4 import mxfp4_to_nvfp4, mxfp4_to_nvfp4_is_exact, quantize_nvfp4  # noqa: F401
