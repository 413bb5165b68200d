"""The model on a device mesh: shardings by the rules, expert-parallel MoE, loading straight onto the devices.

The comparisons with the single-device model need 8 fake CPU devices, which JAX fixes when it starts: they run in
a process of their own (tests/sharded_checks.py); the rest of the suite keeps one device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

import dsv4_jax
from dsv4_jax import presets
from dsv4_jax.params import init_params
from dsv4_jax.sharding import make_mesh, param_shardings, partition_spec
from dsv4_jax.state import state_bytes

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharded_model_equals_one_device_on_2_4_and_8_devices(tiny_checkpoint):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    result = subprocess.run([sys.executable, os.path.join(HERE, "sharded_checks.py"), tiny_checkpoint[0]],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0 and "all sharded checks passed" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-3000:])


def test_rules_split_only_the_experts():
    cfg = presets.tiny()
    mesh = make_mesh(1)
    shardings = param_shardings(cfg, mesh, jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))))
    layer = shardings["layers"][3]
    assert layer["ffn"]["experts"]["w1"]["weight"].packed.spec == P("expert", None, None)
    assert layer["attn"]["wq_b"]["weight"].weight.spec == P(None, None)            # heads: replicated
    assert shardings["head"]["weight"].spec == P(None, None)
    assert partition_spec(("experts", None, None), 1) == P("expert")               # a stack's per-expert scalars
    assert partition_spec(None, 2) == P(None, None)


def test_heads_and_shared_expert_split_from_four_devices():
    """sharding.rules: the experts always; from 4 devices also the attention heads, output groups and the shared
    expert where they divide into whole FP8 blocks (Flash, Pro); the tiny preset's do not (its heads stay whole)."""
    from dsv4_jax.sharding import rules
    only_experts = {"experts": "expert"}
    tensor = {"experts": "expert", "heads": "expert", "o_groups": "expert", "mlp": "expert"}
    for cfg in (presets.flash(), presets.pro()):
        assert rules(cfg, 1) == rules(cfg, 2) == only_experts
        assert rules(cfg, 4) == rules(cfg, 8) == tensor
    assert rules(presets.flash(), 16) == only_experts               # Flash's 8 output groups do not split 16 ways
    assert all(rules(presets.tiny(), n) == only_experts for n in (2, 4, 8))
    assert partition_spec((None, "o_groups"), 2, tensor) == P(None, "expert")      # wo_b's inputs


def test_mesh_errors_are_one_line():
    with pytest.raises(ValueError, match=r"n_devices must be an integer in \[1, 1\]"):
        make_mesh(2)
    with pytest.raises(ValueError, match="data must be a positive divisor of n_devices=1"):
        make_mesh(1, data=2)
    with pytest.raises(ValueError, match="the mesh must have axes"):
        dsv4_jax.init_random(presets.tiny(), mesh=jax.make_mesh((1,), ("x",)))


def test_memory_plan_counts_each_devices_share():
    cfg = presets.tiny()
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
    experts = sum(nbytes(layer["ffn"]["experts"]) for layer in abstract["layers"] + abstract["mtp"])
    total = nbytes(abstract)
    for n in (1, 2, 4, 8):
        plan = dsv4_jax.memory_plan(cfg, n_devices=n, max_seq_len=256, max_batch=2, device_memory=10 ** 9)
        assert plan.weights == total - experts + experts // n
        assert plan.decode_state == state_bytes(cfg, 2, 256)
        assert plan.fits and plan.prefill_temp is None
    with pytest.raises(ValueError, match="8 routed experts do not split over 3 devices"):
        dsv4_jax.memory_plan(cfg, n_devices=3)
    with pytest.raises(ValueError, match="kernel override 'indexer=kernel'"):      # the compiled plan's overrides
        dsv4_jax.memory_plan(cfg, max_seq_len=256, compiled=True, kernel_overrides=["indexer=kernel"])
