"""The decode rows' RMSNorm kernel (dsv4_jax/pallas_kernels/norm_rope.py), with RoPE and the FP8 fake quant, in Pallas
interpret mode: against float64 numpy (tests/reference_np.py) and against the jnp path it replaces (ops/norm_rope.py
`rms_norm`, ops/norm_rope.py `apply_rope`, numerics/fake_quant.py `fp8_fake_quant`), and the attention layer on a kernel
plan against the reference plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import presets
from dsv4_jax.ops.norm_rope import rms_norm
from dsv4_jax.ops.norm_rope import apply_rope, rope_inv_freq
from dsv4_jax.pallas_kernels import norm_rope
from dsv4_jax.numerics.fake_quant import fp8_fake_quant

import reference_np as R


def _inputs(rng, rows, dim):
    x = (rng.standard_normal((rows, 1, dim)) * rng.uniform(0.1, 10.0, (rows, 1, 1))).astype(np.float32)
    weight = (1.0 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
    positions = rng.integers(0, 1 << 20, (rows, 1)).astype(np.int32)
    return x, weight, positions


def _float64_rows(x, weight, rope):
    """float64 rms_norm (+ RoPE with rope = (positions, inv_freq)) of rows x [rows, 1, D], at the float32 angles the
    model forms (position * f rounded), in float64 after that."""
    want = R.rms_norm(x.astype(np.float64), weight.astype(np.float64), 1e-6)
    if rope is None:
        return want
    angles = (np.asarray(rope[0]).astype(np.float32) * rope[1][None, :]).astype(np.float64)       # [rows, R/2]
    return np.stack([R.apply_rope(want[r], 1.0, angles[r]) for r in range(len(want))])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_matches_float64(dtype, inverse):
    """The jnp RoPE on queries [B, S, heads, 512] with one position per token (broadcast over the heads): the
    leading 448 dims exactly x (-0.0 and 1e30 included), each rotated pair against float64 at the float32 angle,
    within float32 arithmetic and one rounding to dtype; the inverse undoes it."""
    rng = np.random.default_rng(5)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    x = rng.standard_normal((2, 9, 3, 512)) * rng.uniform(0.1, 10.0, (2, 9, 3, 1))
    x[0, 0, 0, :4] = [-0.0, 1e30, -1e30, 0.0]
    x = jnp.asarray(x, dtype)
    positions = rng.integers(0, 1 << 20, (2, 9)).astype(np.int32)
    got = np.asarray(apply_rope(x, jnp.asarray(positions)[..., None], inv_freq, inverse).astype(jnp.float32))
    x32 = np.asarray(x.astype(jnp.float32))
    np.testing.assert_array_equal(got[..., :448].view(np.uint32), x32[..., :448].view(np.uint32))
    angles = (positions.astype(np.float32)[..., None] * inv_freq).astype(np.float64)           # [2, 9, 32]
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None] * (-1 if inverse else 1)
    even, odd = x32[..., 448::2].astype(np.float64), x32[..., 449::2].astype(np.float64)
    want = np.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(even.shape[:-1] + (64,))
    # float32 arithmetic (XLA's cos and sin within a few ulps, two products, a sum) bounded by the terms' size,
    # then one rounding to dtype
    terms = np.repeat(np.abs(even) + np.abs(odd), 2, axis=-1)
    rounding = 2.0 ** -8 if dtype == jnp.bfloat16 else 2.0 ** -24
    assert np.all(np.abs(got[..., 448:] - want) <= rounding * np.abs(want) + 2.0 ** -20 * terms)
    back = apply_rope(apply_rope(x.astype(jnp.float32), jnp.asarray(positions)[..., None], inv_freq, inverse),
                      jnp.asarray(positions)[..., None], inv_freq, not inverse)
    np.testing.assert_allclose(np.asarray(back)[..., 448:], x32[..., 448:], rtol=1e-5, atol=1e-5 * np.abs(x32).max())


@pytest.mark.parametrize("dim, rope_dim", [(1024, None), (1536, None), (512, 64), (96, 32)])
def test_float32_rows_match_float64(dim, rope_dim):
    """Float32: the norm (and RoPE at each row's position) against float64, every row checked; positions up to 1M,
    as long contexts rotate (the angle position * f is formed in float32, as the model forms it)."""
    rng = np.random.default_rng(dim)
    x, weight, positions = _inputs(rng, 5, dim)
    rope = None if rope_dim is None else (positions, rope_inv_freq(presets.named("flash"), 4)[:rope_dim // 2])
    got = np.asarray(norm_rope.rms_norm_rows(jnp.asarray(x), jnp.asarray(weight), eps=1e-6, in_dtype=jnp.float32,
                                             rope=rope, interpret=True), np.float64)
    want = _float64_rows(x, weight, rope)
    err = np.max(np.abs(got - want), axis=-1) / np.max(np.abs(want), axis=-1)
    assert np.all(err < 3e-6), err


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_keys_equal_the_jnp_path(dtype):
    """Flash's keys: float32 matmul output -> rounded to dtype -> rms_norm -> RoPE -> FP8 fake quant of the nope
    dims, against the jnp path on the same rounded input. bf16: equal bit for bit but for a rare element where a
    last-bit difference of the norm's sum moved a rounding (one bf16 / FP8 step); float32: to rounding."""
    rng = np.random.default_rng(5)
    x, weight, positions = _inputs(rng, 16, 512)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    got = norm_rope.rms_norm_rows(jnp.asarray(x), jnp.asarray(weight), eps=1e-6, in_dtype=dtype,
                                  rope=(jnp.asarray(positions), inv_freq), fp8_nope=True, interpret=True)
    want = apply_rope(rms_norm(jnp.asarray(x).astype(dtype), jnp.asarray(weight), 1e-6), jnp.asarray(positions),
                      inv_freq)
    want = jnp.concatenate([fp8_fake_quant(want[..., :448]), want[..., 448:]], axis=-1)
    assert got.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    moved = np.abs(got - want) > 1e-6 * np.max(np.abs(want))
    assert moved.mean() < 0.002, f"{moved.mean():.2%} of the elements differ by more than float32 rounding"
    assert np.all(np.abs(got - want) <= 2.0 ** -3 * np.abs(want) + 1e-6)
    # the nope dims are on the FP8 grid: each 64-block's values are multiples of its power-of-two step
    blocks = got[..., :448].reshape(16, 7, 64)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.max(np.abs(blocks), axis=-1, keepdims=True), 1e-4) / 448))
    assert np.all(np.abs(blocks / scale) <= 448)


def test_keys_written_into_the_window_ring_in_place():
    """ring=(ring, n_valid): each sequence's key also lands in ring slot position mod W (positions past the window
    wrap), where n_valid > 0; every other slot, and a row without a token, keeps its value bit for bit."""
    rng = np.random.default_rng(6)
    x, weight, _ = _inputs(rng, 3, 512)
    positions = np.asarray([[5], [300], [77]], np.int32)            # slots 5, 300 mod 128 = 44, 77
    n_valid = jnp.asarray([1, 1, 0], jnp.int32)
    ring = rng.standard_normal((3, 128, 512)).astype(np.float32)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    run = lambda **kw: norm_rope.rms_norm_rows(jnp.asarray(x), jnp.asarray(weight), eps=1e-6,  # noqa: E731
                                               in_dtype=jnp.float32, rope=(jnp.asarray(positions), inv_freq),
                                               fp8_nope=True, interpret=True, **kw)
    keys, new_ring = run(ring=(jnp.asarray(ring), n_valid))
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(run()))
    want = ring.copy()
    want[0, 5], want[1, 44] = np.asarray(keys)[0, 0], np.asarray(keys)[1, 0]
    np.testing.assert_array_equal(np.asarray(new_ring), want)


def test_cuda_lowering_of_the_keys_with_the_ring_write():
    """Pallas -> Triton IR for an H200 without a GPU at Flash's keys (wq_a + wkv's joined float32 output, the ring of
    a batch of 4): one Triton kernel, the ring aliased to its input (written in place)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    sds = jax.ShapeDtypeStruct
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    fn = jax.jit(lambda x, w, pos, ring, n: norm_rope.rms_norm_rows(
        x, w, eps=1e-6, in_dtype=jnp.bfloat16, rope=(pos, inv_freq), fp8_nope=True, columns=(1024, 512),
        ring=(ring, n)), donate_argnums=(3,))
    args = (sds((4, 1, 1536), jnp.float32), sds((512,), jnp.bfloat16), sds((4, 1), jnp.int32),
            sds((4, 128, 512), jnp.bfloat16), sds((4,), jnp.int32))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and text.count("output_operand_aliases") == 1


def test_unsupported_widths_are_refused():
    with pytest.raises(ValueError, match="rope_dim a power of two"):
        norm_rope.rms_norm_rows(jnp.ones((2, 100)), None, eps=1e-6, in_dtype=jnp.float32,
                                rope=(jnp.zeros(2, jnp.int32), np.ones(24, np.float32)))
    assert not norm_rope.supported(512, 32, fp8_nope=True) and norm_rope.supported(512, 64, fp8_nope=True)


def test_attention_on_a_kernel_plan_equals_the_reference_plan():
    """A decode step of the tiny model's CSA and HCA layers: with the norm kernel (the "interpret" plan; the decode
    attention and compressor kernels too) the same output and cache as the reference plan, in float32."""
    from dsv4_jax.layers.attention import attention
    from dsv4_jax.params import init_params
    from dsv4_jax.run_context import RunContext
    from dsv4_jax.layers.chunk import Chunk
    from dsv4_jax.state import init_state

    cfg = presets.named("tiny")
    params = init_params(cfg, jax.random.PRNGKey(1))
    state = init_state(cfg, 2, 64, jnp.float32)
    rng = np.random.default_rng(2)
    start = jnp.asarray([9, 30], jnp.int32)
    x = jnp.asarray(rng.standard_normal((2, 1, cfg.dim)), jnp.float32)
    for layer in (1, 2):
        ratio = cfg.compress_ratios[layer]
        # filled caches and pending states (the same random values for both plans)
        cache = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), state.layers[layer])
        outs = []
        for kernels in ("interpret", "reference"):
            ctx = RunContext.create(kernels=kernels, dtype="float32").in_phase("decode")
            chunk = Chunk(jnp.zeros((2, 1), jnp.int32), start, jnp.ones(2, jnp.int32))
            outs.append(jax.jit(lambda p, x, c, ctx=ctx, chunk=chunk: attention(
                p, cfg, ratio, x, chunk, c, rope_inv_freq(cfg, ratio), ctx)[:2])(params["layers"][layer]["attn"], x,
                                                                                 cache))
        (y, c1), (want_y, c2) = outs
        np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-4, atol=1e-5)
        for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-4, atol=1e-5)


def test_columns_of_a_joined_output_read_in_place():
    """`columns` normalises one part of two matmul outputs written side by side, exactly as that part alone."""
    rng = np.random.default_rng(8)
    joined = jnp.asarray(rng.standard_normal((3, 1, 1024 + 512)), jnp.float32)
    wq, wkv = (jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32) for d in (1024, 512))
    rope = (jnp.asarray([[3], [70000], [9]], jnp.int32), rope_inv_freq(presets.named("flash"), 4))
    run = lambda x, w, **kw: np.asarray(norm_rope.rms_norm_rows(x, w, eps=1e-6, in_dtype=jnp.bfloat16,  # noqa: E731
                                                                interpret=True, **kw), np.float32)
    np.testing.assert_array_equal(run(joined, wq, columns=(0, 1024)), run(joined[..., :1024], wq))
    np.testing.assert_array_equal(run(joined, wkv, columns=(1024, 512), rope=rope, fp8_nope=True),
                                  run(joined[..., 1024:], wkv, rope=rope, fp8_nope=True))
    with pytest.raises(ValueError, match="outside"):
        run(joined, wkv, columns=(1100, 512))


def test_heads_share_their_tokens_position():
    """Per-head query rows [B, S, H, hd] with positions [B, S, 1]: each head rotated at its token's position,
    exactly as with the positions broadcast to every head."""
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((2, 3, 16, 128)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 100000, (2, 3)), jnp.int32)
    inv_freq = rope_inv_freq(presets.named("flash"), 0)[:16]
    run = lambda pos: np.asarray(norm_rope.rms_norm_rows(q, None, eps=1e-6, in_dtype=jnp.bfloat16,  # noqa: E731
                                                         rope=(pos, inv_freq), interpret=True), np.float32)
    want = run(jnp.broadcast_to(positions[:, :, None], (2, 3, 16)))
    np.testing.assert_array_equal(run(positions[:, :, None]), want)
    np.testing.assert_array_equal(run(positions), want)
    ref = apply_rope(rms_norm(q.astype(jnp.bfloat16), None, 1e-6), positions[:, :, None], inv_freq)
    assert np.mean(want != np.asarray(ref, np.float32)) < 0.002
    with pytest.raises(ValueError, match="leading dims"):
        run(positions[:, :2])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_indexer_queries_equal_the_jnp_path(dtype):
    """The indexer's queries (no norm): RoPE, then the normalised Hadamard transform and FP4 of each head's 128
    values, against the jnp path (apply_rope, fake_quant.hadamard, fp4_fake_quant) on the same rounded input: equal
    but for rare elements a last-bit difference of the transform's sums moved by one FP4 step."""
    from dsv4_jax.numerics.fake_quant import fp4_fake_quant, hadamard

    rng = np.random.default_rng(10)
    q = jnp.asarray(rng.standard_normal((2, 1, 64, 128)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 1 << 20, (2, 1)), jnp.int32)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    got = norm_rope.rms_norm_rows(q, None, eps=None, in_dtype=dtype, rope=(positions, inv_freq), hadamard_fp4=True,
                                  interpret=True)
    want = fp4_fake_quant(hadamard(apply_rope(q.astype(dtype), positions[:, :, None], inv_freq)))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    moved = got != want
    assert moved.mean() < 0.01, f"{moved.mean():.2%} of the elements differ"
    block_max = np.repeat(np.max(np.abs(want.reshape(2, 1, 64, 4, 32)), axis=-1), 32, axis=-1).reshape(want.shape)
    assert np.all(np.abs(got - want) <= block_max / 3 + 1e-6)          # one FP4 step: 2 x scale <= 2 amax / 6
    blocks = got.reshape(-1, 32)                 # every value on the e2m1 grid of its block's power-of-two scale
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.max(np.abs(blocks), axis=-1, keepdims=True), 1e-30) / 6))
    assert np.all(np.isin(np.abs(blocks / scale), [0, 0.5, 1, 1.5, 2, 3, 4, 6]))


@pytest.mark.parametrize("per", [2, 8, 16])
def test_several_rows_a_program_equal_one_row_a_program(per):
    """Per-head queries [B, 1, 16 heads, 512] (positions shared by a token's heads) and keys [32, 1, 512] with their
    own positions, weight and FP8 nope dims, `per` rows to a program: bit for bit what one row a program gives
    (the same arithmetic row by row), and the queries within float32 rounding of float64."""
    rng = np.random.default_rng(per)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    q = rng.standard_normal((4, 1, 16, 512)) * rng.uniform(0.1, 10.0, (4, 1, 16, 1))
    q = jnp.asarray(q, jnp.float32)
    positions = jnp.asarray(rng.integers(0, 1 << 20, (4, 1)), jnp.int32)
    queries = lambda n: np.asarray(norm_rope.rms_norm_rows(  # noqa: E731
        q, None, eps=1e-6, in_dtype=jnp.float32, rope=(positions, inv_freq), rows_per_program=n, interpret=True))
    got = queries(per)
    np.testing.assert_array_equal(got, queries(1))
    want = _float64_rows(np.asarray(q).reshape(64, 1, 512), np.ones(512),
                         (np.repeat(np.asarray(positions), 16, axis=0), inv_freq))
    err = np.max(np.abs(got.reshape(64, 512) - want.reshape(64, 512)), axis=-1) / np.max(np.abs(want), axis=(-2, -1))
    assert np.all(err < 3e-6), err
    x, weight, key_positions = _inputs(rng, 32, 512)
    keys = lambda n: np.asarray(norm_rope.rms_norm_rows(  # noqa: E731
        jnp.asarray(x), jnp.asarray(weight), eps=1e-6, in_dtype=jnp.bfloat16, rope=(jnp.asarray(key_positions),
        inv_freq), fp8_nope=True, rows_per_program=n, interpret=True), np.float32)
    np.testing.assert_array_equal(keys(per), keys(1))


def test_rows_per_program_by_default_and_refused():
    """Rows stacked up to 2,048 values a program, within the rows that share a position; a count that does not
    divide them is refused."""
    assert norm_rope.default_rows_per_program(64, 64, 512) == 4               # batch 1's per-head queries
    assert norm_rope.default_rows_per_program(256 * 64, 64, 512) == 4
    assert norm_rope.default_rows_per_program(256, 1, 512) == 4               # batch 256's keys
    assert norm_rope.default_rows_per_program(256, 1, 1024) == 2              # the query latent
    assert norm_rope.default_rows_per_program(256, 1, 1536) == 1              # Pro's
    assert norm_rope.default_rows_per_program(1, 1, 512) == 1                 # batch 1's keys
    assert norm_rope.default_rows_per_program(6, 1, 128) == 2                 # what divides the rows
    assert norm_rope.default_rows_per_program(256 * 2, 2, 128) == 2           # stays within a token's 2 heads
    x = jnp.ones((6, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match="rows_per_program=4"):
        norm_rope.rms_norm_rows(x, None, eps=1e-6, in_dtype=jnp.float32, rows_per_program=4, interpret=True)
    with pytest.raises(ValueError, match="rows_per_program=2"):
        norm_rope.rms_norm_rows(x.reshape(2, 3, 128), None, eps=1e-6, in_dtype=jnp.float32,
                                rope=(jnp.zeros((2,), jnp.int32), np.ones(32, np.float32)), rows_per_program=2,
                                interpret=True)


# ---- on the GPU -----------------------------------------------------------------------------------------------
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dim, rope_dim", [(1024, None), (1536, None), (512, 64)])
def test_gpu_rows_match_float64(dim, rope_dim):
    """The compiled Triton kernel at Flash's and Pro's widths (the query latent 1,024 / 1,536, the keys 512 with
    RoPE), float32 against float64 as test_float32_rows_match_float64 checks it in interpret mode."""
    rng = np.random.default_rng(247)
    x, weight, positions = _inputs(rng, 8, dim)
    rope = None if rope_dim is None else (positions, rope_inv_freq(presets.named("flash"), 4))
    got = np.asarray(jax.jit(lambda x, w, p: norm_rope.rms_norm_rows(
        x, w, eps=1e-6, in_dtype=jnp.float32, rope=None if rope is None else (p, rope[1])))(x, weight, positions),
        np.float64)
    want = _float64_rows(x, weight, rope)
    err = np.max(np.abs(got - want), axis=-1) / np.max(np.abs(want), axis=-1)
    assert np.all(err < 3e-6), err


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gpu_keys_and_indexer_queries_equal_the_jnp_path():
    """The compiled kernel's keys (norm, RoPE, FP8) and indexer queries (RoPE, Hadamard, FP4) in bf16 against the
    jnp path on the GPU: equal but for rare elements moved by one FP8 / FP4 step."""
    from dsv4_jax.numerics.fake_quant import fp4_fake_quant, hadamard

    rng = np.random.default_rng(265)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    x, weight, positions = (jnp.asarray(a) for a in _inputs(rng, 16, 512))
    keys = jax.jit(lambda x, w, p: norm_rope.rms_norm_rows(x, w, eps=1e-6, in_dtype=jnp.bfloat16,
                                                           rope=(p, inv_freq), fp8_nope=True))(x, weight, positions)
    q = jnp.asarray(rng.standard_normal((4, 1, 64, 128)), jnp.float32)
    qpos = positions[:4]
    iq = jax.jit(lambda q, p: norm_rope.rms_norm_rows(q, None, eps=None, in_dtype=jnp.bfloat16, rope=(p, inv_freq),
                                                      hadamard_fp4=True))(q, qpos)
    cpu = jax.devices("cpu")[0]      # the jnp path on the CPU: XLA:GPU may skip its bf16 roundings (excess precision)
    want = jax.jit(lambda x, w, p: (lambda k: jnp.concatenate([fp8_fake_quant(k[..., :448]), k[..., 448:]], -1))(
        apply_rope(rms_norm(x.astype(jnp.bfloat16), w, 1e-6), p, inv_freq)))(*jax.device_put((x, weight, positions),
                                                                                                cpu))
    want_iq = jax.jit(lambda q, p: fp4_fake_quant(hadamard(apply_rope(q.astype(jnp.bfloat16), p[:, :, None],
                                                                      inv_freq))))(*jax.device_put((q, qpos), cpu))
    for got, ref in ((keys, want), (iq, want_iq)):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert np.mean(got != ref) < 0.01
        assert np.all(np.abs(got - ref) <= np.max(np.abs(ref), axis=-1, keepdims=True) / 3 + 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gpu_ring_write_in_place():
    """The compiled kernel with the ring write, batch 4 (one row without a token), ring donated: the keys equal the
    kernel's without the write, the ring holds them at their slots and is otherwise unchanged, bit for bit."""
    rng = np.random.default_rng(12)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    x, weight, _ = (jnp.asarray(a) for a in _inputs(rng, 4, 512))
    positions = jnp.asarray([[0], [127], [128], [4095]], jnp.int32)
    ring = rng.standard_normal((4, 128, 512)).astype(np.float32)
    n_valid = jnp.asarray([1, 1, 0, 1], jnp.int32)
    keys_alone = jax.jit(lambda x, w, p: norm_rope.rms_norm_rows(x, w, eps=1e-6, in_dtype=jnp.bfloat16,
                                                                 rope=(p, inv_freq), fp8_nope=True))(x, weight,
                                                                                                     positions)
    keys, new_ring = jax.jit(lambda x, w, p, r, n: norm_rope.rms_norm_rows(
        x, w, eps=1e-6, in_dtype=jnp.bfloat16, rope=(p, inv_freq), fp8_nope=True, ring=(r, n)), donate_argnums=(3,))(
            x, weight, positions, jnp.asarray(ring, jnp.bfloat16), n_valid)
    np.testing.assert_array_equal(np.asarray(keys, np.float32), np.asarray(keys_alone, np.float32))
    want = np.asarray(jnp.asarray(ring, jnp.bfloat16), np.float32)
    for row, slot in ((0, 0), (1, 127), (3, 4095 % 128)):
        want[row, slot] = np.asarray(keys, np.float32)[row, 0]
    np.testing.assert_array_equal(np.asarray(new_ring, np.float32), want)
