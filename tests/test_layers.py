"""Per-module tests: each dsv4_jax layer function (float32) against the float64 numpy reference written from the
spec (tests/reference_np.py), on fresh random inputs and the weights of one synthetic tiny checkpoint.

Tolerances are stated in every assert message. Float32 vs float64 gives ~1e-6 relative error per op; RoPE angles
are computed in float32, so an angle p*f carries an absolute error of about ulp(p*f)/2 (~1.5e-5 at p*f ~ 300),
which dominates most bounds below. Fake-quant sites (FP8 e4m3 / FP4 e2m1 roundings) are discontinuous: a ~1e-7
input difference that lands on a rounding tie flips one element by one quantum, so quantized comparisons allow a
tiny fraction of elements to differ by at most one quantum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ckpt_writer as cw
import reference_np as R
import dsv4_jax
from dsv4_jax import presets
from dsv4_jax.ops import attention_core, indexer
from dsv4_jax.layers.attention import attention
from dsv4_jax.layers.chunk import Chunk
from dsv4_jax.numerics.kv_cache import PlainEntries
from dsv4_jax.ops.compressor_step import compressor_update, init_compressor_state
from dsv4_jax.layers.hyper import hc_head
from dsv4_jax.ops.mhc_site import hc_post, hc_pre, sinkhorn
from dsv4_jax.ops.moe_ffn import clamped_swiglu, moe, route
from dsv4_jax.ops.norm_rope import apply_rope, rope_inv_freq
from dsv4_jax.numerics.fake_quant import fp4_fake_quant, fp8_fake_quant, hadamard, round_to_e2m1
from dsv4_jax.run_context import RunContext
from dsv4_jax.state import init_layer_cache
from shared_decisions import DecisionRecorder, ModelDecisions

SEQ = 260          # > 2 * 128: crosses the window and completes two HCA entries (t = 127, 255)
BATCH = 2
CSA, HCA, SWA = 1, 2, 0    # tiny model layers: 0 window only (hash), 1 CSA (hash), 2 HCA, 3 CSA


# ---------------------------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(cfg, jax params, logical float64 weights by official name) of one synthetic tiny checkpoint."""
    cfg = presets.tiny()
    directory = str(tmp_path_factory.mktemp("tiny_ckpt"))
    weights = cw.write_checkpoint(directory, cfg, seed=1234)
    model = dsv4_jax.load(directory, dtype="float32", simulate_quant=False)
    assert model.config == cfg
    return cfg, model.params, weights


@pytest.fixture(scope="module")
def xseq():
    """A fresh random attn_norm'd-like input [B, SEQ, D] (float32 values, shared exactly with float64)."""
    rng = np.random.default_rng(20240601)
    return rng.standard_normal((BATCH, SEQ, presets.tiny().dim)).astype(np.float32)


def assert_close(got, want, atol, rtol, what):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    same = got == want                                   # also equal infinities
    err = np.where(same, 0.0, np.abs(got - np.where(same, 0.0, want)))
    bound = atol + rtol * np.abs(want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {err.size} elements exceed atol={atol:g} rtol={rtol:g}; "
                             f"max |err| {np.nanmax(err):.3g}; worst at {i}: got {got[i]!r} want {want[i]!r}")


def assert_close_quantized(got, want, atol, quantum, max_frac, what):
    """Elements within `atol`, except at most a fraction `max_frac` that may be off by one rounding quantum
    (`quantum`: an array broadcastable to want bounding one FP8/FP4 step there)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    off = err > atol
    frac = off.mean()
    assert frac <= max_frac, (f"{what}: {off.sum()} of {err.size} elements ({frac:.2e}) exceed atol={atol:g}, "
                              f"allowed fraction {max_frac:g} (fake-quant tie flips); max |err| {err.max():.3g}")
    quantum = np.broadcast_to(quantum, err.shape)
    worse = off & (err > quantum + atol)
    assert not worse.any(), (f"{what}: {worse.sum()} elements differ by more than one quantization step "
                             f"(tolerance quantum + atol={atol:g}); max excess {(err - quantum)[worse].max():.3g}")


def fp8_quantum(want, nope):
    """One e4m3 step at each element of the FP8 fake-quantized dims [0:nope] (0 elsewhere): <= |v|/8 for normal
    e4m3 values, plus the subnormal step 2^-9 * block scale (block scale <= 2 * amax / 448)."""
    q = np.zeros_like(want)
    v = want[..., :nope]
    amax = np.abs(v.reshape(v.shape[:-1] + (-1, 64))).max(-1, keepdims=True)
    sub_step = np.broadcast_to(2 * amax / 448 * 2.0 ** -9, v.shape[:-1] + (v.shape[-1] // 64, 64)).reshape(v.shape)
    q[..., :nope] = np.abs(v) / 8 + sub_step
    return q


def fp4_quantum(want):
    """One e2m1 step (grid 0,.5,1,1.5,2,3,4,6) at each element: <= max(0.5 s, |v|/2) for block scale s, and
    s = 2^ceil(log2(amax/6)) < 2 amax / 6 (amax ~ the block's largest |value|)."""
    v = want.reshape(want.shape[:-1] + (-1, 32))
    amax = np.abs(v).max(-1, keepdims=True)
    s = 2 * amax / 6
    return np.maximum(0.5 * s, np.abs(v) / 2).reshape(want.shape) + 1e-30


def _ctx(simulate_quant: bool) -> RunContext:
    """The run context of these layer tests: float32, the kernels this machine plans ("auto")."""
    return RunContext.create(dtype="float32", simulate_quant=simulate_quant)


@functools.lru_cache(maxsize=None)
def _jit_compressor(ratio, head_dim, nope_dim, rotate, simulate_quant):
    cfg = presets.tiny()
    inv_freq = rope_inv_freq(cfg, ratio)
    def fn(p, x, start, n_valid, state, cache):        # the cache as a plain array, stored as PlainEntries
        entries, state = compressor_update(p, x, start, n_valid, state, PlainEntries(cache), ratio=ratio,
                                           head_dim=head_dim, nope_dim=nope_dim, inv_freq=inv_freq, rotate=rotate,
                                           ctx=_ctx(simulate_quant), norm_eps=cfg.norm_eps)
        return entries.values, state
    return jax.jit(fn)


# (layer, jax subtree path, official prefix, head_dim, rotate) of the three compressor flavours of the tiny model
COMPRESSORS = {
    "ratio4_main": (CSA, ("attn", "compressor"), f"layers.{CSA}.attn.compressor.", "head", False),
    "ratio4_indexer": (CSA, ("attn", "indexer", "compressor"), f"layers.{CSA}.attn.indexer.compressor.", "index",
                       True),
    "ratio128": (HCA, ("attn", "compressor"), f"layers.{HCA}.attn.compressor.", "head", False),
}


def _compressor_setup(tiny, kind):
    cfg, params, weights = tiny
    layer, path, prefix, hd_kind, rotate = COMPRESSORS[kind]
    ratio = cfg.compress_ratios[layer]
    head_dim = cfg.head_dim if hd_kind == "head" else cfg.index_head_dim
    p = params["layers"][layer]
    for k in path:
        p = p[k]
    return cfg, p, R.sub(weights, prefix), ratio, head_dim, head_dim - cfg.rope_head_dim, rotate


# ---------------------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["flash", "tiny"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_rope_inv_freq_matches_reference(preset, ratio):
    cfg = getattr(presets, preset)()
    got = rope_inv_freq(cfg, ratio)
    want = R.rope_freqs(cfg, ratio)
    assert got.shape == (cfg.rope_head_dim // 2,)
    assert_close(got, want, 0.0, 2e-7, f"rope_inv_freq({preset}, ratio {ratio}) vs reference.rope_freqs "
                                       "(float32 rounding of float64 values)")
    r = cfg.rope_head_dim
    theta = 10000.0 if ratio == 0 else 160000.0
    plain = theta ** (-2.0 * np.arange(r // 2) / r)
    if ratio == 0:
        assert_close(got, plain, 0.0, 2e-7, f"{preset} ratio 0: plain theta=10000 table, no YaRN (rtol 2e-7)")
    else:
        assert not np.allclose(got, plain, rtol=1e-3), f"{preset} ratio {ratio}: YaRN must change some frequencies"


def test_rope_flash_yarn_low_high():
    """Flash, compress theta 160000, r = 64: low = floor(15.45) = 15, high = ceil(24.71) = 25, so pairs 0..15 keep
    theta^(-2i/64) and pairs 25..31 (the last 7) are divided by rope_factor 16; 16..24 blend linearly."""
    cfg = presets.flash()
    plain = 160000.0 ** (-2.0 * np.arange(32) / 64)
    for f, who in ((rope_inv_freq(cfg, 4), "dsv4_jax"), (R.rope_freqs(cfg, 4), "reference")):
        assert_close(f[:16], plain[:16], 0.0, 2e-7, f"{who}: flash pairs 0..15 unchanged by YaRN (rtol 2e-7)")
        assert_close(f[25:], plain[25:] / 16, 0.0, 2e-7, f"{who}: flash last 7 pairs divided by 16 (rtol 2e-7)")
        ramp = (np.arange(16, 25) - 15) / 10
        assert_close(f[16:25], plain[16:25] * (1 - ramp) + plain[16:25] / 16 * ramp, 0.0, 2e-7,
                     f"{who}: flash pairs 16..24 blend with ramp (i-15)/10 (rtol 2e-7)")
    assert np.array_equal(rope_inv_freq(cfg, 4), rope_inv_freq(cfg, 128)), "ratio 4 and 128 share one table"


@pytest.mark.parametrize("preset,ratio", [("tiny", 0), ("tiny", 4), ("flash", 0), ("flash", 128)])
def test_apply_rope_forward_inverse(preset, ratio):
    cfg = getattr(presets, preset)()
    rng = np.random.default_rng(7 + ratio)
    B, S, H, d = 2, 24, 3, cfg.head_dim
    x = rng.standard_normal((B, S, H, d)).astype(np.float32)
    pos = rng.integers(0, 300, size=(B, S)).astype(np.int32)
    f32 = rope_inv_freq(cfg, ratio)
    f64 = R.rope_freqs(cfg, ratio)
    fwd = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos)[:, :, None], f32))
    inv = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos)[:, :, None], f32, inverse=True))
    tol = "atol 1e-4 (float32 angle p*f with p < 300: error <= ulp(300)/2 = 1.5e-5 per unit amplitude)"
    assert_close(fwd, R.apply_rope(x, pos, f64), 1e-4, 0, f"apply_rope forward vs reference, {tol}")
    assert_close(inv, R.apply_rope(x, pos, f64, inverse=True), 1e-4, 0, f"apply_rope inverse vs reference, {tol}")
    nope = d - cfg.rope_head_dim
    assert np.array_equal(fwd[..., :nope], x[..., :nope]), "leading nope dims must pass through bit-exactly"
    back = np.asarray(apply_rope(jnp.asarray(fwd), jnp.asarray(pos)[:, :, None], f32, inverse=True))
    assert_close(back, x, 2e-6, 0, "inverse(forward(x)) == x (atol 2e-6: same float32 angles cancel)")
    # interleaved pairs (2i, 2i+1), not rotate_half: a unit vector in rope dim 2i rotates into dim 2i+1 only
    e = np.zeros((1, d), np.float32)
    e[0, nope + 2] = 1.0
    out = np.asarray(apply_rope(jnp.asarray(e), jnp.asarray([5]), f32))[0]
    want = np.zeros(d)
    want[nope + 2], want[nope + 3] = np.cos(5 * f64[1]), np.sin(5 * f64[1])
    assert_close(out, want, 1e-6, 0, "unit vector in rope dim 2 rotates within the pair (2, 3) (atol 1e-6)")


# ---------------------------------------------------------------------------------------------------------------
# fake quantization and Hadamard
# ---------------------------------------------------------------------------------------------------------------

def _wide_range_blocks(rng, rows, n_blocks, block):
    """Random values with a different magnitude per block (1e-6 .. 1e3) and within-block spread (subnormals)."""
    x = rng.standard_normal((rows, n_blocks, block)) * 10.0 ** rng.uniform(-6, 3, (rows, n_blocks, 1))
    x *= 10.0 ** rng.uniform(-3, 0, (rows, n_blocks, block))
    return x.reshape(rows, n_blocks * block).astype(np.float32)


def test_fp8_fake_quant_bit_exact():
    rng = np.random.default_rng(11)
    x = _wide_range_blocks(rng, 64, 6, 64)
    x[0, :64] = rng.uniform(-1e-6, 1e-6, 64).astype(np.float32)   # amax below the 1e-4 floor
    got = np.asarray(fp8_fake_quant(jnp.asarray(x)))
    want = R.fp8_fake_quant(x.astype(np.float64), 64)
    assert got.dtype == np.float32
    assert np.array_equal(got.astype(np.float64), want), \
        f"fp8_fake_quant (block 64) must be bit-exact vs reference; {np.sum(got != want)} elements differ"
    assert not np.array_equal(got, x), "fake quant must round something"


def test_fp4_fake_quant_bit_exact():
    rng = np.random.default_rng(12)
    x = _wide_range_blocks(rng, 64, 4, 32)
    got = np.asarray(fp4_fake_quant(jnp.asarray(x)))
    want = R.fp4_fake_quant(x.astype(np.float64), 32)
    assert np.array_equal(got.astype(np.float64), want), \
        f"fp4_fake_quant (block 32) must be bit-exact vs reference; {np.sum(got != want)} elements differ"
    # every output is a grid value times the block's power-of-two scale
    blocks = np.abs(got.reshape(64, 4, 32))
    scale = R._pow2_ceil(np.maximum(np.abs(x.reshape(64, 4, 32)).max(-1, keepdims=True), 6 * 2.0 ** -126) / 6)
    assert np.all(np.isin(blocks / scale, R._E2M1_GRID)), "fp4 values must lie on the e2m1 grid x block scale"


def test_round_to_e2m1_ties_and_saturation():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want_ties = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])   # ties to the even code
    extra = np.array([0.0, 0.2, 0.3, 0.5, 1.1, 2.9, 4.4, 5.5, 6.0, 6.5, 7.0, 100.0, 3e38])
    want_extra = np.array([0.0, 0.0, 0.5, 0.5, 1.0, 3.0, 4.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0])
    near = np.concatenate([np.nextafter(ties.astype(np.float32), np.float32(0)),
                           np.nextafter(ties.astype(np.float32), np.float32(10))])
    y = np.concatenate([ties, -ties, extra, -extra, near, -near]).astype(np.float32)
    got = np.asarray(round_to_e2m1(jnp.asarray(y))).astype(np.float64)
    assert np.array_equal(got, R.round_e2m1(y.astype(np.float64))), "round_to_e2m1 must equal reference.round_e2m1"
    n = len(ties)
    assert np.array_equal(got[:n], want_ties), f"ties 0.25..5 -> {want_ties}, got {got[:n]}"
    assert np.array_equal(got[n:2 * n], -want_ties), "negative ties mirror the positive ones"
    m = len(extra)
    assert np.array_equal(got[2 * n:2 * n + m], want_extra), f"plain rounding / saturation at 6: got {got[2*n:2*n+m]}"
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    lo = grid[np.searchsorted(grid, ties) - 1]
    hi = grid[np.searchsorted(grid, ties)]
    k = 2 * n + 2 * m
    assert np.array_equal(got[k:k + n], lo) and np.array_equal(got[k + n:k + 2 * n], hi), \
        "values just below / above a tie round down / up"


def test_hadamard():
    rng = np.random.default_rng(13)
    # power-of-4 size: entries +-1/8 are exact in float32, so small-integer inputs give exact sums
    xi = rng.integers(-8, 9, size=(5, 64)).astype(np.float32)
    got = np.asarray(hadamard(jnp.asarray(xi)))
    assert np.array_equal(got.astype(np.float64), R.hadamard(xi.astype(np.float64))), \
        "hadamard(64) on integer inputs must be bit-exact vs reference (exact arithmetic)"
    x = rng.standard_normal((3, 7, 128)).astype(np.float32)
    got = np.asarray(hadamard(jnp.asarray(x)))
    assert_close(got, R.hadamard(x.astype(np.float64)), 1e-5, 0, "hadamard(128) vs reference (atol 1e-5, float32)")
    back = np.asarray(hadamard(jnp.asarray(got)))
    assert_close(back, x, 1e-5, 0, "hadamard is an involution (orthonormal, symmetric) (atol 1e-5)")


# ---------------------------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------------------------

def _random_streams(rng, cfg, lead=(2, 5)):
    return (rng.standard_normal(lead + (cfg.hc_mult, cfg.dim)) * rng.uniform(0.5, 3.0, lead + (cfg.hc_mult, 1)))


@pytest.mark.parametrize("sharpen,unroll", [(1.0, False), (40.0, False), (40.0, True)])
def test_hc_pre_post(tiny, sharpen, unroll):
    """sharpen scales hc_attn_fn so the Sinkhorn logits are large (|logit| ~ 10): then the result depends on
    running exactly 20 iterations (checked against 19 and 21 in the reference). `unroll`: the straight-line
    Sinkhorn the model compiles on a GPU."""
    cfg, params, weights = tiny
    rng = np.random.default_rng(21)
    X = _random_streams(rng, cfg).astype(np.float32)
    w = R.sub(weights, f"layers.{CSA}.")
    fn = (w["hc_attn_fn"] * sharpen).astype(np.float32)
    base, scale = w["hc_attn_base"], w["hc_attn_scale"]
    normalise = functools.partial(sinkhorn, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, unroll=unroll)
    u, post, comb = jax.jit(functools.partial(hc_pre, cfg=cfg, normalise=normalise))(
        jnp.asarray(X), jnp.asarray(fn), params["layers"][CSA]["hc_attn_base"], params["layers"][CSA]["hc_attn_scale"])
    ru, rpost, rcomb = R.hc_pre(X.astype(np.float64), fn.astype(np.float64), base, scale, cfg)
    assert_close(post, rpost, 1e-6, 1e-5, "hc_pre post = 2 sigmoid(.) (atol 1e-6 rtol 1e-5)")
    assert_close(comb, rcomb, 2e-6, 1e-4, "hc_pre comb (20-iteration Sinkhorn) (atol 2e-6 rtol 1e-4)")
    assert_close(u, ru, 1e-5, 1e-5, "hc_pre collapse u = sum pre_i X_i (atol 1e-5 rtol 1e-5)")
    if sharpen > 1:
        for iters in (19, 21):
            other = R.hc_pre(X.astype(np.float64), fn.astype(np.float64), base, scale,
                             cfg.replace(hc_sinkhorn_iters=iters))[2]
            assert np.abs(other - rcomb).max() > 100 * 2e-6, \
                f"test not sensitive to the iteration count ({iters} vs 20 iterations differ by < 100x the tolerance)"
    # hc_post: transposed mixing X'_k = post_k y + sum_j C_jk X_j, with the non-symmetric comb from above
    y = rng.standard_normal(X.shape[:-2] + (cfg.dim,)).astype(np.float32)
    got = jax.jit(hc_post)(jnp.asarray(y), jnp.asarray(X), post, comb)
    want = R.hc_post(y.astype(np.float64), X.astype(np.float64), np.asarray(post, np.float64),
                     np.asarray(comb, np.float64))
    assert_close(got, want, 1e-5, 1e-5, "hc_post vs reference (atol 1e-5 rtol 1e-5)")
    wrong = R.hc_post(y.astype(np.float64), X.astype(np.float64), np.asarray(post, np.float64),
                      np.swapaxes(np.asarray(comb, np.float64), -1, -2))
    assert np.abs(wrong - want).max() > 1e-3, "comb must be non-symmetric for the transposition check to bite"


def test_hc_pre_eps_placement(tiny):
    """Saturated logits expose where eps goes: pre = sigmoid(.) + eps -> exactly eps; post = 2 sigmoid(.) with no
    eps -> exactly 0."""
    cfg, params, weights = tiny
    rng = np.random.default_rng(23)
    X = _random_streams(rng, cfg).astype(np.float32)
    w = R.sub(weights, f"layers.{CSA}.")
    n = cfg.hc_mult
    base = w["hc_ffn_base"].copy()
    base[:2 * n] = -200.0
    u, post, comb = jax.jit(functools.partial(hc_pre, cfg=cfg))(
        jnp.asarray(X), params["layers"][CSA]["hc_ffn_fn"], jnp.asarray(base, jnp.float32),
        params["layers"][CSA]["hc_ffn_scale"])
    ru, rpost, rcomb = R.hc_pre(X.astype(np.float64), w["hc_ffn_fn"], base, w["hc_ffn_scale"], cfg)
    assert np.all(rpost < 1e-60), "reference: saturated post = 2 sigmoid(-200) ~ 1e-87, no eps"
    assert np.all(np.asarray(post) == 0.0), f"post = 2 sigmoid(.) carries no eps: want 0 (float32), got {post}"
    want_u = cfg.hc_eps * X.astype(np.float64).sum(-2)
    assert_close(ru, want_u, 0, 1e-9, "reference: saturated pre = hc_eps exactly")
    assert_close(u, want_u, 1e-12, 1e-5, "hc_pre with saturated pre logits: u = hc_eps * sum_i X_i (rtol 1e-5)")
    assert_close(comb, rcomb, 2e-6, 1e-4, "hc_pre comb vs reference (atol 2e-6 rtol 1e-4)")


def test_hc_head(tiny):
    cfg, params, weights = tiny
    rng = np.random.default_rng(22)
    X = _random_streams(rng, cfg).astype(np.float32)
    got = jax.jit(functools.partial(hc_head, cfg=cfg))(jnp.asarray(X), params["hc_head_fn"], params["hc_head_base"],
                                                      params["hc_head_scale"])
    want = R.hc_head(X.astype(np.float64), weights["hc_head_fn"], weights["hc_head_base"], weights["hc_head_scale"],
                     cfg)
    assert_close(got, want, 1e-5, 1e-5, "hc_head vs reference (atol 1e-5 rtol 1e-5)")


# ---------------------------------------------------------------------------------------------------------------
# compressor
# ---------------------------------------------------------------------------------------------------------------

def _compressor_ref_tol(simulate_quant, rotate, want, nope):
    """(atol, quantum) for comparing compressor entries with the reference."""
    atol = 1e-4    # rmsnorm'd entries ~ 1: rope angle j*c < 300 -> 1.5e-5 abs, matmul/softmax ~1e-6 rel
    if not simulate_quant:
        return atol, 0.0
    return atol, (fp4_quantum(want) if rotate else fp8_quantum(want, nope))


def _run_chunked(fn, p, x, schedule, width, state, cache, rng):
    """Feed x [B, L, D] in chunks: schedule [n_calls, B] tokens per call, each call a padded [B, width] buffer
    (padding filled with garbage). Returns (cache, state)."""
    B, L, D = x.shape
    start = np.zeros(B, np.int32)
    for n in schedule:
        buf = rng.standard_normal((B, width, D)).astype(np.float32) * 50   # garbage padding
        for b in range(B):
            buf[b, :n[b]] = x[b, start[b]:start[b] + n[b]]
        cache, state = fn(p, jnp.asarray(buf), jnp.asarray(start), jnp.asarray(n, np.int32), state, cache)
        start = start + np.asarray(n, np.int32)
    assert np.all(start == L)
    return cache, state


def _state_positions(L, c, coff):
    base = (L // c) * c - (coff - 1) * c
    return base + np.arange(coff * c)


@pytest.mark.parametrize("simulate_quant", [False, True], ids=["noquant", "quant"])
@pytest.mark.parametrize("kind", list(COMPRESSORS))
def test_compressor(tiny, xseq, kind, simulate_quant):
    cfg, p, w, ratio, head_dim, nope, rotate = _compressor_setup(tiny, kind)
    fn = _jit_compressor(ratio, head_dim, nope, rotate, simulate_quant)
    B, L, D = xseq.shape
    c, coff = ratio, (2 if ratio == 4 else 1)
    n_entries = L // c
    n_cache = n_entries + 2
    poison = jnp.full((B, n_cache, head_dim), jnp.nan, jnp.float32)
    fresh = init_compressor_state(B, ratio, head_dim)

    # 1. the whole sequence in one chunk from a fresh state vs the reference
    whole, whole_state = fn(p, jnp.asarray(xseq), jnp.zeros(B, jnp.int32), jnp.full(B, L, jnp.int32), fresh, poison)
    whole = np.asarray(whole)
    want = R.compressor_entries(xseq.astype(np.float64), w, ratio, head_dim, rotate, cfg, R.rope_freqs(cfg, ratio),
                                simulate_quant)
    assert want.shape == (B, n_entries, head_dim)
    assert np.isnan(whole[:, n_entries:]).all(), f"cache rows >= L//c = {n_entries} must keep their NaN poison"
    atol, quantum = _compressor_ref_tol(simulate_quant, rotate, want, nope)
    what = f"{kind} entries (simulate_quant={simulate_quant}) vs reference.compressor_entries"
    if simulate_quant:
        assert_close_quantized(whole[:, :n_entries], want, atol, quantum, 2e-3, what)
    else:
        assert_close(whole[:, :n_entries], want, atol, 0, what)

    # the pending state holds the projected tokens of positions base .. base + coff*c - 1 (kv and gate + ape)
    spos = _state_positions(L, c, coff)
    real = (spos >= 0) & (spos < L)
    xs = xseq[:, spos[real]].astype(np.float64)
    st_kv = np.asarray(whole_state.kv)
    st_score = np.asarray(whole_state.score)
    assert_close(st_kv[:, real], xs @ w["wkv.weight"].T, 1e-5, 1e-5,
                 f"{kind} pending kv state = wkv x of the incomplete windows' tokens (atol 1e-5 rtol 1e-5)")
    assert_close(st_score[:, real], xs @ w["wgate.weight"].T + w["ape"][spos[real] % c], 1e-5, 1e-5,
                 f"{kind} pending score state = wgate x + ape[p mod c] (atol 1e-5 rtol 1e-5)")
    assert np.all(st_score[:, ~real] == -np.inf), "pending slots of positions >= L keep score -inf"

    # 2. uneven chunks (per-row schedules, padded buffers, idle rows with n_valid = 0)
    rng = np.random.default_rng(31)
    schedule = np.array([[3, 128], [1, 0], [7, 5], [130, 1], [2, 126], [117, 0]], np.int32)
    assert np.all(schedule.sum(0) == L)
    chunked, chunked_state = _run_chunked(fn, p, xseq, schedule, L, fresh, poison, rng)   # same shape as step 1
    chunked = np.asarray(chunked)
    assert np.isnan(chunked[:, n_entries:]).all(), "chunked: cache rows >= L//c must keep their NaN poison"
    assert_close_quantized(chunked[:, :n_entries], whole[:, :n_entries], 1e-5, quantum if simulate_quant else 0.0,
                           1e-3, f"{kind} chunked vs one-chunk cache (atol 1e-5: same float32 math up to summation "
                                 "order)")
    for key in ("kv", "score"):   # including the slots of positions >= L: empty, not the padding's garbage
        assert_close(np.asarray(getattr(chunked_state, key)), np.asarray(getattr(whole_state, key)), 1e-5, 1e-6,
                     f"{kind} chunked final pending {key} vs one chunk (atol 1e-5 rtol 1e-6)")

    # 3. token by token: entries appear exactly at the step where (t+1) % c == 0
    cache, state = poison, fresh
    for t in range(L):
        cache, state = fn(p, jnp.asarray(xseq[:, t:t + 1]), jnp.full(B, t, jnp.int32), jnp.ones(B, jnp.int32),
                          state, cache)
        filled = ~np.isnan(np.asarray(cache[:, :, 0]))
        expect = np.arange(n_cache)[None, :] < (t + 1) // c
        assert np.array_equal(filled, np.broadcast_to(expect, filled.shape)), \
            f"{kind}: after token t={t} exactly entries j < (t+1)//c = {(t + 1) // c} must be written"
    assert_close_quantized(np.asarray(cache)[:, :n_entries], whole[:, :n_entries], 1e-5,
                           quantum if simulate_quant else 0.0, 1e-3,
                           f"{kind} token-by-token vs one-chunk cache (atol 1e-5)")
    for key in ("kv", "score"):
        assert_close(np.asarray(getattr(state, key)), np.asarray(getattr(whole_state, key)), 1e-5, 1e-6,
                     f"{kind} token-by-token final pending {key} vs one chunk (atol 1e-5 rtol 1e-6)")


# ---------------------------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("simulate_quant", [False, True], ids=["noquant", "quant"])
def test_indexer_select(tiny, xseq, simulate_quant):
    cfg, params, weights = tiny
    B, L, D = xseq.shape
    wa = R.sub(weights, f"layers.{CSA}.attn.")
    x64 = xseq.astype(np.float64)
    cq = R.rms_norm(x64 @ wa["wq_a.weight"].T, wa["q_norm.weight"], cfg.norm_eps).astype(np.float32)
    f32 = rope_inv_freq(cfg, 4)
    # index keys from the jax compressor (validated above); rows beyond L//4 hold a huge poison that must never win
    n_entries = L // 4
    poison = jnp.full((B, n_entries + 2, cfg.index_head_dim), 1e3, jnp.float32)   # shape as in test_compressor
    comp = functools.partial(compressor_update, ratio=4, head_dim=cfg.index_head_dim,
                             nope_dim=cfg.index_head_dim - cfg.rope_head_dim, inv_freq=f32, rotate=True,
                             ctx=_ctx(simulate_quant), norm_eps=cfg.norm_eps)
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    p_index = params["layers"][CSA]["attn"]["indexer"]
    fresh = init_compressor_state(B, 4, cfg.index_head_dim)

    def select(p, x, q, pos):
        keys, _ = comp(p["compressor"], x, jnp.zeros(B, jnp.int32), jnp.full(B, L, jnp.int32), fresh,
                       PlainEntries(poison))
        keys = keys.values
        # looked up at call time: DecisionRecorder records the module's indexer_select
        return indexer.indexer_select(p, cfg, x, q, pos, keys, f32, _ctx(simulate_quant))

    ref_decisions = R.SPEC_DECISIONS
    if simulate_quant:
        # the reference takes the model's FP4 roundings of q and keys and its picks, each checked to be the spec's
        # up to float32 noise (a differing pick only where its score ties the k-th best), so that an FP4 rounding
        # tie cannot decide the selection
        recorder = DecisionRecorder(cfg, [(f"layers.{CSA}.", CSA)], select, parts=("attn.indexer",))
        (idx, valid), records = recorder(p_index, jnp.asarray(xseq), jnp.asarray(cq), positions)
        ref_decisions = ModelDecisions(records)
    else:
        idx, valid = jax.jit(select)(p_index, jnp.asarray(xseq), jnp.asarray(cq), positions)
    idx, valid = np.asarray(idx), np.asarray(valid)
    ref_sel, ref_scores = R.indexer_topk(cfg, R.sub(wa, "indexer."), x64, cq.astype(np.float64),
                                         R.rope_freqs(cfg, 4), simulate_quant, decisions=ref_decisions,
                                         site=f"layers.{CSA}.attn.indexer")
    # near ties at the top-k boundary may legitimately flip between float32 and float64: allow a differing pick
    # only if its reference score is within `margin` of the k-th best visible score.
    margin = 1e-4
    spread = np.nanmax(np.abs(np.where(np.isfinite(ref_scores), ref_scores, np.nan)))
    n_flips = 0
    for b in range(B):
        for t in range(L):
            got = set(idx[b, t][valid[b, t]].tolist())
            want = set(np.nonzero(ref_sel[b, t])[0].tolist())
            assert all(j < (t + 1) // 4 for j in got), f"query {t}: selected an invisible entry {sorted(got)}"
            assert len(got) == len(want) == min(cfg.index_topk, (t + 1) // 4), \
                f"query {t}: selected {len(got)} entries, want min(index_topk, (t+1)//4) = {len(want)}"
            if got != want:
                n_flips += 1
                kth = np.sort(ref_scores[b, t][np.isfinite(ref_scores[b, t])])[::-1][len(want) - 1]
                gap = np.abs(ref_scores[b, t][list(got ^ want)] - kth).max()
                assert gap <= margin * spread, \
                    (f"batch {b} query {t}: selected {sorted(got)} != reference {sorted(want)}, and the differing "
                     f"entries are not near-ties (|score - kth| = {gap:.3g} > margin {margin:g} x {spread:.3g})")
    assert n_flips <= 2, f"{n_flips} queries differ by near-tie flips; at most 2 expected (margin {margin:g})"


# ---------------------------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("simulate_quant", [False, True], ids=["noquant", "quant"])
@pytest.mark.parametrize("layer", [SWA, CSA, HCA], ids=["window", "csa", "hca"])
def test_attention(tiny, xseq, layer, simulate_quant):
    cfg, params, weights = tiny
    B, L, D = xseq.shape
    ratio = cfg.compress_ratios[layer]
    cache = init_layer_cache(cfg, ratio, B, 384, jnp.float32)
    f32 = rope_inv_freq(cfg, ratio)
    args = (params["layers"][layer]["attn"], jnp.asarray(xseq), jnp.zeros(B, jnp.int32), jnp.full(B, L, jnp.int32),
            cache)

    def fn(p, x, s, n, c):
        out, new_cache, stats, _ = attention(p, cfg, ratio, x, Chunk(jnp.zeros_like(x[..., 0], jnp.int32), s, n), c,
                                             f32, _ctx(simulate_quant))
        assert stats == {}, "inference returns no training statistics"
        return out, new_cache

    decisions = R.SPEC_DECISIONS
    if simulate_quant:
        # The reference takes the model's roundings (window KV, compressed entries, indexer q / keys) and indexer
        # picks, each checked to be the spec's up to float32 noise, so that a value on an FP8 / FP4 rounding tie
        # cannot decide the comparison; then the tolerance is the same as without fake quant.
        (out, new_cache), records = DecisionRecorder(cfg, [(f"layers.{layer}.", layer)], fn, parts=("attn",))(*args)
        decisions = ModelDecisions(records)
    else:
        out, new_cache = jax.jit(fn)(*args)
    out = np.asarray(out)
    want, aux = R.attention(cfg, weights, f"layers.{layer}.", layer, xseq.astype(np.float64), simulate_quant,
                            return_aux=True, decisions=decisions)
    scale = np.abs(want).max()
    if ratio:
        n = L // ratio
        assert n >= 2, "the sequence must complete compressed entries"
        got_comp = np.asarray(new_cache.compressed_kv.values)[:, :n]
        assert_close(got_comp, aux["compressed"], 1e-4, 0, f"layer {layer} compressed cache vs reference (atol 1e-4)")
    tol = 2e-5 * scale   # observed ~5e-7 x scale; float32 GEMMs, softmax and rope angles (p < 260)
    assert_close(out, want, tol, 0, f"attention layer {layer} (ratio {ratio}, simulate_quant={simulate_quant}) vs "
                                    f"reference, atol 2e-5 x max|out| = {tol:.3g}")


@pytest.mark.parametrize("seq", [17, 32, 61], ids=["one-block-and-a-query", "two-blocks", "pads-to-four"])
def test_window_blocks_equal_the_softmax_over_each_querys_window(seq):
    """A chunk longer than the window takes _window_blocks; float64 softmax over exactly the keys at positions
    p - window + 1 .. p (ring slots of earlier positions, then the chunk), with the sink in the denominator. One
    row continues a sequence (its ring full), the other starts one (its ring unwritten: negative positions)."""
    window, n_heads, head_dim = 16, 3, 8
    start = np.array([37, 0], np.int32)
    rng = np.random.default_rng(seq)
    q, kv = rng.standard_normal((2, seq, n_heads, head_dim)), rng.standard_normal((2, seq, head_dim))
    ring, sink = rng.standard_normal((2, window, head_dim)), rng.standard_normal(n_heads)
    positions = start[:, None] + np.arange(seq, dtype=np.int32)[None, :]
    got = attention_core._attend(jnp.asarray(q, jnp.float32), PlainEntries(jnp.asarray(ring, jnp.float32)),
                                 jnp.asarray(kv, jnp.float32), jnp.asarray(start), jnp.asarray(positions),
                                 jnp.asarray(sink, jnp.float32), 0.3, window, 0, None, None)
    want = np.full_like(q, np.nan)
    for b in range(2):
        ring_pos = np.asarray(attention_core.ring_positions(jnp.asarray(start[b:b + 1]), window))[0]
        keys, key_pos = np.concatenate([ring[b], kv[b]]), np.concatenate([ring_pos, positions[b]])
        for t, p in enumerate(positions[b]):
            seen = (key_pos >= 0) & (key_pos <= p) & (key_pos > p - window)
            assert seen.sum() == min(window, p + 1)
            logits = 0.3 * q[b, t] @ keys[seen].T                                             # [H, seen]
            peak = np.maximum(logits.max(axis=-1), sink)
            e = np.exp(logits - peak[:, None])
            want[b, t] = (e @ keys[seen]) / (e.sum(axis=-1) + np.exp(sink - peak))[:, None]
    assert_close(got, want, 1e-5, 0, f"window attention of a {seq}-token chunk in blocks of {window} vs float64 "
                                     f"(atol 1e-5)")


@pytest.mark.parametrize("ratio", [0, 4, 8], ids=["window", "csa", "hca"])
def test_one_token_attention_equals_the_softmax_over_the_keys_it_may_see(ratio):
    """A decode step's attention core (_attend_one_token: the mask from the column index, the sink in a padding
    column, probabilities normalised before the values) against float64: the softmax over exactly the ring keys at
    positions p - window + 1 .. p - 1, the token's own key, and the picked valid (CSA) or visible (HCA) compressed
    entries, the sink in the denominator. Row 0 is early (ring partly unwritten, fewer visible entries than picks),
    row 1 late; unwritten ring slots, invalid picks and invisible entries hold poison. With compressed entries the
    keys leave exactly one padding column, the sink's."""
    window, n_heads, head_dim, n_entries, k = 16, 3, 8, 46, 46     # (CSA, HCA) 17 + 46 keys: one padding column
    start = np.array([9 if ratio != 8 else 30, 300], np.int32)
    rng = np.random.default_rng(614)
    q, kv = rng.standard_normal((2, 1, n_heads, head_dim)), rng.standard_normal((2, 1, head_dim))
    ring, sink = rng.standard_normal((2, window, head_dim)), rng.standard_normal(n_heads)
    compressed = rng.standard_normal((2, n_entries, head_dim))
    ring_pos = np.full((2, window), -1)                 # the slot of position p is p % window; -1: never written
    for b in range(2):
        for p in range(max(0, start[b] - window), start[b]):
            ring_pos[b, p % window] = p
    ring[ring_pos < 0] = 1e4
    picks, seen_entries = None, [np.zeros(0, int)] * 2
    if ratio:
        visible = np.minimum((start + 1) // ratio, n_entries)
        for b in range(2):
            compressed[b, visible[b]:] = 1e4
        seen_entries = [np.arange(v) for v in visible]
    if ratio == 4:
        idx = np.zeros((2, 1, k), np.int32)
        for b in range(2):
            n_valid = min(k, visible[b])
            idx[b, 0, :n_valid] = rng.permutation(visible[b])[:n_valid]
            idx[b, 0, n_valid:] = rng.integers(visible[b], n_entries, k - n_valid)       # invisible: poison
            seen_entries[b] = idx[b, 0, :n_valid]
        valid = np.arange(k)[None, None, :] < np.minimum(k, visible)[:, None, None]
        assert not valid[0].all() and valid[1].all()
        picks = (jnp.asarray(idx), jnp.asarray(valid))
    got = attention_core._attend(jnp.asarray(q, jnp.float32), PlainEntries(jnp.asarray(ring, jnp.float32)),
                                 jnp.asarray(kv, jnp.float32), jnp.asarray(start), jnp.asarray(start[:, None]),
                                 jnp.asarray(sink, jnp.float32), 0.3, window, ratio,
                                 PlainEntries(jnp.asarray(compressed, jnp.float32)) if ratio else None, picks)
    want = np.full_like(q, np.nan)
    for b in range(2):
        in_window = (ring_pos[b] >= 0) & (ring_pos[b] > start[b] - window)
        keys = np.concatenate([ring[b][in_window], kv[b], compressed[b][seen_entries[b]]])
        assert len(keys) == min(window, start[b] + 1) + len(seen_entries[b])
        logits = 0.3 * q[b, 0] @ keys.T                                                     # [H, seen]
        peak = np.maximum(logits.max(axis=-1), sink)
        e = np.exp(logits - peak[:, None])
        want[b, 0] = (e @ keys) / (e.sum(axis=-1) + np.exp(sink - peak))[:, None]
    assert_close(got, want, 1e-5, 0, f"one token's attention (ratio {ratio}) vs float64 (atol 1e-5)")


# ---------------------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [1, 3], ids=["hash", "score"])
def test_router(tiny, layer):
    cfg, params, weights = tiny
    rng = np.random.default_rng(41 + layer)
    T = 64
    x = rng.standard_normal((T, cfg.dim)).astype(np.float32)
    tokens = rng.integers(0, cfg.vocab_size, T).astype(np.int32)
    g = R.sub(weights, f"layers.{layer}.ffn.gate.")
    gate = dict(params["layers"][layer]["ffn"]["gate"])
    hashed = cfg.is_hash_layer(layer)
    if not hashed:
        # a strong bias on expert 5 forces it into every top-k, but its weight stays the unbiased score
        g = dict(g, bias=g["bias"] + np.eye(cfg.n_routed_experts)[5] * 100.0)
        gate["bias"] = jnp.asarray(g["bias"], jnp.float32)
    rfn = jax.jit(functools.partial(route, cfg=cfg, hash_routed=hashed))
    ids, w = rfn(gate, x=jnp.asarray(x), token_ids=jnp.asarray(tokens))
    ids, w = np.asarray(ids), np.asarray(w)
    ref_ids, ref_w = R.router(cfg, g, x.astype(np.float64), tokens, layer)
    s = np.sqrt(np.logaddexp(0, x.astype(np.float64) @ g["weight"].T))       # sqrt(softplus(logits))
    if hashed:
        assert np.array_equal(ids, weights[f"layers.{layer}.ffn.gate.tid2eid"][tokens]), "hash ids = tid2eid[token]"
    else:
        assert np.all((ids == 5).any(-1)), "bias +100 on expert 5 must select it for every token"
    order, ref_order = np.argsort(ids, -1), np.argsort(ref_ids, -1)
    ids_s, w_s = np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)
    assert np.array_equal(ids_s, np.take_along_axis(ref_ids, ref_order, -1)), "selected experts vs reference.router"
    assert_close(w_s, np.take_along_axis(ref_w, ref_order, -1), 1e-6, 1e-5,
                 "routing weights vs reference (atol 1e-6 rtol 1e-5)")
    sel = np.take_along_axis(s, ids_s, -1)
    assert_close(w_s, sel / sel.sum(-1, keepdims=True) * cfg.route_scale, 1e-6, 1e-5,
                 "weights = unbiased sqrt(softplus) of the picked experts / their sum * route_scale "
                 "(atol 1e-6 rtol 1e-5)")
    assert_close(w.sum(-1), np.full(T, cfg.route_scale), 1e-5, 0, "weights sum to route_scale (atol 1e-5)")


def test_clamped_swiglu():
    rng = np.random.default_rng(51)
    limit = 10.0
    gate = np.concatenate([rng.uniform(-30, 30, 200), [-20.0, -10.0, 10.0, 15.0]]).astype(np.float32)
    up = np.concatenate([rng.uniform(-30, 30, 200), [1.0, 1.0, 20.0, -20.0]]).astype(np.float32)
    got = np.asarray(clamped_swiglu(jnp.asarray(gate), jnp.asarray(up), limit)).astype(np.float64)
    # the reference expert with identity projections: W1 picks the gate half, W3 the up half, W2 = I
    n = gate.size
    eye = np.eye(n)
    want = R.swiglu_expert(np.concatenate([gate, up]).astype(np.float64)[None], np.hstack([eye, 0 * eye]), eye,
                           np.hstack([0 * eye, eye]), limit)[0]
    assert_close(got, want, 1e-6, 1e-6, "clamped_swiglu vs reference.swiglu_expert (atol 1e-6 rtol 1e-6)")
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    assert_close(got[-4:], [silu(-20.0), silu(-10.0), silu(10.0) * 10, silu(10.0) * -10], 1e-6, 1e-6,
                 "gate min(g, 10) only (no lower clamp: g=-20 stays -20), up clamp(u, -10, 10) (atol 1e-6)")


@pytest.mark.parametrize("layer", [1, 3], ids=["hash", "score"])
def test_moe(tiny, layer):
    """Inputs scaled x6 so that many gate / up pre-activations exceed the clamp limit 10."""
    cfg, params, weights = tiny
    rng = np.random.default_rng(61 + layer)
    B, S = 2, 24
    x = (rng.standard_normal((B, S, cfg.dim)) * 6).astype(np.float32)
    tokens = rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    hashed = cfg.is_hash_layer(layer)
    got, stats = jax.jit(functools.partial(moe, cfg=cfg, hash_routed=hashed, ctx=_ctx(False)))(
        params["layers"][layer]["ffn"], x=jnp.asarray(x), token_ids=jnp.asarray(tokens))
    assert stats == {}
    x64 = x.astype(np.float64)
    want = R.moe(cfg, weights, f"layers.{layer}.", layer, x64, tokens)
    f = R.sub(weights, f"layers.{layer}.ffn.")
    pre = np.concatenate([x64 @ f[f"experts.{e}.{k}.weight"].T for e in range(cfg.n_routed_experts)
                          for k in ("w1", "w3")] + [x64 @ f[f"shared_experts.{k}.weight"].T for k in ("w1", "w3")])
    assert (np.abs(pre) > cfg.swiglu_limit).mean() > 0.05, "inputs must exceed the SwiGLU limit for this test"
    scale = np.abs(want).max()
    assert_close(got, want, 2e-5 * scale, 0, f"moe (routed + shared) vs reference.moe, atol 2e-5 x max|y| = "
                                             f"{2e-5 * scale:.3g}")


@pytest.mark.parametrize("layer", [1, 3], ids=["hash", "score"])
def test_moe_skips_tokens_that_are_not_real(tiny, layer):
    """moe(real=...): the real tokens' output is reference.moe's; a token that is not real (padding, a row that is not
    generating) gets no routed expert, so its output is the shared expert's alone (with the routed sum it would not
    be)."""
    cfg, params, weights = tiny
    rng = np.random.default_rng(67 + layer)
    B, S = 3, 16
    x = (rng.standard_normal((B, S, cfg.dim)) * 3).astype(np.float32)
    tokens = rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    real = np.arange(S)[None, :] < np.array([S, 5, 0])[:, None]               # a full row, a short one, a free one
    got, _ = jax.jit(functools.partial(moe, cfg=cfg, hash_routed=cfg.is_hash_layer(layer), ctx=_ctx(False)))(
        params["layers"][layer]["ffn"], x=jnp.asarray(x), token_ids=jnp.asarray(tokens), real=jnp.asarray(real))
    x64 = x.astype(np.float64)
    want = R.moe(cfg, weights, f"layers.{layer}.", layer, x64, tokens)
    f = R.sub(weights, f"layers.{layer}.ffn.")
    shared = R.swiglu_expert(x64, f["shared_experts.w1.weight"], f["shared_experts.w2.weight"],
                             f["shared_experts.w3.weight"], cfg.swiglu_limit)
    got = np.asarray(got, np.float64)
    scale = np.abs(want).max()
    assert_close(got[real], want[real], 2e-5 * scale, 0, "real tokens: moe vs reference.moe (atol 2e-5 x max|y|)")
    assert_close(got[~real], shared[~real], 2e-5 * scale, 0, "other tokens: the shared expert alone")
    assert np.abs(want[~real] - shared[~real]).max() > 100 * 2e-5 * scale, "the routed sum must be visible here"


@pytest.mark.parametrize("layer", [1, 3], ids=["hash", "score"])
def test_moe_decode_kernels_give_rows_that_are_not_real_the_first_real_rows_experts(tiny, layer):
    """On the decode kernels' path (a step of at most MAX_KERNEL_TOKENS rows, interpret plan) a row that is not real
    takes the first real row's input, so its routed parts are that row's (the step reads no expert for it alone);
    the real rows' parts are those of a call without `real`."""
    from dsv4_jax.ops import moe_ffn
    from dsv4_jax.run_context import RunContext
    cfg, params, _ = tiny
    ctx = RunContext.create(dtype="float32", kernels="interpret").in_phase("decode")
    rng = np.random.default_rng(71 + layer)
    x = jnp.asarray(rng.standard_normal((8, cfg.dim)) * 3, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, 8), jnp.int32)
    ffn = params["layers"][layer]["ffn"]
    assert moe_ffn._takes_ffn_kernels(ffn, cfg, x, ctx)
    real = np.array([False, False, True, False, True, True, False, True])
    call = functools.partial(moe, ffn, cfg, hash_routed=cfg.is_hash_layer(layer), ctx=ctx)
    masked, _ = call(x, token_ids=tokens, real=jnp.asarray(real))
    whole, _ = call(x, token_ids=tokens)
    routed, whole_routed = np.asarray(masked.routed), np.asarray(whole.routed)
    np.testing.assert_array_equal(routed[real], whole_routed[real])
    np.testing.assert_array_equal(np.asarray(masked.shared)[real], np.asarray(whole.shared)[real])
    assert all(np.array_equal(routed[i], whole_routed[2]) for i in np.flatnonzero(~real))       # row 2: first real
    assert not np.allclose(whole_routed[0], whole_routed[2])                                   # (they differ)
