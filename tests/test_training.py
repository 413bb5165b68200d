"""What training needs from the model, asked for through the run context (`Training`): straight-through roundings,
the indexer's KL loss, expert loads and capacity-slot experts; and scripts/train_tiny.py's loss on top of them.

The references here are float64 numpy (the KL, the capacity rule) or the model's own inference path where the
claim is "training changes no forward value".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import presets
from dsv4_jax.layers.indexer_loss import indexer_kl
from dsv4_jax.ops.moe_ffn import capacity_routed_experts, routed_experts
from dsv4_jax.numerics.fake_quant import fp4_fake_quant, fp8_fake_quant, hadamard, trained_rounding
from dsv4_jax.run_context import RunContext, Training
from scripts.train_tiny import build_tree, forward_losses, init_train_params, quant_names

INFERENCE = RunContext.create(dtype="float32", kernels="reference")
TRAINING = INFERENCE.replace(training=Training())


@pytest.mark.parametrize("rounding", ["fp8", "fp4"])
def test_roundings_are_straight_through_only_under_training(rounding):
    """The same rounded values either way; the gradient is the identity under training and zero (JAX's derivative
    of a cast to float8 / float4) otherwise."""
    fn = fp8_fake_quant if rounding == "fp8" else lambda v: fp4_fake_quant(hadamard(v))
    rng = np.random.default_rng(34)
    x = jnp.asarray(rng.standard_normal((3, 128)) * 4, jnp.float32)
    g = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    for ctx, want_grad in ((TRAINING, g if rounding == "fp8" else None), (INFERENCE, 0 * g)):
        value, vjp = jax.vjp(lambda v: trained_rounding(fn, v, ctx), x)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(fn(x)))
        (grad,) = vjp(g)
        if want_grad is not None:
            np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))
    # FP4 site: the rounding is straight-through, the Hadamard before it is an ordinary (orthogonal) linear map
    if rounding == "fp4":
        _, vjp = jax.vjp(lambda v: trained_rounding(fp4_fake_quant, hadamard(v), TRAINING), x)
        np.testing.assert_allclose(np.asarray(vjp(g)[0]), np.asarray(jax.vjp(hadamard, x)[1](g)[0]), atol=1e-5)


def _indexer_kl_np(q, compressed, scores, visible):
    q, c, s = (np.asarray(a, np.float64) for a in (q, compressed, scores))
    logits = np.einsum("bshd,bnd->bshn", q, c) / math.sqrt(q.shape[-1])
    total, rows = 0.0, 0
    for b, t in np.ndindex(*visible.shape[:2]):
        v = visible[b, t]
        if not v.any():
            continue
        p = np.exp(logits[b, t][:, v] - logits[b, t][:, v].max(-1, keepdims=True))
        target = (p / p.sum(-1, keepdims=True)).sum(0)
        target /= target.sum()
        log_pred = s[b, t][v] - s[b, t][v].max()
        log_pred -= np.log(np.exp(log_pred).sum())
        total += np.sum(target * (np.log(np.maximum(target, 1e-9)) - log_pred))
        rows += 1
    return total / max(rows, 1)


def test_indexer_kl_against_float64_and_trains_only_the_scores():
    rng = np.random.default_rng(68)
    B, S, H, hd, N = 2, 12, 3, 16, 5
    q = rng.standard_normal((B, S, H, hd)).astype(np.float32)
    comp = rng.standard_normal((B, N, hd)).astype(np.float32)
    scores = (rng.standard_normal((B, S, N)) * 3).astype(np.float32)
    positions = np.broadcast_to(np.arange(S), (B, S))
    visible = np.arange(N)[None, None, :] < ((positions + 1) // 4)[:, :, None]       # first 3 queries see none
    got, grads = jax.value_and_grad(indexer_kl, argnums=(0, 1, 2))(q, comp, scores, jnp.asarray(visible))
    want = _indexer_kl_np(q, comp, scores, visible)
    assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want)), (float(got), want)
    assert not np.asarray(grads[0]).any() and not np.asarray(grads[1]).any(), "the target must be constant"
    assert np.asarray(grads[2])[visible].any() and not np.asarray(grads[2])[~visible].any()


def _capacity_np(x, w1, w3, w2, ids, weights, factor, limit):
    """GShard capacity dispatch in float64: assignments in token order (then slot order), each expert keeps its
    first C = ceil(factor * T * K / E)."""
    T, K = ids.shape
    E = w1.shape[0]
    cap = max(1, math.ceil(factor * T * K / E))
    seen = np.zeros(E, int)
    y = np.zeros((T, x.shape[1]))
    for t, k in np.ndindex(T, K):
        e = ids[t, k]
        seen[e] += 1
        if seen[e] > cap:
            continue
        gate, up = np.minimum(w1[e] @ x[t], limit), np.clip(w3[e] @ x[t], -limit, limit)
        y[t] += weights[t, k] * (w2[e] @ (gate / (1 + np.exp(-gate)) * up))
    return y, int(np.sum(np.maximum(seen - cap, 0)))


@pytest.mark.parametrize("factor", [0.75, 8.0], ids=["drops", "no-drops"])
def test_capacity_experts_against_float64(factor):
    """Capacity-slot experts equal the float64 GShard rule; with room for every assignment they equal the grouped
    matmul of the inference path."""
    cfg = presets.tiny()
    rng = np.random.default_rng(105)
    T, E, D, F = 24, cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = {p: (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
         for p, shape in (("w1", (E, F, D)), ("w3", (E, F, D)), ("w2", (E, D, F)))}
    ids = np.stack([rng.choice(E, cfg.n_activated_experts, replace=False, p=np.linspace(1, 3, E) / np.linspace(
        1, 3, E).sum()) for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.2, 1.0, ids.shape).astype(np.float32)
    params = {p: {"weight": jnp.asarray(v)} for p, v in w.items()}
    got = jax.jit(functools.partial(capacity_routed_experts, cfg=cfg, capacity_factor=factor))(
        params, x=jnp.asarray(x), expert_ids=jnp.asarray(ids), weights=jnp.asarray(weights))
    want, dropped = _capacity_np(x.astype(np.float64), *(w[p].astype(np.float64) for p in ("w1", "w3", "w2")),
                                 ids, weights, factor, cfg.swiglu_limit)
    assert (dropped > 0) == (factor < 1), dropped
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5 * np.abs(want).max())
    if factor >= 1:
        grouped = routed_experts(params, cfg, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), INFERENCE)
        np.testing.assert_allclose(np.asarray(got), np.asarray(grouped), atol=2e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def tiny_training():
    """train_tiny's loss on two layers of the tiny preset (CSA + hash routing, HCA + score routing, then the MTP
    block: every mechanism, half the tracing) and a batch."""
    cfg = presets.tiny().replace(n_layers=2, compress_ratios=(4, 128, 0), n_hash_layers=1)
    params_np, buffers_np = init_train_params(cfg, seed=0)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, cfg.vocab_size, (1, 134)).astype(np.int32)    # 132 positions: an HCA entry too
    inputs, targets, nxt = tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]
    ones = np.ones(inputs.shape, np.float32)
    batch = tuple(jnp.asarray(a) for a in (inputs, targets, ones, nxt, ones))
    qnames = tuple(frozenset(s) for s in quant_names(cfg))
    return cfg, jax.device_put(params_np), jax.device_put(buffers_np), batch, qnames


def test_training_forward_returns_statistics_and_trains_the_indexer_only_through_its_loss(tiny_training):
    cfg, params, buffers, batch, qnames = tiny_training

    def losses(params, ctx):
        ms, mc, ts, tc, kl, loads = forward_losses(params, buffers, *batch, jnp.float32(0), cfg=cfg, ctx=ctx,
                                                   qnames=qnames)
        return ms / mc, ts / tc, kl, loads

    @jax.jit
    def run(params):
        (main, mtp, kl, loads), vjp = jax.vjp(lambda p: losses(p, TRAINING), params)
        zero = jnp.zeros_like(main)
        (main_grad,) = vjp((jnp.ones_like(main), zero, zero, jnp.zeros_like(loads)))
        (kl_grad,) = vjp((zero, zero, jnp.ones_like(kl), jnp.zeros_like(loads)))
        inference_main = losses(params, INFERENCE)[0]
        return main, mtp, kl, loads, main_grad, kl_grad, inference_main

    main, mtp, kl, loads, main_grad, kl_grad, inference_main = run(params)
    # training changes no forward value (the roundings are the same; moe_capacity 0: the same grouped experts)
    assert abs(float(main) - float(inference_main)) <= 1e-6 * abs(float(main))
    assert np.isfinite(float(mtp)) and float(kl) > 0
    # expert loads: one row per score-routed block (backbone layer 1 and the MTP block), every assignment
    tokens = batch[0].size
    score_routed = [i for i in range(cfg.n_layers + cfg.n_mtp_layers) if i >= cfg.n_hash_layers]
    assert loads.shape == (len(score_routed), cfg.n_routed_experts)
    assert (np.asarray(loads).sum(-1) == tokens * cfg.n_activated_experts).all()
    # the indexer's loss reaches the indexer's weights (its projections and its compressor) and nothing else;
    # the language-model loss never reaches them (top-k has no gradient)
    indexer = {n for n in params if ".attn.indexer." in n}
    kl_reached = {n for n, g in kl_grad.items() if np.asarray(g).any()}
    assert kl_reached and kl_reached <= indexer, sorted(kl_reached - indexer)
    assert {f"layers.0.attn.indexer.{w}" for w in ("wq_b.weight", "weights_proj.weight",
                                                  "compressor.wkv.weight")} <= kl_reached
    assert not any(np.asarray(main_grad[n]).any() for n in indexer)
    # straight-through: the window KV projection gets a gradient through its FP8-rounded nope dims as well
    wkv = np.asarray(main_grad["layers.0.attn.wkv.weight"])
    nope = cfg.head_dim - cfg.rope_head_dim
    assert np.abs(wkv[:nope]).max() > 1e-3 * np.abs(wkv).max()
