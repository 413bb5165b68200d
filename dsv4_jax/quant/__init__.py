"""Weight formats, activation quantizers and the matmul dispatcher."""

from .formats import Fp8BlockWeight, Mxfp4Weight, dequantize, weight_shape  # noqa: F401
from .linear import grouped_linear, linear  # noqa: F401
