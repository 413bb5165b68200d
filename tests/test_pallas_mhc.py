"""The mHC site kernels (dsv4_jax/pallas_kernels/mhc.py) in Pallas interpret mode against float64 numpy
(tests/reference_np.py) and against the pure-jnp path they replace (ops/mhc_site.py hc_post + hc_pre + rms_norm).

The kernels sum the long reductions (24 mixing dot products over n * D values, the RMS of the streams and of u) in
chunks, so they agree with the jnp path to float32 rounding, not bit for bit; the float32 checks have tolerances
far below what a wrong coefficient, a wrong chunk or a transposed comb would give (each such bug is injected below
and must fail them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import presets
from dsv4_jax.config import ModelConfig
from dsv4_jax.ops import choice, mhc_site
from dsv4_jax.pallas_kernels import mhc
from dsv4_jax.run_context import RunContext

import reference_np as R


def _cfg(dim: int) -> ModelConfig:
    return dataclasses.replace(presets.named("tiny"), dim=dim)


def _inputs(rng, lead, dim, dtype):
    n = 4
    cfg = _cfg(dim)
    X = rng.standard_normal((*lead, n, dim)).astype(np.float32)
    fn = (rng.standard_normal((24, n * dim)) * (n * dim) ** -0.5).astype(np.float32)
    base = rng.standard_normal(24).astype(np.float32) * 0.5
    scale = np.array([0.7, 0.9, 1.3], np.float32)
    weight = (1.0 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
    y = rng.standard_normal((*lead, dim)).astype(np.float32)
    post = (2.0 / (1.0 + np.exp(-rng.standard_normal((*lead, n))))).astype(np.float32)
    comb = R.sinkhorn(rng.standard_normal((*lead, n, n)), 20, 1e-6).astype(np.float32)
    cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731  (values on dtype's grid)
    return cfg, cast(X), fn, base, scale, weight, cast(y), post, comb


def _numpy_site(cfg, X, fn, base, scale, weight, post_mix, bf16: bool = False):
    """float64: [hc_post] -> hc_pre -> rms_norm. `bf16`: X' (hc_post's output) and u rounded to bf16 where the
    model rounds them (bf16 streams); the result then also holds bounds on what a kernel may differ by elementwise
    (below)."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    def to_bf16(a):
        return np.asarray(jnp.asarray(a.astype(np.float32), jnp.bfloat16).astype(jnp.float32), np.float64)

    X = f(X)
    if post_mix is not None:
        X = R.hc_post(*(f(a) for a in post_mix[:1]), X, *(f(a) for a in post_mix[1:]))
        X = to_bf16(X) if bf16 else X
    u, post, comb = R.hc_pre(X, f(fn), f(base), f(scale), cfg)
    if not bf16:
        return R.rms_norm(u, f(weight), cfg.norm_eps), post, comb, X
    u = to_bf16(u)
    x = R.rms_norm(u, f(weight), cfg.norm_eps)
    # float32 sums that differ from these in the last bit may round an element of X' or of u, or x itself, one bf16
    # step (<= 2^-7 of its value) the other way; a step of X'_i moves u by pre_i * step, so x may differ by
    # r |w| 2^-7 (sum_i pre_i |X'_i| + |u|) + 2^-7 |x| (r = 1 / rms(u)); post and comb only through sums of
    # 16K products, far below 1e-4.
    n = cfg.hc_mult
    v = X.reshape(X.shape[:-2] + (-1,))
    rho = 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + cfg.norm_eps)
    pre = 1.0 / (1.0 + np.exp(-((rho * (v @ f(fn).T))[..., :n] * f(scale)[0] + f(base)[:n]))) + cfg.hc_eps
    r = 1.0 / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + cfg.norm_eps)
    spread = np.einsum("...i,...id->...d", pre, np.abs(X)) + np.abs(u)
    bounds = (2.0 ** -7 * (r * np.abs(f(weight)) * spread + np.abs(x)) + 1e-6, 1e-4 * np.max(np.abs(post)),
              1e-4 * np.max(np.abs(comb)), 2.0 ** -7 * np.abs(X) + 1e-6)
    return (x, post, comb, X), bounds


def _assert_within(got, want, bounds, what):
    for name, g, w, b in zip(("x", "post", "comb", "streams"), got, want, bounds):
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        over = np.abs(g - w) > b
        assert not over.any(), f"{what} {name}: {over.sum()} elements beyond their bound, e.g. {g[over][:3]} vs " \
                               f"{w[over][:3]}"


def _kernel(cfg, X, fn, base, scale, weight, post_mix, dtype, fn_kernel=mhc.mhc_pre_norm, rows_per_program=0):
    args = [jnp.asarray(X, dtype), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale), jnp.asarray(weight)]
    pend = None if post_mix is None else (jnp.asarray(post_mix[0], dtype), jnp.asarray(post_mix[1]),
                                         jnp.asarray(post_mix[2]))
    run = jax.jit(lambda X, fn, b, s, w, p: fn_kernel(X, fn, b, s, w, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps,
                                                      sinkhorn_iters=cfg.hc_sinkhorn_iters, post_mix=p,
                                                      rows_per_program=rows_per_program, interpret=True))
    return [np.asarray(jnp.asarray(a, jnp.float32)) for a in run(*args, pend)]


@pytest.mark.parametrize("dim, lead, with_post_mix", [(256, (2, 3), True), (384, (3,), False), (384, (1, 2), True)])
def test_float32_site_matches_float64(dim, lead, with_post_mix):
    """D = 256: two mixing chunks, one collapse chunk; D = 384: three of each (the chunk loops)."""
    rng = np.random.default_rng(dim + len(lead))
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, lead, dim, jnp.float32)
    post_mix = (y, post, comb) if with_post_mix else None
    want = _numpy_site(cfg, X, fn, base, scale, weight, post_mix)
    got = _kernel(cfg, X, fn, base, scale, weight, post_mix, jnp.float32)
    for name, g, w, tol in zip(("x", "post", "comb", "streams"), got, want, (2e-5, 1e-6, 2e-6, 1e-6)):
        err = np.max(np.abs(g - w)) / np.max(np.abs(w))
        assert err < tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol})"


def test_bfloat16_site_matches_float64_with_its_roundings():
    """bf16 streams: the kernels round X' and u to bf16 where hc_post / hc_pre do; against float64 with the same
    roundings, within what a rounding that falls the other way can move (_numpy_site's bounds). (The jnp path on
    a GPU is no oracle here: XLA:GPU's default xla_allow_excess_precision drops f32 -> bf16 -> f32 round trips.)"""
    rng = np.random.default_rng(5)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (2, 2), 256, jnp.bfloat16)
    got = _kernel(cfg, X, fn, base, scale, weight, (y, post, comb), jnp.bfloat16)
    want, bounds = _numpy_site(cfg, X, fn, base, scale, weight, (y, post, comb), bf16=True)
    _assert_within(got, want, bounds, "bf16")
    assert np.mean(got[0] == np.asarray(jnp.asarray(want[0], jnp.bfloat16).astype(jnp.float32))) > 0.9, \
        "x: most bf16 elements must agree exactly"


@pytest.mark.parametrize("dim, lead, rows_per_program, with_post_mix",
                         [(256, (2, 32), 32, True), (384, (64,), 16, False), (384, (1, 48), 16, True)])
def test_prefill_schedule_float32_matches_float64(dim, lead, rows_per_program, with_post_mix):
    """The prefill schedule (R rows per program against each chunk of fn, the partials as float32 dots): 2-3
    mixing chunks, 2-4 row blocks, with and without the hc_post due."""
    rng = np.random.default_rng(dim + rows_per_program)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, lead, dim, jnp.float32)
    post_mix = (y, post, comb) if with_post_mix else None
    want = _numpy_site(cfg, X, fn, base, scale, weight, post_mix)
    got = _kernel(cfg, X, fn, base, scale, weight, post_mix, jnp.float32, rows_per_program=rows_per_program)
    for name, g, w, tol in zip(("x", "post", "comb", "streams"), got, want, (2e-5, 1e-6, 2e-6, 1e-6)):
        err = np.max(np.abs(g - w)) / np.max(np.abs(w))
        assert err < tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol})"


def test_prefill_schedule_bfloat16_matches_float64_with_its_roundings():
    """bf16 streams on the prefill schedule, within the bounds of float64 with the model's bf16 roundings."""
    rng = np.random.default_rng(6)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (2, 16), 256, jnp.bfloat16)
    got = _kernel(cfg, X, fn, base, scale, weight, (y, post, comb), jnp.bfloat16, rows_per_program=16)
    want, bounds = _numpy_site(cfg, X, fn, base, scale, weight, (y, post, comb), bf16=True)
    _assert_within(got, want, bounds, "bf16 prefill")
    assert np.mean(got[0] == np.asarray(jnp.asarray(want[0], jnp.bfloat16).astype(jnp.float32))) > 0.9


def test_prefill_schedule_refuses_rows_it_does_not_tile():
    rng = np.random.default_rng(1)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (24,), 128, jnp.float32)
    with pytest.raises(ValueError, match="power of two dividing the 24 rows"):
        _kernel(cfg, X, fn, base, scale, weight, None, jnp.float32, rows_per_program=16)


def test_model_prefill_takes_the_prefill_schedule_and_equals_the_jnp_path():
    """The tiny preset at D = 128 (a width the kernels take), float32: a 48-token prompt prefilled on the interpret
    plan with every other op on the reference takes the prefill schedule at every site and gives the reference
    plan's logits; a 3-token prompt (rows not a multiple of 16) keeps the jnp path."""
    from one_op_prefill import one_op_prefill

    cfg = dataclasses.replace(presets.tiny(), dim=128)
    prefill = one_op_prefill(cfg, "mhc_site", seed=3, max_seq_len=256)
    for length, expected in ((48, {"mhc_prefill"}), (3, {None})):
        err, choices = prefill(np.random.default_rng(length).integers(0, cfg.vocab_size, (1, length)).astype(np.int32))
        assert {c.kernel for c in choices if c.phase == "prefill"} == expected, choices
        assert err < 1e-5, (length, err)


@pytest.mark.parametrize("rows, expected", [(160, "mhc_wide_step"), (130, None), (128, "mhc")])
def test_decode_step_wider_than_the_row_kernel_takes_the_rows_schedule(rows, expected):
    """A decode step's site of more than mhc.MAX_ROWS rows (a serving batch of 256, here 160) takes the schedule of
    16 rows per program on a kernel plan, one of rows not a multiple of 16 keeps the jnp path, and up to MAX_ROWS the
    one-row kernel; float32, each against float64 (outputs poisoned where the kernel writes nothing: every row is
    checked)."""
    rng = np.random.default_rng(rows)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (rows, 1), 128, jnp.float32)
    want = _numpy_site(cfg, X, fn, base, scale, weight, (y, post, comb))
    ctx = RunContext.create(kernels="interpret", dtype="float32").in_phase("decode")
    with choice.record_dispatch("mhc_site") as choices:
        got = jax.jit(lambda *a: mhc_site.pre_norm(*a[:5], cfg, ctx, post_mix=a[5]))(
            *(jnp.asarray(a) for a in (X, fn, base, scale, weight)), tuple(jnp.asarray(a) for a in (y, post, comb)))
    assert choices[0].kernel == expected, choices          # the site's choice (then the jnp path's Sinkhorn's)
    for name, g, w, tol in zip(("x", "post", "comb", "streams"), got, want, (2e-5, 1e-6, 2e-6, 1e-6)):
        err = np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w))
        assert err < tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol})"


def test_cuda_lowering_of_the_prefill_schedule_at_flash_geometry():
    """A 2,048-token chunk's site at Flash width lowered for an H200 without a GPU: two Triton kernels, the first on
    the prefill schedule."""
    cfg = presets.flash()
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    sds = jax.ShapeDtypeStruct
    n, dim, rows = cfg.hc_mult, cfg.dim, 2048
    fn = jax.jit(lambda X, f, b, s, w, y, p, c: mhc.mhc_pre_norm(
        X, f, b, s, w, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters,
        post_mix=(y, p, c), rows_per_program=mhc.prefill_rows_per_program(rows)))
    args = (sds((1, rows, n, dim), jnp.bfloat16), sds((24, n * dim), jnp.float32), sds((24,), jnp.float32),
            sds((3,), jnp.float32), sds((dim,), jnp.bfloat16), sds((1, rows, dim), jnp.bfloat16),
            sds((1, rows, n), jnp.float32), sds((1, rows, n, n), jnp.float32))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2 and "mhc_post_mix_rows" in text


def test_model_site_dispatch_interpret_equals_reference():
    """mhc_site.pre_norm takes the kernels on a kernel plan ("interpret" here) and the jnp path on the reference
    plan; float32, the two agree to rounding."""
    rng = np.random.default_rng(11)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (2, 1), 128, jnp.float32)
    outs = []
    for kernels in ("interpret", "reference"):
        ctx = RunContext.create(kernels=kernels, dtype="float32").in_phase("decode")
        outs.append(jax.jit(lambda *a, ctx=ctx: mhc_site.pre_norm(*a[:5], cfg, ctx, post_mix=a[5]))(
            X, fn, base, scale, weight, (y, post, comb)))
    for name, g, w in zip(("x", "post", "comb", "streams"), *outs):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("bug", ["comb not transposed", "streams' RMS over D instead of n * D",
                                 "one mixing chunk dropped"])
def test_injected_bugs_fail(bug, monkeypatch):
    """The float32 check above catches each of these mistakes in the kernels."""
    if bug == "comb not transposed":
        def post_mix(x, y_refs, post_ref, comb_ref, dtype):
            comb = comb_ref[0, :, :]
            mixed = jnp.sum(comb[:, :, None] * x[None, :, :], axis=1)         # sum_k C[j, k] X_k
            return post_ref[0, :][:, None] * y_refs[0][0, :].astype(jnp.float32)[None, :] + mixed
        monkeypatch.setattr(mhc, "_post_mix", post_mix)
    elif bug == "streams' RMS over D instead of n * D":
        inner = mhc._collapse_norm_kernel
        monkeypatch.setattr(mhc, "_collapse_norm_kernel",
                            lambda *refs, n_dim, **kw: inner(*refs, n_dim=n_dim // 4, **kw))
    else:
        inner = mhc._collapse_norm_kernel
        monkeypatch.setattr(mhc, "_collapse_norm_kernel",
                            lambda *refs, n_parts, **kw: inner(*refs, n_parts=n_parts - 1, **kw))
    rng = np.random.default_rng(3)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (2,), 384, jnp.float32)
    want = _numpy_site(cfg, X, fn, base, scale, weight, (y, post, comb))
    got = _kernel(cfg, X, fn, base, scale, weight, (y, post, comb), jnp.float32)
    errs = [np.max(np.abs(g - w)) / np.max(np.abs(w)) for g, w in zip(got, want)]
    assert max(e / t for e, t in zip(errs, (2e-5, 1e-6, 2e-6, 1e-6))) > 10, errs


def test_unsupported_geometry_is_refused():
    X = jnp.ones((1, 4, 100), jnp.float32)
    with pytest.raises(ValueError, match="D a multiple of 128"):
        mhc.mhc_pre_norm(X, jnp.ones((24, 400)), jnp.ones(24), jnp.ones(3), None, norm_eps=1e-6, hc_eps=1e-6,
                         sinkhorn_iters=20)


# ---- on the GPU -----------------------------------------------------------------------------------------------
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dim, lead", [(4096, (1, 1)), (4096, (8, 1)), (7168, (2, 3)), (4096, (1, 512))])
def test_gpu_site_matches_float64(dim, lead):
    """The compiled Triton kernels at Flash (4096) and Pro (7168: 56 mixing chunks, 7 collapse chunks) width, at
    decode (1 and 8 rows) and a prefill chunk's row count, float32 against float64 numpy; and bf16 streams within
    the bounds of float64 with the bf16 roundings (test_bfloat16_site_matches_float64_with_its_roundings)."""
    rng = np.random.default_rng(264)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, lead, dim, jnp.float32)
    want = _numpy_site(cfg, X, fn, base, scale, weight, (y, post, comb))
    run = jax.jit(lambda X, fn, b, s, w, p: mhc.mhc_pre_norm(X, fn, b, s, w, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps,
                                                             sinkhorn_iters=cfg.hc_sinkhorn_iters, post_mix=p))
    got = run(X, fn, base, scale, weight, (y, post, comb))
    for name, g, w, tol in zip(("x", "post", "comb", "streams"), got, want, (2e-5, 1e-6, 2e-6, 1e-6)):
        err = np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w))
        assert err < tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol})"
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    got = run(bf(X), fn, base, scale, weight, (bf(y), post, comb))
    X, y = (np.asarray(bf(a).astype(jnp.float32)) for a in (X, y))
    want, bounds = _numpy_site(cfg, X, fn, base, scale, weight, (y, post, comb), bf16=True)
    _assert_within(got, want, bounds, "bf16")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dim, rows", [(4096, 2048), (7168, 512)])
def test_gpu_prefill_schedule_matches_float64(dim, rows):
    """The compiled prefill schedule at Flash and Pro width, float32 against float64 numpy."""
    rng = np.random.default_rng(dim + rows)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (1, rows), dim, jnp.float32)
    want = _numpy_site(cfg, X, fn, base, scale, weight, (y, post, comb))
    got = jax.jit(lambda X, fn, b, s, w, p: mhc.mhc_pre_norm(
        X, fn, b, s, w, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters, post_mix=p,
        rows_per_program=mhc.prefill_rows_per_program(rows)))(X, fn, base, scale, weight, (y, post, comb))
    for name, g, w, tol in zip(("x", "post", "comb", "streams"), got, want, (2e-5, 1e-6, 2e-6, 1e-6)):
        err = np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w))
        assert err < tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol})"


def test_float32_y_is_rounded_to_the_streams_dtype():
    """A float32 y (a matmul kernel's output, handed over uncast) gives the kernels and the jnp path the results
    of y rounded to the streams' dtype (bf16 here) first: each equal to its run on the rounded y."""
    rng = np.random.default_rng(12)
    cfg, X, fn, base, scale, weight, y, post, comb = _inputs(rng, (2, 1), 256, jnp.bfloat16)
    y32 = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)            # not on the bf16 grid
    for kernels in ("interpret", "reference"):
        ctx = RunContext.create(kernels=kernels, dtype="bfloat16").in_phase("decode")
        run = jax.jit(lambda X, y, ctx=ctx: mhc_site.pre_norm(X, fn, base, scale, weight, cfg, ctx,
                                                              post_mix=(y, post, comb)))
        X16 = jnp.asarray(X, jnp.bfloat16)
        for g, w in zip(run(X16, y32), run(X16, y32.astype(jnp.bfloat16))):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=kernels)
