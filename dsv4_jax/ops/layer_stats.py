"""Per-layer numerical diagnostics computed on the device, returned with a program's outputs (RunContext.stats).

A quantized model that goes wrong rarely crashes: a wrong NVFP4 global scale, an amax race or an E8M0 scale read
as a plain number show up as residual streams that jump, outputs that vanish or block scales that saturate. With
`stats` on, every layer measures these at its edges, inside the same XLA program, and the program hands them back
as device arrays beside its logits or tokens (no host read per layer or per token). dsv4_jax/stats_report.py turns
them into a table on the host and flags what looks wrong. With `stats` off nothing here is traced: the program is
the same.

What a layer measures over the call's real tokens (padding and inactive rows left out):

    in_resid_* / attn_resid_* / moe_resid_*   RMS and max |x| of the residual streams entering the layer, after its
                                              attention's hc_post and after its MoE's hc_post
    attn_out_rms, moe_out_rms                 RMS of the attention output and of the MoE output (before hc_post)
    attn_nonfinite, moe_nonfinite             stream elements that are NaN or inf after each sub-layer (a count:
                                              XLA's max-reductions may skip a NaN)
    mix_min, mix_max                          range of the mHC mixing weights (post and comb) of both sites
    router_entropy                            mean entropy (nats) of the router's normalised scores over experts
    expert_load                               [E] routed assignments per expert
    entries_attended                          mean compressed entries a query attends (CSA: the indexer's valid
                                              picks; HCA: the visible entries; window layers: 0)
    {attn,moe}_quant_{blocks,saturated,underflow}   activation blocks quantized into the sub-layer's matmuls and
                                              how many had a block scale past e4m3's 448 (NVFP4) or below its
                                              smallest subnormal (NVFP4; FP8: amax under the 1e-4 floor)
    {attn,moe}_scale_{min,max}                range of the NVFP4 activation global scales used (+inf / -inf: none)

A call's values are summarised over the calls they are gathered from (`Summary`: sum, max and min of each value
over calls, counts summed), so one forward, a prefill of several chunks and a chunk of decode steps all return the
same structure, and merging two summaries is associative (a generation loop carries one).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

from ..numerics.activations import FP8_ACT_BLOCK, FP8_AMAX_FLOOR
from ..numerics.formats import NVFP4_BLOCK
from ..numerics.nvfp4 import E4M3_MAX, E4M3_MIN_SUBNORMAL, FP4_MAX

# Values summarised over calls by their mean (sum / calls), max and min.
VALUE_KEYS = ("in_resid_rms", "in_resid_max", "attn_resid_rms", "attn_resid_max", "moe_resid_rms", "moe_resid_max",
              "attn_out_rms", "moe_out_rms", "mix_min", "mix_max", "router_entropy", "entries_attended",
              "attn_scale_min", "attn_scale_max", "moe_scale_min", "moe_scale_max")
# Counts, summed over calls.
COUNT_KEYS = ("attn_nonfinite", "moe_nonfinite", "attn_quant_blocks", "attn_quant_saturated", "attn_quant_underflow",
              "moe_quant_blocks", "moe_quant_saturated", "moe_quant_underflow", "expert_load")
# A block scale saturates when block_amax / (6 x global scale) exceeds 448 by more than the divisions' rounding.
SATURATION_SLACK = 1e-5


# ---- activation quantization taps ---------------------------------------------------------------------------
# The matmuls (matmul.py) tell an open collector what their inputs' quantization does; a layer opens one around
# each sub-layer. The taps are traced values of the sub-layer's own trace: a matmul inside shard_map reports to a
# collector opened inside it (`across_devices` sums it over the mesh axis and hands it out).

_local = threading.local()


def _collectors() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def collecting():
    """Collect the quantization tallies of the matmuls traced inside (a list of tally dicts)."""
    stack = _collectors()
    taps: list = []
    stack.append(taps)
    try:
        yield taps
    finally:
        stack.pop()


def collecting_now() -> bool:
    return bool(_collectors())


def record(tally: dict) -> None:
    """Add a tally to the innermost open collector (none open: nothing)."""
    stack = _collectors()
    if stack:
        stack[-1].append(tally)


def tap_fp8(x: jax.Array) -> None:
    """The FP8 activation quantizer (per-128 power-of-two scales) on x [..., K]: blocks whose amax lies under the
    1e-4 floor count as underflowing; its scales never saturate (they come from the block's own amax). Rows that are
    all zero (a grouped matmul's rows of another device's experts) carry no data and are not counted."""
    if not collecting_now():
        return
    amax = jnp.max(jnp.abs(_blocks(x, FP8_ACT_BLOCK)), axis=-1)
    live = jnp.max(amax, axis=-1, keepdims=True) > 0
    record(_tally(jnp.sum(live) * amax.shape[-1], jnp.float32(0), jnp.sum((amax < FP8_AMAX_FLOOR) & live), None))


def tap_nvfp4(x: jax.Array, global_scale: jax.Array) -> None:
    """The NVFP4 activation quantizer on x [..., K] with per-row global scales [..., 1]: per-16 block scales
    block_amax / (6 * global) past e4m3's 448 saturate (clipped: the block's largest values clip at 6), positive ones
    under e4m3's smallest subnormal underflow (lifted to it: the block rounds to zeros). All-zero rows are left out
    (their global scale is the floor's, not a measurement)."""
    if not collecting_now():
        return
    block_amax = jnp.max(jnp.abs(_blocks(x, NVFP4_BLOCK)), axis=-1)
    live = jnp.max(block_amax, axis=-1, keepdims=True) > 0
    ratio = block_amax / (FP4_MAX * global_scale.astype(jnp.float32))
    # (the block holding a row's amax sits at 448 under the live global scale, give or take float32 rounding)
    saturated = jnp.sum((ratio > E4M3_MAX * (1 + SATURATION_SLACK)) & live)
    underflow = jnp.sum((ratio > 0) & (ratio < E4M3_MIN_SUBNORMAL) & live)
    scale = global_scale.astype(jnp.float32)
    record(_tally(jnp.sum(live) * ratio.shape[-1], saturated, underflow,
                  (jnp.min(jnp.where(live, scale, jnp.inf)), jnp.max(jnp.where(live, scale, -jnp.inf)))))


def _blocks(x: jax.Array, block: int) -> jax.Array:
    x = x.astype(jnp.float32)
    pad = -x.shape[-1] % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block)


def _tally(blocks, saturated, underflow, scale_range) -> dict:
    """scale_range: (lowest, highest) global scale, or None (no global scale: +inf, -inf)."""
    f32 = jnp.float32
    low, high = (f32(jnp.inf), f32(-jnp.inf)) if scale_range is None else scale_range
    return {"blocks": jnp.asarray(blocks, f32), "saturated": jnp.asarray(saturated, f32),
            "underflow": jnp.asarray(underflow, f32), "scale_min": jnp.asarray(low, f32),
            "scale_max": jnp.asarray(high, f32)}


def combine(tallies: list) -> dict:
    """One tally of several (none: zero blocks, no scales)."""
    total = _tally(0, 0, 0, None)
    for t in tallies:
        total = {"blocks": total["blocks"] + t["blocks"], "saturated": total["saturated"] + t["saturated"],
                 "underflow": total["underflow"] + t["underflow"],
                 "scale_min": jnp.minimum(total["scale_min"], t["scale_min"]),
                 "scale_max": jnp.maximum(total["scale_max"], t["scale_max"])}
    return total


def across_devices(tallies: list, axis: str) -> dict:
    """Inside shard_map: the tallies of this device's matmuls, summed (min / max for the scales) over `axis`."""
    t = combine(tallies)
    return {"blocks": jax.lax.psum(t["blocks"], axis), "saturated": jax.lax.psum(t["saturated"], axis),
            "underflow": jax.lax.psum(t["underflow"], axis), "scale_min": jax.lax.pmin(t["scale_min"], axis),
            "scale_max": jax.lax.pmax(t["scale_max"], axis)}


# ---- one layer's record -----------------------------------------------------------------------------------------

def _count(mask: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)


def _token_mask(a: jax.Array, valid: jax.Array) -> jax.Array:
    """valid [B, S] broadcast over a [B, S, ...]'s trailing dims."""
    return valid.reshape(valid.shape + (1,) * (a.ndim - valid.ndim))


def masked_rms(a: jax.Array, valid: jax.Array) -> jax.Array:
    """RMS over the real tokens' elements of a [B, S, ...] (NaN / inf propagate)."""
    a = a.astype(jnp.float32)
    per_token = a[0, 0].size
    sq = jnp.where(_token_mask(a, valid), a * a, 0.0)
    return jnp.sqrt(jnp.sum(sq) / (_count(valid) * per_token))


def masked_max_abs(a: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.max(jnp.where(_token_mask(a, valid), jnp.abs(a.astype(jnp.float32)), 0.0))


def masked_nonfinite(a: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.sum((~jnp.isfinite(a) & _token_mask(a, valid)).astype(jnp.float32))


def _masked_mean(a: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(valid, a.astype(jnp.float32), 0.0)) / _count(valid)


def router_entropy(logits: jax.Array) -> jax.Array:
    """Entropy (nats) per token of the router's sqrt-softplus scores normalised over the experts: logits [..., E]."""
    scores = jnp.sqrt(jax.nn.softplus(logits.astype(jnp.float32)))
    p = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)


def streams_record(prefix: str, X: jax.Array, valid: jax.Array) -> dict:
    """RMS and max |x| of streams X [B, S, n, D] over the real tokens (and the non-finite count unless `in`)."""
    out = {f"{prefix}_resid_rms": masked_rms(X, valid), f"{prefix}_resid_max": masked_max_abs(X, valid)}
    if prefix != "in":
        out[f"{prefix}_nonfinite"] = masked_nonfinite(X, valid)
    return out


def mix_record(mixes, valid: jax.Array) -> dict:
    """Range of the mHC mixing weights (post [B, S, n], comb [B, S, n, n] of each site) over the real tokens."""
    lows, highs = [], []
    for weights in mixes:
        for w in weights:
            mask = _token_mask(w, valid)
            lows.append(jnp.min(jnp.where(mask, w, jnp.inf)))
            highs.append(jnp.max(jnp.where(mask, w, -jnp.inf)))
    return {"mix_min": jnp.min(jnp.stack(lows)).astype(jnp.float32),
            "mix_max": jnp.max(jnp.stack(highs)).astype(jnp.float32)}


def router_record(logits: jax.Array, expert_ids: jax.Array, valid: jax.Array, n_experts: int) -> dict:
    """Expert load [E] (the real tokens' assignments) and mean router entropy; logits [T, E], expert_ids [T, K],
    valid [B, S] with B * S = T."""
    flat_valid = valid.reshape(-1)
    load = jnp.zeros((n_experts,), jnp.float32).at[expert_ids.reshape(-1)].add(
        jnp.repeat(flat_valid.astype(jnp.float32), expert_ids.shape[-1]))
    return {"expert_load": load, "router_entropy": _masked_mean(router_entropy(logits), flat_valid)}


def quant_record(prefix: str, tallies: list) -> dict:
    t = combine(tallies)
    return {f"{prefix}_quant_blocks": t["blocks"], f"{prefix}_quant_saturated": t["saturated"],
            f"{prefix}_quant_underflow": t["underflow"], f"{prefix}_scale_min": t["scale_min"],
            f"{prefix}_scale_max": t["scale_max"]}


def entries_record(entries: jax.Array | None, valid: jax.Array) -> dict:
    """Mean compressed entries attended per real token (entries [B, S], None: a window layer)."""
    return {"entries_attended": jnp.float32(0) if entries is None else _masked_mean(entries, valid)}


# ---- summaries over calls ---------------------------------------------------------------------------------------

def stack_layers(records: list) -> dict:
    """Per-layer record dicts (one per layer, in order) -> one dict of arrays with a leading layer axis."""
    return {key: jnp.stack([r[key] for r in records]) for key in records[0]}


def summarize(record: dict, tokens: jax.Array) -> dict:
    """The summary of one call: record (stacked over layers) gathered over `tokens` real tokens (a call without
    any contributes nothing)."""
    has = tokens > 0
    values = {k: record[k] for k in VALUE_KEYS}
    return {"calls": has.astype(jnp.float32), "tokens": jnp.asarray(tokens, jnp.float32),
            "sum": {k: jnp.where(has, v, 0.0) for k, v in values.items()},
            "max": {k: jnp.where(has, v, -jnp.inf) for k, v in values.items()},
            "min": {k: jnp.where(has, v, jnp.inf) for k, v in values.items()},
            "count": {k: jnp.where(has, record[k], 0.0) for k in COUNT_KEYS}}


def merge(a: dict, b: dict) -> dict:
    """Two summaries as one (associative; `empty` is its identity)."""
    return {"calls": a["calls"] + b["calls"], "tokens": a["tokens"] + b["tokens"],
            "sum": jax.tree.map(jnp.add, a["sum"], b["sum"]), "max": jax.tree.map(jnp.maximum, a["max"], b["max"]),
            "min": jax.tree.map(jnp.minimum, a["min"], b["min"]),
            "count": jax.tree.map(jnp.add, a["count"], b["count"])}


def empty(n_layers: int, n_experts: int) -> dict:
    """The summary of no calls, for `n_layers` layers of `n_experts` routed experts."""
    f32 = jnp.float32
    layer = lambda fill: jnp.full((n_layers,), fill, f32)  # noqa: E731
    return {"calls": f32(0), "tokens": f32(0),
            "sum": {k: layer(0.0) for k in VALUE_KEYS}, "max": {k: layer(-jnp.inf) for k in VALUE_KEYS},
            "min": {k: layer(jnp.inf) for k in VALUE_KEYS},
            "count": {k: jnp.zeros((n_layers, n_experts), f32) if k == "expert_load" else layer(0.0)
                      for k in COUNT_KEYS}}
