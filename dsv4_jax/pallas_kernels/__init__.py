"""Pallas GPU kernels for decode-time matmuls against stored (FP8 / MXFP4 / NVFP4) weights.

    gemv.fp8_matmul, gemv.mxfp4_matmul, gemv.nvfp4_matmul   dense x [M <= 16, K] @ W^T
    moe.moe_matmul                                          rows of x, each times its own expert's FP4 weight

Each has `interpret=True` for CPU (tests) and the pure-jnp reference in dsv4_jax.numerics as its oracle.
"""
