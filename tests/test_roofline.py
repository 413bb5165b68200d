"""dsv4_jax.roofline against independent counts: the bytes of the parameter tree and decode state as JAX shapes them,
exhaustive enumeration of expert picks, and a per-token loop over attention keys."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import presets, roofline as R
from dsv4_jax.hlo_census import FAMILIES
from dsv4_jax.params import init_params, nvidia_formats, tree_get, weight_specs
from dsv4_jax.state import init_state


def _tree_bytes_by_part(cfg, stored=None):
    """Bytes of the leaves of init_params' tree (shapes only), grouped by the part of the spec each belongs to."""
    tree = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), stored))
    out = dict.fromkeys(R.WEIGHT_PARTS, 0)
    for spec in weight_specs(cfg, stored):
        leaves = jax.tree_util.tree_leaves(tree_get(tree, spec.name))
        out[R.weight_part(spec.name)] += sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    return out


@pytest.mark.parametrize("name", ["tiny", "tiny-nvfp4", "flash"])
def test_weight_bytes_match_the_parameter_tree(name):
    cfg = presets.flash() if name == "flash" else presets.tiny()
    stored = nvidia_formats(cfg) if name == "tiny-nvfp4" else None
    assert R.weight_bytes_by_part(cfg, stored) == _tree_bytes_by_part(cfg, stored)


def test_every_weight_has_a_part_and_the_big_parts_are_where_expected():
    cfg = presets.flash()
    parts = R.weight_bytes_by_part(cfg)
    assert set(parts) == set(R.WEIGHT_PARTS)
    total = sum(parts.values())
    assert 140e9 < total < 160e9, f"Flash holds ~149 GB in its stored formats, counted {total / 1e9:.1f} GB"
    assert parts["routed_experts"] > 0.9 * total


def test_a_batch_large_enough_reads_every_weight_once():
    """At a batch where every expert is (almost surely) picked, the floor is the whole backbone plus the head and
    the embedding rows: everything but the MTP block."""
    cfg = presets.tiny()
    parts = R.weight_bytes_by_part(cfg)
    r = R.roofline(cfg, batch=4096, context=0)
    assert r.weights["routed_experts"] == pytest.approx(parts["routed_experts"], rel=1e-9)
    for part in ("attention", "compressor", "indexer", "mhc", "shared_experts", "head"):
        assert r.weights[part] == parts[part], part
    assert r.weights["mtp"] == 0
    assert R.roofline(cfg, batch=4096, context=0, mtp=True).weights["mtp"] == pytest.approx(parts["mtp"], rel=1e-9)


@pytest.mark.parametrize("batch, context", [(1, 4096), (64, 65536)])
def test_bytes_by_family_regroup_the_floor(batch, context):
    """The floor by op family adds up to the floor and puts each stored format where its matmul kernels read it:
    the routed experts' expected bytes and nothing else under "fp4 matmul", every FP8 weight (attention, shared
    experts, the indexer's wq_b) under "fp8 matmul", the state's bytes under the families that read it."""
    cfg = presets.named("flash", 4)
    floor = R.roofline(cfg, batch, context)
    families = R.bytes_by_family(cfg, batch, context)
    assert sum(families.values()) == pytest.approx(floor.total_bytes, rel=1e-12)
    assert families["fp4 matmul"] == pytest.approx(floor.weights["routed_experts"], rel=1e-12)
    fp8 = sum(R.spec_bytes(s) for s in weight_specs(cfg) if s.fmt == "fp8" and not s.name.startswith("mtp."))
    assert families["fp8 matmul"] == fp8
    assert families["attention"] > floor.state["window_kv"] + floor.state["compressed_kv"]   # (+ the sinks)
    assert families["indexer"] > floor.state["index_keys"] and set(families) <= set(FAMILIES)


@pytest.mark.parametrize("n_experts,k,batch", [(4, 2, 2), (5, 2, 3), (6, 3, 2)])
def test_distinct_expert_fraction_by_enumeration(n_experts, k, batch):
    subsets = list(itertools.combinations(range(n_experts), k))
    distinct = [len(set().union(*picks)) for picks in itertools.product(subsets, repeat=batch)]
    want = np.mean(distinct) / n_experts
    assert R.distinct_expert_fraction(batch, k, n_experts) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8"])
def test_state_read_at_full_context_is_the_buffers(kv_cache_dtype):
    """At context == max_seq_len an HCA layer reads its whole compressed buffer and a CSA layer its whole indexer
    key buffer; the window ring is read whole; the selected entries are top-k stored entries (compact or not)."""
    cfg = presets.tiny()
    batch, seq = 3, 1024
    state = jax.eval_shape(lambda: init_state(cfg, batch, seq, jnp.bfloat16, kv_cache_dtype=kv_cache_dtype))
    nbytes = lambda tree: sum(math.prod(x.shape) * x.dtype.itemsize  # noqa: E731
                              for x in jax.tree_util.tree_leaves(tree))
    r = R.roofline(cfg, batch, seq, kv_cache_dtype=kv_cache_dtype)
    layers = state.layers
    want_window = sum(nbytes(c.window_kv) for c in layers)
    want_index = sum(nbytes(c.index_keys) for c in layers)          # None (no leaves) where a layer has none
    want_hca = sum(nbytes(c.compressed_kv) for i, c in enumerate(layers) if cfg.compress_ratios[i] > 4)
    csa = [c for i, c in enumerate(layers) if cfg.compress_ratios[i] == 4]
    want_selected = sum(nbytes(c.compressed_kv) // (seq // 4) * cfg.index_topk for c in csa)   # batch rows in
    pending = sum(nbytes(c.compressor) + nbytes(c.indexer_compressor) for c in layers)
    assert r.state["window_kv"] == want_window
    assert r.state["index_keys"] == want_index
    assert r.state["compressed_kv"] == want_hca + want_selected
    assert r.state["compressor_state"] == pending


def test_attention_flops_by_a_loop_over_keys():
    cfg = presets.tiny()
    positions = np.arange(0, 700, 7)
    want = 0.0
    for t in positions:
        for layer in range(cfg.n_layers):
            ratio = cfg.compress_ratios[layer]
            keys = min(t + 1, cfg.window_size)
            if ratio == 4:
                want += 2 * cfg.index_n_heads * cfg.index_head_dim * ((t + 1) // 4)
                keys += min(cfg.index_topk, (t + 1) // 4)
            elif ratio:
                keys += (t + 1) // ratio
            want += 4 * cfg.n_heads * cfg.head_dim * keys
    assert R.attention_flops(cfg, positions) == pytest.approx(want, rel=1e-12)


def test_prefill_matmul_flops_follow_the_active_parameters():
    """Flash activates ~13B parameters per token; the prefill count is 2 FLOPs per active weight per token
    (plus attention and the head), within 3% of that figure for a short prompt."""
    cfg = presets.flash()
    per_token = R.prefill_flops(cfg, 1024) / 1024
    assert 2 * 12.5e9 < per_token < 2 * 13.5e9


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        R.roofline(presets.tiny(), 0, 16)
