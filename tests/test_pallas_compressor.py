"""The compressor's decode kernel (dsv4_jax/pallas_kernels/compressor.py), fed one token per step through
ops/compressor_step.py `compressor_update` in Pallas interpret mode: against float64 numpy (tests/reference_np.py
`compressor_entries`, the whole sequence at once) and against the jnp path it replaces (same inputs, same state).

The kernel sums the softmax and the RMS in another order than XLA, so float32 entries agree with the jnp path to
float32 rounding, not bit for bit; the pending state it writes is exact (no arithmetic: placed, masked, shifted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import presets
from dsv4_jax.numerics.kv_cache import PlainEntries
from dsv4_jax.ops import compressor_step as C
from dsv4_jax.ops.norm_rope import rope_inv_freq
from dsv4_jax.pallas_kernels import compressor as kernel
from dsv4_jax.run_context import RunContext

import reference_np as R

POISON = 1.0e4          # cache entries no step may write


def _params(rng, ratio: int, head_dim: int, dim: int) -> dict:
    width = C.overlap_factor(ratio) * head_dim
    return {"wkv": {"weight": (rng.standard_normal((width, dim)) * dim ** -0.5).astype(np.float32)},
            "wgate": {"weight": (rng.standard_normal((width, dim)) * dim ** -0.5).astype(np.float32)},
            "ape": rng.standard_normal((ratio, width)).astype(np.float32),
            "norm": {"weight": (1.0 + 0.3 * rng.standard_normal(head_dim)).astype(np.float32)}}


def _decode(kernels: str, dtype: str, cfg, params, xs, live, ratio, head_dim, rotate, simulate_quant, n_entries):
    """Feed xs [B, T, D] one token per step (row b takes token t where live[b, t]; other steps pass it with
    n_valid 0 and a junk token). Returns (cache [B, n_entries, hd] float32, final state, tokens fed per row)."""
    ctx = RunContext.create(kernels=kernels, dtype=dtype, simulate_quant=simulate_quant).in_phase("decode")
    batch, steps, _ = xs.shape
    inv_freq = rope_inv_freq(cfg, ratio)
    step = jax.jit(lambda p, x, s, n, st, ca: C.compressor_update(
        p, x, s, n, st, ca, ratio=ratio, head_dim=head_dim, nope_dim=head_dim - cfg.rope_head_dim,
        inv_freq=inv_freq, rotate=rotate, ctx=ctx, norm_eps=cfg.norm_eps))
    # the cache stored plainly in the activation dtype (numerics/kv_cache.py PlainEntries)
    state = C.init_compressor_state(batch, ratio, head_dim)
    if ratio == 4:          # slots of positions -4..-1 (window -1): whatever they hold must never be pooled
        garbage = np.random.default_rng(98).standard_normal(state.kv[:, :ratio].shape).astype(np.float32)
        state = jax.tree.map(lambda buf: buf.at[:, :ratio].set(garbage), state)
    cache = PlainEntries(jnp.full((batch, n_entries, head_dim), POISON, ctx.jnp_dtype))
    start = np.zeros(batch, np.int32)
    junk = np.random.default_rng(99).standard_normal(xs.shape).astype(np.float32)
    for t in range(steps):
        x = np.where(live[:, t, None], xs[:, t], junk[:, t])[:, None, :]
        n_valid = live[:, t].astype(np.int32)
        cache, state = step(params, jnp.asarray(x, ctx.jnp_dtype), jnp.asarray(start), jnp.asarray(n_valid), state,
                            cache)
        start = start + n_valid
    return np.asarray(cache.values.astype(jnp.float32)), jax.tree.map(np.asarray, state), start


def _case(seed: int, ratio: int, head_dim: int, steps: int, preset: str = "tiny"):
    rng = np.random.default_rng(seed)
    cfg = presets.named(preset)         # its rope dims (tiny 32, Flash 64) and norm eps
    dim = 96
    params = _params(rng, ratio, head_dim, dim)
    xs = rng.standard_normal((2, steps, dim)).astype(np.float32)
    live = np.ones((2, steps), bool)
    live[1, rng.choice(steps, steps // 4, replace=False)] = False      # row 1 pauses: n_valid 0 on those steps
    return cfg, params, xs, live


@pytest.mark.parametrize("ratio, head_dim, rotate", [(4, 96, False), (4, 64, True), (8, 96, False),
                                                     (16, 64, False)])
def test_decode_entries_match_float64(ratio, head_dim, rotate):
    """Float32, no fake quant: every entry a row completes, token by token on the kernel, equals the float64
    entries of the row's tokens pooled at once; entries no token completed stay poisoned."""
    steps = 3 * ratio + 3
    cfg, params, xs, live = _case(ratio + head_dim, ratio, head_dim, steps)
    n_entries = steps // ratio + 2
    cache, _, fed = _decode("interpret", "float32", cfg, params, xs, live, ratio, head_dim, rotate, False, n_entries)
    assert np.all(fed // ratio >= 2)
    _assert_entries_match_float64(cache, fed, cfg, params, xs, live, ratio, head_dim, rotate)


def _assert_entries_match_float64(cache, fed, cfg, params, xs, live, ratio, head_dim, rotate):
    """Each row's completed entries (float32, no fake quant) against the float64 entries of the tokens it took,
    pooled at once; the entries past them still poisoned."""
    for b in range(len(xs)):
        want = R.compressor_entries(xs[b][live[b]].astype(np.float64),
                                    {"wkv.weight": params["wkv"]["weight"], "wgate.weight": params["wgate"]["weight"],
                                     "ape": params["ape"], "norm.weight": params["norm"]["weight"]},
                                    ratio, head_dim, rotate, cfg, R.rope_freqs(cfg, ratio), simulate_quant=False)
        done = fed[b] // ratio
        assert done == want.shape[0]
        err = np.max(np.abs(cache[b, :done] - want)) / np.max(np.abs(want))
        assert err < 2e-6, f"row {b}: max error {err:.2e} of the largest entry value"
        assert np.all(cache[b, done:] == POISON), f"row {b}: an entry past the completed ones was written"


@pytest.mark.parametrize("preset, ratio, head_dim, rotate, dtype", [
    ("tiny", 4, 96, False, "bfloat16"), ("tiny", 4, 64, True, "bfloat16"), ("tiny", 8, 96, False, "float32"),
    ("flash", 4, 128, False, "bfloat16"), ("flash", 4, 128, True, "bfloat16"), ("flash", 16, 128, False, "float32"),
    ("flash", 4, 128, True, "float32")])
def test_decode_kernel_equals_the_jnp_path(preset, ratio, head_dim, rotate, dtype):
    """With the model's fake quant (FP8 nope dims, or Hadamard + FP4 for the indexer flavour): the kernel plan's
    pending state equals the jnp path's bit for bit, and the cache agrees to float32 rounding but for the rare
    element a last-bit difference before a rounding moved to the neighbouring grid point (one FP8 / FP4 step).
    With 64 rope dims (Flash) the kernel also does the fake quant and the cache write; with tiny's 32 (not an FP8
    block) XLA does them after the kernel."""
    _check_equals_the_jnp_path("interpret", preset, ratio, head_dim, rotate, dtype)


def _check_equals_the_jnp_path(kernels, preset, ratio, head_dim, rotate, dtype):
    steps = 2 * ratio + 5
    cfg, params, xs, live = _case(7 * ratio, ratio, head_dim, steps, preset)
    outs = [_decode(kernels, dtype, cfg, params, xs, live, ratio, head_dim, rotate, True, steps // ratio + 1)]
    # the jnp path on the CPU: XLA:GPU may skip its bf16 roundings (excess precision), the CPU keeps them
    with jax.default_device(jax.devices("cpu")[0]):
        outs.append(_decode("reference", dtype, cfg, params, xs, live, ratio, head_dim, rotate, True,
                            steps // ratio + 1))
    (cache, state, fed), (want_cache, want_state, want_fed) = outs
    np.testing.assert_array_equal(fed, want_fed)
    for name in ("kv", "score"):
        np.testing.assert_array_equal(getattr(state, name), getattr(want_state, name), err_msg=name)
    written = want_cache != POISON
    flipped = np.abs(cache - want_cache) > 1e-5 * np.max(np.abs(want_cache[written]))  # more than float32 rounding
    assert flipped.mean() < 0.01, f"{flipped.mean():.2%} of the cache differs by more than rounding"
    # at most one step of the grid: FP8 2^-3 of the value; FP4 2 x its block's scale (< amax / 3), bounded here
    # by the row's largest value; the rows no entry reached (poisoned) must agree exactly
    row_max = np.max(np.abs(np.where(written, want_cache, 0.0)), axis=-1, keepdims=True)
    # FP8: 2^-3 of the value, or the subnormal spacing 2^-9 of the block's scale (<= 2 amax / 448) near zero
    step = row_max * 2 / 3 if rotate else 2.0 ** -3 * np.abs(want_cache) + 2.0 ** -9 * 2 * row_max / 448
    assert np.all(np.abs(cache - want_cache) <= step + 1e-6)
    np.testing.assert_array_equal(cache == POISON, want_cache == POISON)


def test_unsupported_geometry_is_refused():
    state = C.init_compressor_state(1, 4, 80)
    with pytest.raises(ValueError, match="head_dim a multiple of rope_dim"):
        kernel.decode_pool(state.kv, state.score, jnp.zeros((1, 160)), jnp.zeros((1, 160)), jnp.zeros((4, 160)),
                           jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), jnp.ones(80), np.ones(16, np.float32),
                           ratio=4, norm_eps=1e-6, out_dtype=jnp.float32)
    assert not kernel.supported(3, 96, 32) and not kernel.supported(256, 512, 64) and kernel.supported(128, 512, 64)


@pytest.mark.parametrize("ratio, head_dim, quant", [(4, 512, "fp8"), (4, 128, "fp4"), (128, 512, "fp8"),
                                                    (4, 512, None)])
def test_cuda_lowering_at_flash_geometry(ratio, head_dim, quant):
    """Pallas -> Triton IR for an H200 without a GPU, at Flash's three compressors (main and indexer of a CSA
    layer, an HCA layer's) with their fake quant and the cache write of a 1M-token context's buffer, and without
    (the entry returned): two kernels, the state (and the cache) aliased to their inputs (updated in place)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    width = C.overlap_factor(ratio) * head_dim
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    i32 = jax.ShapeDtypeStruct((2,), jnp.int32)
    cache = None if quant is None else jax.ShapeDtypeStruct((2, (1 << 20) // ratio, head_dim), jnp.bfloat16)
    fn = jax.jit(lambda skv, ssc, kv, sc, ape, s, n, w, cache: kernel.decode_pool(
        skv, ssc, kv, sc, ape, s, n, w, np.ones(32, np.float32), ratio=ratio, norm_eps=1e-6, out_dtype=jnp.bfloat16,
        cache=cache, quant=quant), donate_argnums=(0, 1, 8))
    state = f32(2, C.overlap_factor(ratio) * ratio, width)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        text = fn.trace(state, state, f32(2, width), f32(2, width), f32(ratio, width), i32, i32, f32(head_dim),
                        cache).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2            # the pooling over column chunks, then the finish
    assert text.count("output_operand_aliases") == (1 if cache is None else 2)


# ---- on the GPU -----------------------------------------------------------------------------------------------
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("ratio, head_dim", [(4, 512), (4, 128), (128, 512)])
def test_gpu_decode_entries_match_float64(ratio, head_dim):
    """The compiled Triton kernel at Flash's compressor geometries (a kernel plan on the GPU), float32, token by
    token against float64; the state against the jnp path (the reference plan on the GPU) bit for bit."""
    cfg = presets.flash()
    steps = 2 * ratio + 3
    rng = np.random.default_rng(181)
    params = _params(rng, ratio, head_dim, 256)
    xs = rng.standard_normal((2, steps, 256)).astype(np.float32)
    live = np.ones((2, steps), bool)
    live[1, rng.choice(steps, steps // 4, replace=False)] = False
    n_entries = steps // ratio + 2
    cache, state, fed = _decode("pallas", "float32", cfg, params, xs, live, ratio, head_dim, False, False, n_entries)
    _, want_state, _ = _decode("reference", "float32", cfg, params, xs, live, ratio, head_dim, False, False,
                               n_entries)
    for name in ("kv", "score"):
        np.testing.assert_array_equal(getattr(state, name), getattr(want_state, name), err_msg=name)
    _assert_entries_match_float64(cache, fed, cfg, params, xs, live, ratio, head_dim, False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("ratio, head_dim, rotate", [(4, 512, False), (4, 128, True), (128, 512, False)])
def test_gpu_fake_quant_and_cache_write_equal_the_jnp_path(ratio, head_dim, rotate):
    """The compiled kernel with the model's fake quant and the cache write (Flash geometry, bf16) against the jnp
    path on the GPU, as test_decode_kernel_equals_the_jnp_path checks it in interpret mode."""
    _check_equals_the_jnp_path("pallas", "flash", ratio, head_dim, rotate, "bfloat16")
