"""The one choice of how each op runs (dsv4_jax/ops/choice.py): the phase an engine program declares, the plan's
backend, its per-op overrides and the op's geometry; every choice recorded. Traces only: nothing is compiled."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax import engine, presets
from dsv4_jax.dispatch_census import step_dispatch
from dsv4_jax.ops import choice
from dsv4_jax.ops.plan import KernelPlan, parse_overrides, plan_kernels
from dsv4_jax.params import init_params
from dsv4_jax.run_context import RunContext, Training
from dsv4_jax.state import init_state

# the tiny preset's layers with 16 heads of 128 dims: a geometry every step kernel takes (decode attention included)
CFG = presets.tiny().replace(n_heads=16, head_dim=128, rope_head_dim=64, index_head_dim=128)


def _ops(table: dict) -> dict:
    """{"op:path[:kernel]": n} -> {op: set of paths}."""
    paths = collections.defaultdict(set)
    for key in table:
        op, path = key.split(":")[:2]
        paths[op].add(path)
    return dict(paths)


def test_decode_step_takes_every_step_kernel_on_the_interpret_plan():
    ctx = RunContext.create(dtype="bfloat16", kernels="interpret")
    paths = _ops(step_dispatch(CFG, ctx, batch=2, op=None, max_seq_len=512))
    for op in ("mhc_site", "norm_rope", "attention_core", "compressor_step", "moe_ffn"):
        assert paths[op] == {"interpret"}, (op, paths)
    assert "interpret" in paths["matmul"] and "indexer_scores" in paths     # (the tiny indexer's geometry: no kernel)


def test_an_override_switches_one_op_and_nothing_else():
    ctx = RunContext.create(dtype="bfloat16", kernels="interpret", kernel_overrides=["attention_core=reference"])
    paths = _ops(step_dispatch(CFG, ctx, batch=2, op=None, max_seq_len=512))
    assert paths["attention_core"] == {"reference"}
    assert paths["mhc_site"] == paths["norm_rope"] == paths["moe_ffn"] == {"interpret"}
    # overrides are part of the plan, hence of the jit cache key
    plain = RunContext.create(dtype="bfloat16", kernels="interpret")
    assert ctx != plain and hash(ctx.kernels) != hash(plain.kernels)


def test_the_declared_phase_decides_not_the_row_count():
    """A one-token prefill chunk has the rows of a decode step, yet its program declares "prefill": the fused step
    kernels stay off; the decode step of the same rows takes them."""
    ctx = RunContext.create(dtype="bfloat16", kernels="interpret")
    params = jax.eval_shape(lambda: init_params(CFG, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda: init_state(CFG, 2, 512, jnp.bfloat16))
    tokens = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    rows = jax.ShapeDtypeStruct((2,), jnp.int32)
    jax.clear_caches()
    with choice.record_dispatch() as prefill:
        engine.prefill_chunk.trace(params, state, tokens, rows, jax.ShapeDtypeStruct((2, CFG.vocab_size), jnp.float32),
                                   cfg=CFG, ctx=ctx)
    with choice.record_dispatch() as decode:
        engine.decode_step.trace(params, state, rows, cfg=CFG, ctx=ctx, max_seq_len=512)
    fused = ("mhc_site", "norm_rope", "attention_core", "compressor_step", "moe_ffn")
    assert {c.phase for c in prefill} == {"prefill"} and {c.phase for c in decode} == {"decode"}
    # (the attention core's prefill kernel serves prefill chunks of any length, one token included)
    assert {c.path for c in prefill if c.op in fused and c.kernel != "prefill_attention"} == {"reference"}
    assert {c.kernel for c in prefill if c.op == "attention_core" and c.path == "interpret"} == {"prefill_attention"}
    assert {c.path for c in decode if c.op in fused} == {"interpret"}
    assert {c.kernel for c in decode if c.op == "attention_core"} == {"decode_attention"}


def test_gpu_plans_take_the_opt_in_kernel_only_when_switched_on():
    gpu = KernelPlan("pallas", "pallas", target="NVIDIA H200")
    off = RunContext.create(dtype="bfloat16", kernels=gpu).in_phase("decode")
    on = RunContext.create(dtype="bfloat16", kernels=gpu,
                           kernel_overrides={"attention_core": "kernel"}).in_phase("decode")
    from dsv4_jax.ops.attention_core import DECODE_KERNEL
    from dsv4_jax.ops.mhc_site import MHC_KERNELS
    with choice.record_dispatch() as rec:
        assert not choice.takes_kernel(DECODE_KERNEL, off)
        assert choice.takes_kernel(DECODE_KERNEL, on)
        assert not choice.takes_kernel(DECODE_KERNEL, on, fits=False)          # the geometry still decides
        assert choice.takes_kernel(MHC_KERNELS, off)
        assert not choice.takes_kernel(MHC_KERNELS, off.in_phase("prefill"))
    assert [(c.op, c.path) for c in rec] == [("attention_core", "reference"), ("attention_core", "pallas"),
                                             ("attention_core", "reference"), ("mhc_site", "pallas"),
                                             ("mhc_site", "reference")]


def test_training_runs_no_kernel():
    ctx = RunContext.create(dtype="float32", kernels="interpret", training=Training())
    assert ctx.phase == "train" and ctx.in_phase("decode").phase == "train"
    from dsv4_jax.ops.mhc_site import MHC_KERNELS
    assert not choice.takes_kernel(MHC_KERNELS, ctx)


def test_bad_options_are_one_line_errors():
    with pytest.raises(ValueError, match="kernel override 'attention=kernel': expected OP=CHOICE"):
        parse_overrides(["attention=kernel"])
    with pytest.raises(ValueError, match="kernel override"):
        plan_kernels("reference", overrides={"mhc_site": "fast"})
    with pytest.raises(ValueError, match="phase must be one of"):
        RunContext.create(kernels="reference").replace(phase="serve")
    with pytest.raises(ValueError, match="exactly when it has a Training"):
        RunContext.create(kernels="reference").replace(phase="train")
    assert parse_overrides({"mhc_site": "reference", "attention_core": "kernel"}) == (
        ("attention_core", "kernel"), ("mhc_site", "reference"))
