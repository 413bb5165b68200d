"""The mHC site (docs/model.md 4.2, 4.7): the hc_post still due from the previous sub-layer, then hc_pre and the
next sub-layer's RMSNorm, as one op.

The residual stream is `hc_mult` parallel streams X [..., n, D]. Before a sub-layer they collapse with weights
`pre`; after it, the output is added with weights `post` and the streams mix through a Sinkhorn-normalised
(nearly doubly stochastic) matrix C, consumed transposed: X'_k = post_k y + sum_j C[j, k] X_j. All coefficient
math is float32. The functions below are the op's pure-jnp reference; `pre_norm` chooses between it and the two
Pallas launches of pallas_kernels/mhc.py (ops/choice.py): one row per program in a decode or verify step of up to
mhc.MAX_ROWS rows, 16 rows per program against each chunk of the mixing matrix in a prefill chunk or a wider step
(both opt-in on GPUs). Where the site stays on the jnp path its Sinkhorn may still take the one-launch kernel of
pallas_kernels/sinkhorn.py (SINKHORN_KERNEL).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..pallas_kernels import mhc
from ..pallas_kernels import sinkhorn as sinkhorn_rows
from . import choice
from .moe_ffn import MoeParts
from .norm_rope import rms_norm


def mix_logits(X: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    flat = X.reshape(*X.shape[:-2], -1).astype(jnp.float32)
    rho = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
    return rho * jnp.einsum("...i,mi->...m", flat, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def sinkhorn(logits: jax.Array, iters: int, eps: float, unroll: bool = False) -> jax.Array:
    """Row softmax + eps, column-normalise, then (iters - 1) x (row, column) normalisation. logits [..., n, n].

    `unroll`: one straight-line chain instead of a loop. On a GPU XLA fuses the unrolled chain into one kernel,
    where the loop costs ~4 launches per iteration plus the loop's own control (a 4-layer Flash-geometry decode
    step: 667 of its 1,058 launches); on the CPU the loop compiles faster (unrolled, ~5 s per site on XLA:CPU)."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    def row_then_column(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, row_then_column, c, unroll=unroll)


@jax.named_scope("mhc")
def hc_pre(X: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, cfg: ModelConfig, normalise=None):
    """Collapse the streams X [..., n, D] for a sub-layer. Returns (u [..., D] in X.dtype, post [..., n], comb).
    `normalise`: the Sinkhorn as a function of the logits [..., n, n] (pre_norm's choice: `sinkhorn` unrolled on GPU
    plans, or pallas_kernels/sinkhorn.py); None: `sinkhorn` as a loop."""
    n = cfg.hc_mult
    m = mix_logits(X, fn, cfg.norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*m.shape[:-1], n, n)
    if normalise is None:
        normalise = functools.partial(sinkhorn, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps)
    comb = normalise(comb_logits)
    u = jnp.einsum("...n,...nd->...d", pre, X.astype(jnp.float32))
    return u.astype(X.dtype), post, comb


@jax.named_scope("mhc")
def hc_post(y, X: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k * y + sum_j comb[j, k] * X_j (note the transpose), float32 math, stored in X.dtype. y is the
    sub-layer's output in X.dtype, or in float32 to be rounded to X.dtype first, or the MoE's unsummed
    moe_ffn.MoeParts (their float32 total, rounded likewise)."""
    if isinstance(y, MoeParts):
        y = y.total()
    # A sum of broadcast products, not an einsum: XLA made the einsum a GEMM (TF32 inputs on a GPU at default
    # precision) whose float32 [..., n, D] output was written out and read back, 1 GB more per site for an
    # 8,192-token chunk of Flash; the sum over the n = 4 streams fuses into one pass over X, in float32. The barrier
    # keeps X' materialised in X's dtype: without it XLA fed the next site the float32 sum before rounding and wrote
    # that out instead (compiled for an H200: 14.4 -> 9.1 GiB read and written by a 4-layer 8K chunk's mHC sites).
    mixed = jnp.sum(comb[..., :, :, None] * X.astype(jnp.float32)[..., :, None, :], axis=-3)
    out = post[..., None] * y.astype(X.dtype).astype(jnp.float32)[..., None, :] + mixed
    return jax.lax.optimization_barrier(out.astype(X.dtype))


MHC_KERNELS = choice.Kernel("mhc_site", "mhc")
# Opt-in on GPUs (the override mhc_site=kernel): on an H100 (2026-12-06) it made an 8K prompt's time to first token
# 4% slower than XLA's path (one call each, docs/performance.md); the interpret plan takes it (tests).
MHC_PREFILL_KERNELS = choice.Kernel("mhc_site", "mhc_prefill", phases=frozenset({"prefill"}), on_gpu_by_default=False)
PREFILL_MIN_ROWS = 16        # a prefill program's dots need 16 rows (Triton's smallest dot); fewer: the reference
# The Sinkhorn alone, where the site runs on XLA's path (a prefill chunk unless mhc_site=kernel; a step of more rows
# than mhc.MAX_ROWS): one launch instead of the ~29 XLA's GPU backend splits it into from ~2,048 rows (compiled for an
# H200; pallas_kernels/sinkhorn.py). Taken by default although its time is not measured yet: it does the same float32
# arithmetic on the same 64 bytes a row in one launch instead of ~29 (if a GPU shows it slower: on_gpu_by_default=False).
SINKHORN_KERNEL = choice.Kernel("mhc_site", "mhc_sinkhorn", phases=frozenset({"prefill", "decode", "verify"}))


# A decode or verify step wider than mhc.MAX_ROWS (e.g. 256 rows of a serving batch) on the schedule of 16 rows per
# program (fn read once per 16 rows) instead of XLA's path. Opt-in (`--kernel-override mhc_site=kernel`): compiled
# for an H200 it cuts a 4-layer Flash step at 256 rows from 249 launches to 202 (mHC 66 -> 28), but on one H100 the
# step took 12.708 ms with it against 12.453 on XLA's path (2026-12-07, consecutive processes; docs/performance.md,
# "Batch 256"): its mix kernel took 0.64 ms of the step's 0.85 ms of mHC.
MHC_WIDE_STEP_KERNELS = choice.Kernel("mhc_site", "mhc_wide_step", phases=choice.STEP_PHASES, on_gpu_by_default=False)


def _kernel_schedule(X: jax.Array, fn: jax.Array, cfg: ModelConfig, ctx) -> int | None:
    """How this site runs: None (the jnp reference), 0 (pallas_kernels/mhc.py one row per program: a decode or
    verify step of at most mhc.MAX_ROWS rows, each row's blocks reading all of fn) or R > 0 (its schedule of R rows
    per program: a prefill chunk or a wider decode or verify step, both opt-in on GPUs; rows a multiple of
    PREFILL_MIN_ROWS)."""
    rows = math.prod(X.shape[:-2])
    rows_fit = rows % PREFILL_MIN_ROWS == 0 and mhc.supported(cfg.hc_mult, cfg.dim, fn.shape[0])
    if ctx.phase == "prefill":
        return mhc.prefill_rows_per_program(rows) if choice.takes_kernel(MHC_PREFILL_KERNELS, ctx, rows_fit) else None
    if rows > mhc.MAX_ROWS:
        return mhc.prefill_rows_per_program(rows) if choice.takes_kernel(MHC_WIDE_STEP_KERNELS, ctx, rows_fit) else None
    return 0 if choice.takes_kernel(MHC_KERNELS, ctx, mhc.takes(rows, cfg.hc_mult, cfg.dim, fn.shape[0])) else None


def pre_norm(X: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, norm_weight: jax.Array,
             cfg: ModelConfig, ctx, post_mix=None):
    """One mHC site before a sub-layer: the hc_post still due from the previous sub-layer (`post_mix` = (y, post,
    comb), or None; y in X's dtype or float32, rounded to X's dtype, or the MoE's unsummed moe_ffn.MoeParts), then
    hc_pre and the sub-layer's RMSNorm. Returns (x [..., D] normalised, post, comb, X' the streams after that
    hc_post). Its kernels: the two Pallas launches of pallas_kernels/mhc.py (_kernel_schedule); its reference:
    hc_post + hc_pre + rms_norm."""
    schedule = _kernel_schedule(X, fn, cfg, ctx)
    if schedule is not None:
        if schedule and post_mix is not None and isinstance(post_mix[0], MoeParts):
            post_mix = (post_mix[0].total(), *post_mix[1:])           # (the prefill schedule takes y summed)
        with jax.named_scope("mhc"):
            return mhc.mhc_pre_norm(X, fn, base, scale, norm_weight, norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps,
                                    sinkhorn_iters=cfg.hc_sinkhorn_iters, post_mix=post_mix,
                                    rows_per_program=schedule, interpret=ctx.kernels.interpret)
    if post_mix is not None:
        X = hc_post(post_mix[0], X, post_mix[1], post_mix[2])
    rows = math.prod(X.shape[:-2])
    if choice.takes_kernel(SINKHORN_KERNEL, ctx, sinkhorn_rows.takes(rows, cfg.hc_mult)):
        normalise = functools.partial(sinkhorn_rows.sinkhorn_rows, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                                      interpret=ctx.kernels.interpret)
    else:
        normalise = functools.partial(sinkhorn, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                                      unroll=ctx.kernels.on_gpu)
    u, post, comb = hc_pre(X, fn, base, scale, cfg, normalise)
    return rms_norm(u, norm_weight, cfg.norm_eps), post, comb, X
