"""The ops layer: each fused operation of the model, its pure-jnp reference and its kernels, and the one choice
between them (ops/choice.py) made from the run context: the phase its engine program declares, the kernel plan's
backend and the plan's per-op overrides. Layers call these and never look at a kernel themselves."""

from .matmul import (ACT_QUANT_MODES, group_linear, grouped_linear, grouped_linear_joined,  # noqa: F401
                     grouped_linear_pair, head_linear, linear, linear_joined, linear_pair)
