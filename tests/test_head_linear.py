"""ops.matmul.head_linear: the LM head's float32 logits. Where its rows and the stored head are both bf16, kernel
plans take a bf16 dot with float32 accumulation (the same exact products as float32 operands); the reference plan,
a float32 model and a float32 head keep float32 operands. Against float64 numpy, on fresh seeded inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.ops import choice, head_linear
from dsv4_jax.run_context import RunContext


def _inputs(rng, h_dtype, w_dtype, rows=24, dim=512, vocab=1000):
    h = jnp.asarray(rng.standard_normal((2, rows, dim)), h_dtype)
    w = jnp.asarray(rng.standard_normal((vocab, dim)) * dim ** -0.5, w_dtype)
    return h, w


@pytest.mark.parametrize("kernels, h_dtype, w_dtype, bf16_dot", [
    ("interpret", jnp.bfloat16, jnp.bfloat16, True),
    ("reference", jnp.bfloat16, jnp.bfloat16, False),
    ("interpret", jnp.float32, jnp.bfloat16, False),
    ("interpret", jnp.bfloat16, jnp.float32, False)])
def test_head_logits_are_the_float32_gemm(kernels, h_dtype, w_dtype, bf16_dot):
    rng = np.random.default_rng(7)
    h, w = _inputs(rng, h_dtype, w_dtype)
    ctx = RunContext.create(kernels=kernels, dtype="bfloat16").in_phase("decode")
    with choice.record_dispatch("head") as choices:
        logits = jax.jit(lambda h, w: head_linear(h, w, ctx=ctx))(h, w)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 24, 1000)
    assert [c.kernel for c in choices] == (["head_bf16_dot"] if bf16_dot else [None]), choices
    dots = [e for e in jax.make_jaxpr(lambda h, w: head_linear(h, w, ctx=ctx))(h, w).eqns
            if e.primitive.name == "dot_general"]
    assert [str(v.aval.dtype) for v in dots[0].invars] == (["bfloat16"] * 2 if bf16_dot else ["float32"] * 2)
    want = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    # float32 sums of 512 exact products (|logit| ~ 1): within a few float32 roundings of the largest
    err = np.max(np.abs(np.asarray(logits, np.float64) - want)) / np.max(np.abs(want))
    assert err < 2e-6, err
    if not bf16_dot:          # float32 operands: the GEMM as written before the choice existed, bit for bit
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(jnp.einsum(
            "...i,oi->...o", h.astype(jnp.float32), w.astype(jnp.float32), preferred_element_type=jnp.float32)))


HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 256])
def test_gpu_head_at_flash_geometry(rows):
    """The head of Flash (129,280 x 4,096, bf16) on the GPU plan at 1 and 256 bf16 rows: the bf16 dot with float32
    sums, every logit against float64 numpy."""
    rng = np.random.default_rng(rows)
    h, w = _inputs(rng, jnp.bfloat16, jnp.bfloat16, rows=rows, dim=4096, vocab=129280)
    ctx = RunContext.create(kernels="auto", dtype="bfloat16").in_phase("decode")
    logits = np.asarray(jax.jit(lambda h, w: head_linear(h, w, ctx=ctx))(h, w), np.float64)
    want = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    err = np.max(np.abs(logits - want)) / np.max(np.abs(want))
    assert err < 3e-5, err          # a bf16 output or bf16 sums would be ~4e-3


def test_a_quantized_head_keeps_float32_rows():
    """A converted checkpoint's NVFP4 head (tests/test_nvfp4_checkpoint.py): no bf16 dot, float32 rows against its
    dequantized value (float64), as before the choice existed."""
    from dsv4_jax.numerics.formats import Nvfp4Weight, dequantize

    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    packed = jnp.asarray(rng.integers(0, 256, (128, 128), dtype=np.uint8))
    scale = jnp.asarray(rng.uniform(0.5, 4.0, (128, 16)), jnp.float32).astype(jnp.float8_e4m3fn)
    w = Nvfp4Weight(packed, scale, jnp.asarray(0.01, jnp.float32))
    ctx = RunContext.create(kernels="interpret", dtype="bfloat16").in_phase("decode")
    with choice.record_dispatch("head") as choices:
        logits = head_linear(h, w, ctx=ctx)
    assert [c.kernel for c in choices] == [None], choices
    want = np.asarray(h, np.float64) @ np.asarray(dequantize(w, jnp.float32), np.float64).T
    err = np.max(np.abs(np.asarray(logits, np.float64) - want)) / np.max(np.abs(want))
    assert logits.dtype == jnp.float32 and err < 2e-6, err
