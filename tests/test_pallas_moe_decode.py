"""The MoE decode kernels (dsv4_jax/pallas_kernels/moe_decode.py) in Pallas interpret mode against float64 numpy
references written from the spec (docs/model.md 4.6): the router's top-k, weights and rows, the clamped SwiGLU of
the routed and shared experts; the mHC kernel summing the MoE's parts; the model's decode on these kernels against
the jnp path; the lowering for an H200; and (marker gpu) the compiled kernels on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.pallas_kernels import mhc
from dsv4_jax.pallas_kernels import moe_decode as kernel
from kernel_decode_checks import decode_matches_reference

LIMIT = 10.0


def _softplus64(x):
    return np.logaddexp(x, 0.0)


def _route64(logits, k, scale, bias=None, hash_ids=None):
    """float64 reference: (ids [T, K], weights [T, K])."""
    scores = np.sqrt(_softplus64(np.asarray(logits, np.float64)))
    if hash_ids is None:
        ids = np.argsort(-(scores + np.asarray(bias, np.float64)), axis=1, kind="stable")[:, :k]
    else:
        ids = np.asarray(hash_ids)
    picked = np.take_along_axis(scores, ids, axis=1)
    return ids, picked / picked.sum(axis=1, keepdims=True) * scale


def _spaced_logits(rng, tokens, experts):
    """Logits whose biased scores are far apart (a grid of step 0.05 in random order, bias 0), so that no float32
    rounding can reorder them: the picks are decided by the values, not by rounding."""
    return np.stack([rng.permutation(experts) * 0.05 - 3.0 for _ in range(tokens)]).astype(np.float32)


@pytest.mark.parametrize("tokens, experts, k, dim", [(1, 256, 6, 4096), (3, 16, 4, 256), (2, 8, 2, 128)])
def test_route_rows_matches_float64(tokens, experts, k, dim):
    rng = np.random.default_rng(tokens * 100 + experts)
    logits = _spaced_logits(rng, tokens, experts)
    bias = np.zeros(experts, np.float32)
    x = rng.standard_normal((tokens, dim)).astype(np.float32)
    ids, weights, rows = kernel.route_rows(jnp.asarray(logits), jnp.asarray(x, jnp.bfloat16), k=k, route_scale=1.5,
                                           bias=jnp.asarray(bias), interpret=True)
    want_ids, want_weights = _route64(logits, k, 1.5, bias=bias)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights, np.float64), want_weights, rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(rows, np.float32),
                                  np.repeat(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), k, axis=0))


def test_route_rows_bias_picks_and_ties_go_to_the_lower_index():
    """The bias decides the picks (not the weights): a large bias on experts with the lowest scores puts them first;
    equal biased scores are taken lowest index first, as lax.top_k takes them."""
    experts, k = 16, 4
    logits = np.zeros((2, experts), np.float32)        # every score equal: only the bias orders them
    bias = np.zeros(experts, np.float32)
    bias[[11, 3, 7]] = [2.0, 1.0, 1.0]                 # 11 first, then the tie 3 / 7, then the tie of the rest: 0
    logits[1] = np.linspace(-0.1, 0.1, experts)        # row 1: scores rise with the index, less than the bias
    x = np.ones((2, 128), np.float32)
    ids, weights, _ = kernel.route_rows(jnp.asarray(logits), jnp.asarray(x), k=k, route_scale=1.0,
                                        bias=jnp.asarray(bias), interpret=True)
    want_ids, want_weights = _route64(logits, k, 1.0, bias=bias)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights, np.float64), want_weights, rtol=2e-6)
    assert list(np.asarray(ids)[0]) == [11, 3, 7, 0] and list(np.asarray(ids)[1]) == [11, 7, 3, 15]


def test_route_rows_hash_routed():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((3, 32)).astype(np.float32) * 2
    hash_ids = np.stack([rng.permutation(32)[:6] for _ in range(3)]).astype(np.int32)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ids, weights, rows = kernel.route_rows(jnp.asarray(logits), jnp.asarray(x), k=6, route_scale=2.5,
                                           hash_ids=jnp.asarray(hash_ids), interpret=True)
    want_ids, want_weights = _route64(logits, 6, 2.5, hash_ids=hash_ids)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights, np.float64), want_weights, rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(rows), np.repeat(x, 6, axis=0))


def _swiglu64(gate_up, weights=None):
    gate_up = np.asarray(gate_up, np.float64)
    f = gate_up.shape[1] // 2
    gate, up = np.minimum(gate_up[:, :f], LIMIT), np.clip(gate_up[:, f:], -LIMIT, LIMIT)
    h = gate / (1 + np.exp(-gate)) * up
    return h if weights is None else h * np.asarray(weights, np.float64)[:, None]


@pytest.mark.parametrize("rows, tokens, f", [(6, 1, 2048), (12, 2, 64), (2, 1, 32)])
def test_swiglu_pairs_matches_float64(rows, tokens, f):
    """Values well past the clamp (|x| up to 25 against a limit of 10) on both sides; float32 outputs to float32
    rounding, bfloat16 outputs within one bfloat16 rounding of the float64 value."""
    rng = np.random.default_rng(rows + f)
    gate_up = (rng.standard_normal((rows, 2 * f)) * 8).astype(np.float32)
    shared = (rng.standard_normal((tokens, 2 * f)) * 8).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, rows).astype(np.float32)
    assert np.abs(gate_up).max() > 2 * LIMIT and (gate_up < -LIMIT).any()
    want_h, want_shared = _swiglu64(gate_up, weights), _swiglu64(shared)
    for dtype, rtol in ((jnp.float32, 2e-6), (jnp.bfloat16, 2.0 ** -8)):
        h, shared_h = kernel.swiglu_pairs(jnp.asarray(gate_up), jnp.asarray(weights), jnp.asarray(shared),
                                          limit=LIMIT, dtype=dtype, interpret=True)
        assert h.dtype == dtype and h.shape == (rows, f) and shared_h.shape == (tokens, f)
        for got, want in ((h, want_h), (shared_h, want_shared)):
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=1e-30)


def test_unsupported_inputs_are_refused():
    with pytest.raises(ValueError, match="power-of-two number of experts"):
        kernel.route_rows(jnp.zeros((1, 12)), jnp.zeros((1, 128)), k=2, route_scale=1.0, bias=jnp.zeros(12))
    with pytest.raises(ValueError, match="exactly one of bias"):
        kernel.route_rows(jnp.zeros((1, 16)), jnp.zeros((1, 128)), k=2, route_scale=1.0)
    with pytest.raises(ValueError, match="one hidden width"):
        kernel.swiglu_pairs(jnp.zeros((2, 64)), jnp.zeros(2), jnp.zeros((1, 128)), limit=1.0, dtype=jnp.float32)


def test_mhc_kernel_sums_the_moe_parts_as_moe_parts_total():
    """The mHC post-mix kernel given the MoE's parts equals the same kernel given their total (MoeParts.total, the
    order both use): bit for bit on the CPU, and that total is the float64 sum to float32 rounding."""
    from dsv4_jax.ops.moe_ffn import MoeParts

    rng = np.random.default_rng(9)
    rows, n, dim, k = 2, 4, 256, 6
    X = jnp.asarray(rng.standard_normal((rows, n, dim)), jnp.bfloat16)
    fn = jnp.asarray(rng.standard_normal((24, n * dim)) * 0.01, jnp.float32)
    base, scale = jnp.asarray(rng.standard_normal(24), jnp.float32), jnp.asarray([0.5, 0.4, 0.3], jnp.float32)
    parts = MoeParts(jnp.asarray(rng.standard_normal((rows, k, dim)), jnp.float32),
                     jnp.asarray(rng.standard_normal((rows, dim)), jnp.float32))
    post = jnp.asarray(rng.uniform(0, 2, (rows, n)), jnp.float32)
    comb = jnp.asarray(rng.uniform(0, 0.5, (rows, n, n)), jnp.float32)
    run = lambda y: mhc.mhc_pre_norm(X, fn, base, scale, None, norm_eps=1e-6, hc_eps=1e-6,  # noqa: E731
                                     sinkhorn_iters=20, post_mix=(y, post, comb), interpret=True)
    for got, want in zip(run(parts), run(parts.total())):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    total64 = np.asarray(parts.routed, np.float64).sum(axis=1) + np.asarray(parts.shared, np.float64)
    np.testing.assert_allclose(np.asarray(parts.total(), np.float64), total64, rtol=0, atol=1e-5)


def test_model_decode_takes_the_moe_kernels_and_equals_the_jnp_path(monkeypatch):
    """The tiny preset (8 experts, 2 per token, one hash-routed layer), float32: decode steps on a kernel plan
    ("interpret") run every layer's MoE on these kernels (both routings) and give the jnp path's logits (1e-4: the
    interpret plan's matmuls meet float32 as bf16 hi + lo parts, test_kernel_dispatch.py)."""
    from dsv4_jax import presets
    from dsv4_jax.ops import moe_ffn as moe

    cfg = presets.tiny()
    routings = []
    real = kernel.route_rows
    monkeypatch.setattr(kernel, "route_rows", lambda *a, **k: routings.append("bias" in k) or real(*a, **k))
    decode_matches_reference(cfg, 256, 40, [40, 33])
    hash_layers = sum(cfg.is_hash_layer(i) for i in range(cfg.n_layers))
    assert hash_layers and sorted(set(routings)) == [False, True] and moe.MAX_KERNEL_TOKENS >= 2


def test_cuda_lowering_at_flash_geometry():
    """Pallas -> Triton IR for an H200 without a GPU at Flash's MoE (256 experts, 6 per token, D 4096, F 2048),
    batch 4: each function one Triton kernel."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    sds = jax.ShapeDtypeStruct
    route = jax.jit(lambda logits, x, bias: kernel.route_rows(logits, x, k=6, route_scale=1.5, bias=bias))
    hashed = jax.jit(lambda logits, x, ids: kernel.route_rows(logits, x, k=6, route_scale=1.5, hash_ids=ids))
    swiglu = jax.jit(lambda g, w, s: kernel.swiglu_pairs(g, w, s, limit=LIMIT, dtype=jnp.bfloat16))
    calls = [(route, (sds((4, 256), jnp.float32), sds((4, 4096), jnp.bfloat16), sds((256,), jnp.float32))),
             (hashed, (sds((4, 256), jnp.float32), sds((4, 4096), jnp.bfloat16), sds((4, 6), jnp.int32))),
             (swiglu, (sds((24, 4096), jnp.float32), sds((24,), jnp.float32), sds((4, 4096), jnp.float32)))]
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        for fn, args in calls:
            assert fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 1


# ---- on the GPU -----------------------------------------------------------------------------------------------
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gpu_matches_float64_at_flash_geometry():
    """The compiled Triton kernels at Flash geometry, batch 4: the picks exactly (scores far apart), weights and
    SwiGLU outputs to float32 rounding, the rows copied exactly."""
    rng = np.random.default_rng(11)
    logits = _spaced_logits(rng, 4, 256)
    bias = np.zeros(256, np.float32)
    x = jnp.asarray(rng.standard_normal((4, 4096)), jnp.bfloat16)
    ids, weights, rows = jax.jit(lambda lg, x, b: kernel.route_rows(lg, x, k=6, route_scale=1.5, bias=b))(
        jnp.asarray(logits), x, jnp.asarray(bias))
    want_ids, want_weights = _route64(logits, 6, 1.5, bias=bias)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights, np.float64), want_weights, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.repeat(np.asarray(x, np.float32), 6, axis=0))
    gate_up = (rng.standard_normal((24, 4096)) * 8).astype(np.float32)
    shared = (rng.standard_normal((4, 4096)) * 8).astype(np.float32)
    w = rng.uniform(0.1, 1, 24).astype(np.float32)
    h, shared_h = jax.jit(lambda g, w, s: kernel.swiglu_pairs(g, w, s, limit=LIMIT, dtype=jnp.float32))(
        jnp.asarray(gate_up), jnp.asarray(w), jnp.asarray(shared))
    np.testing.assert_allclose(np.asarray(h, np.float64), _swiglu64(gate_up, w), rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(np.asarray(shared_h, np.float64), _swiglu64(shared), rtol=1e-5, atol=1e-30)
