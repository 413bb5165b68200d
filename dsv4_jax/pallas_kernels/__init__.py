"""Pallas GPU kernels (Triton backend): the matmuls against stored (FP8 / MXFP4 / NVFP4) weights and the fused ops
of a decode step and a prefill chunk. docs/kernels.md maps each kernel to its op, its reference and its tests.

    gemv.fp8_matmul, gemv.mxfp4_matmul, gemv.nvfp4_matmul   dense x [M <= 256, K] @ W^T
    moe.moe_matmul                                          rows of x, each times its own expert's FP4 weight
    prefill.fp8_block_matmul                                FP8 tensor-core matmul with per-128 block scales
    quantize, mhc, norm_rope, compressor, indexer, moe_decode, decode_attention: the fused ops

Each has `interpret=True` for CPU (tests); its op module in dsv4_jax/ops/ holds the pure-jnp reference.
"""
