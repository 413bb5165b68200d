"""The indexer scores kernel (dsv4_jax/pallas_kernels/indexer.py) in Pallas interpret mode against a float64 numpy
reference written from the spec (docs/model.md 4.4: sum over heads of w_h ReLU(q_h . key), entries j < (t+1)//4
visible), in its decode and its prefill schedule; the prefill picks (one top-k and the running top-k over blocks)
against float64's; the model's decode and prefill on it against the jnp path; the lowering for an H200; and (marker
gpu) the compiled kernel on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.pallas_kernels import indexer as kernel
from kernel_decode_checks import decode_matches_reference


def _scores64(q, w, keys, positions, n_entries, ratio=4):
    q, w, keys = (np.asarray(a, np.float64) for a in (q, w, keys))
    dots = np.einsum("bshd,bnd->bshn", q, keys[:, :n_entries])
    scores = np.einsum("bshn,bsh->bsn", np.maximum(dots, 0), w)
    visible = np.arange(n_entries)[None, None, :] < ((np.asarray(positions) + 1) // ratio)[:, :, None]
    return np.where(visible, scores, -np.inf)


def _inputs(rng, batch, seq, heads, dim, n_buffer, starts, dtype):
    rounded = lambda a: np.array(jnp.asarray(a, dtype).astype(jnp.float32))   # noqa: E731  (values dtype holds)
    q = rounded(rng.standard_normal((batch, seq, heads, dim)))
    keys = rounded(rng.standard_normal((batch, n_buffer, dim)))
    w = rng.standard_normal((batch, seq, heads)).astype(np.float32)
    positions = np.asarray(starts, np.int32)[:, None] + np.arange(seq, dtype=np.int32)[None, :]
    return q, w, keys, positions


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 3)])
def test_matches_float64(batch, seq, dtype):
    """Entries read from a longer buffer (its tail never read: poisoned with NaN), positions that see none, some and
    all of the entries, the weights' scale folded in; the scores to float32 rounding of their sums (the products of
    dtype values are exact)."""
    rng = np.random.default_rng(batch * 10 + seq)
    n_entries = 192
    q, w, keys, positions = _inputs(rng, batch, seq, 16, 64, 256, [2, 900] if batch > 1 else [500],
                                    dtype)
    keys[:, n_entries:] = np.nan
    got = kernel.indexer_scores(jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(keys, dtype),
                                jnp.asarray(positions), n_entries=n_entries, weight_scale=0.3, interpret=True)
    want = _scores64(q, np.float32(0.3) * w, keys, positions, n_entries)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert finite.any() and (~finite).any()
    scale = np.abs(want[finite]).max()
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows_per_program, first_entry", [(16, 0), (4, 128), (1, 64)])
def test_prefill_schedule_matches_float64(rows_per_program, first_entry, dtype):
    """The prefill schedule: 32 rows of two sequences, `rows_per_program` at a time, against a block of a longer key
    buffer that starts at entry `first_entry` (a traced value, as in the running top-k); the keys past the block
    poisoned with NaN (never read); the first sequence's rows see none, then a few of the block's entries (the
    visibility ends inside the block), the second's all of them."""
    rng = np.random.default_rng(rows_per_program + first_entry)
    n_entries, seq = 192, 32
    start = max(0, 4 * first_entry - 16)
    q, w, keys, positions = _inputs(rng, 2, seq, 16, 64, 512, [start, 4 * (first_entry + n_entries)], dtype)
    keys[:, first_entry + n_entries:] = np.nan
    run = jax.jit(lambda q, w, k, p, f: kernel.indexer_scores(q, w, k, p, n_entries=n_entries, weight_scale=0.3,
                                                              rows_per_program=rows_per_program, first_entry=f,
                                                              interpret=True))
    got = run(jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(keys[:, first_entry:], dtype),
              jnp.asarray(positions), jnp.int32(first_entry))
    want = _scores64(q, np.float32(0.3) * w, keys[:, first_entry:], positions - 4 * first_entry, n_entries)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape and not np.isnan(got).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert finite[1].all() and (~finite[0, 0]).all() and 0 < finite[0, -1].sum() < n_entries
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=2e-6 * np.abs(want[finite]).max())


def _indexer_inputs(cfg, batch, seq, start, seed):
    """Params of a CSA layer's indexer, inputs of a prefill chunk of `seq` tokens from position `start` and the keys
    of every entry up to its end (float32)."""
    from dsv4_jax.params import init_params
    params = init_params(cfg, jax.random.PRNGKey(seed))["layers"][1]["attn"]["indexer"]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, seq, cfg.dim)), jnp.float32)
    q_latent = jnp.asarray(rng.standard_normal((batch, seq, cfg.q_lora_rank)), jnp.float32)
    n_entries = (start + seq) // 4
    keys = jnp.asarray(rng.standard_normal((batch, n_entries, cfg.index_head_dim)), jnp.float32)
    positions = jnp.broadcast_to(start + jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return params, x, q_latent, keys, positions


@pytest.mark.parametrize("block", [None, 64])
def test_prefill_picks_match_float64(monkeypatch, block):
    """The prefill chunk's picks on the kernel (interpret) against float64 scores of the same queries and keys: the
    valid flags equal, every entry float64 ranks clearly inside the top k picked, every pick ranks at least near
    the k-th (float32 sums in another order than float64's may swap entries within 1e-5 of the k-th score: ties,
    documented in pallas_kernels/indexer.py). With block 64 the running top-k merges 8 blocks of 64 entries."""
    from dsv4_jax import presets
    from dsv4_jax.ops import indexer as op
    from dsv4_jax.ops.norm_rope import rope_inv_freq
    from dsv4_jax.run_context import RunContext

    if block is not None:
        monkeypatch.setattr(op, "kernel_block", lambda batch, seq: block)
    cfg = presets.tiny().replace(index_n_heads=16, index_topk=24)
    params, x, q_latent, keys, positions = _indexer_inputs(cfg, 2, 64, 1984, seed=11)
    ctx = RunContext.create(dtype="float32", kernels="interpret")
    inv_freq = rope_inv_freq(cfg, 4)
    idx, valid = jax.jit(lambda *a: op._indexer_select_prefill_on_kernel(params, cfg, *a, inv_freq, ctx))(
        x, q_latent, positions, keys)
    q, w = op._indexer_query(params, cfg, x, q_latent, positions, inv_freq, ctx)
    scores = _scores64(np.asarray(q), np.asarray(w), np.asarray(keys), np.asarray(positions), keys.shape[1])
    k = cfg.index_topk
    kth = -np.sort(-scores, axis=-1)[..., k - 1]
    tol = 1e-5 * np.abs(scores[np.isfinite(scores)]).max()
    idx, valid = np.asarray(idx), np.asarray(valid)
    assert valid.all() and idx.shape == (2, 64, k)
    picked = np.take_along_axis(scores, idx, -1)
    assert (picked >= kth[..., None] - tol).all()
    must = scores > kth[..., None] + tol
    for b, t in np.ndindex(2, 64):
        assert set(np.flatnonzero(must[b, t])) <= set(idx[b, t].tolist()), (b, t)
        assert len(set(idx[b, t].tolist())) == k


def test_model_prefill_takes_the_kernel_and_equals_the_jnp_path():
    """The tiny preset with 16 indexer heads, float32, a 700-token prompt prefilled on the interpret plan (every other
    op on the reference) and on the reference plan: every CSA layer's picks come from the prefill kernel and the
    logits agree. index_topk covers every visible entry, so the picks are the same set whatever the float32
    order of the sums (the scores themselves are checked above)."""
    from dsv4_jax import presets
    from one_op_prefill import one_op_prefill

    cfg = presets.tiny().replace(index_n_heads=16, index_topk=256)
    prefill = one_op_prefill(cfg, "indexer_scores", seed=3, max_seq_len=1024)
    err, choices = prefill(np.random.default_rng(8).integers(0, cfg.vocab_size, (1, 700)).astype(np.int32))
    kernels = {c.kernel for c in choices if c.phase == "prefill"}
    assert kernels == {"indexer_prefill"} and all(c.path == "interpret" for c in choices), choices
    assert err < 1e-5, err


def test_unsupported_geometry_is_refused():
    q = jnp.zeros((1, 1, 4, 64))
    with pytest.raises(ValueError, match="heads a multiple of 16"):
        kernel.indexer_scores(q, jnp.zeros((1, 1, 4)), jnp.zeros((1, 128, 64)), jnp.zeros((1, 1), jnp.int32),
                              n_entries=128, interpret=True)
    assert kernel.supported(64, 128, 1024) and not kernel.supported(64, 128, 1000) and not kernel.supported(4, 64, 64)


def test_model_decode_takes_the_kernel_and_equals_the_jnp_path(monkeypatch):
    """The tiny preset's layers with 16 indexer heads (a geometry the kernel takes), float32: decode steps on a
    kernel plan ("interpret") score every CSA layer's entries on the kernel and give the jnp path's logits (1e-4:
    the interpret plan's matmuls meet float32 as bf16 hi + lo parts). Prefilled past 256 positions (64 entries
    visible) on the reference plan."""
    from dsv4_jax import presets

    calls = []
    real = kernel.indexer_scores
    monkeypatch.setattr(kernel, "indexer_scores", lambda *a, **k: calls.append(k["n_entries"]) or real(*a, **k))
    decode_matches_reference(presets.tiny().replace(index_n_heads=16), 512, 300, [300, 257])
    assert calls and set(calls) == {512 // 4}


@pytest.mark.parametrize("n_entries", [1024, 1 << 18])
def test_cuda_lowering_at_flash_geometry(n_entries):
    """Pallas -> Triton IR for an H200 without a GPU at Flash's indexer (64 heads of 128), at a 4K and a 1M-token
    context's entries: one Triton kernel."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(lambda q, w, k, p: kernel.indexer_scores(q, w, k, p, n_entries=n_entries))
    args = (sds((1, 1, 64, 128), jnp.bfloat16), sds((1, 1, 64), jnp.float32), sds((1, n_entries, 128), jnp.bfloat16),
            sds((1, 1), jnp.int32))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        assert fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("seq, n_entries", [(2048, 2048), (8192, 4096)])
def test_cuda_lowering_of_the_prefill_schedule_at_flash_geometry(seq, n_entries):
    """The prefill schedule lowered for an H200 without a GPU at Flash's indexer, a 2,048- and an 8,192-token chunk
    against one block of entries: one Triton kernel."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(lambda q, w, k, p, f: kernel.indexer_scores(
        q, w, k, p, n_entries=n_entries, rows_per_program=kernel.prefill_rows_per_program(seq), first_entry=f))
    args = (sds((1, seq, 64, 128), jnp.bfloat16), sds((1, seq, 64), jnp.float32),
            sds((1, n_entries, 128), jnp.bfloat16), sds((1, seq), jnp.int32), sds((), jnp.int32))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "indexer_scores_prefill" in text


# ---- on the GPU -----------------------------------------------------------------------------------------------
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gpu_matches_float64_at_flash_geometry():
    """The compiled Triton kernel at Flash geometry (64 heads of 128, bf16), 1,024 entries of a 2,048 buffer."""
    rng = np.random.default_rng(7)
    q, w, keys, positions = _inputs(rng, 2, 1, 64, 128, 2048, [4000, 1500], jnp.bfloat16)
    got = np.asarray(jax.jit(lambda *a: kernel.indexer_scores(*a, n_entries=1024))(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(w), jnp.asarray(keys, jnp.bfloat16), jnp.asarray(positions)),
        np.float64)
    want = _scores64(q, w, keys, positions, 1024)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-5 * np.abs(want[finite]).max())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gpu_prefill_schedule_matches_float64_at_flash_geometry():
    """The compiled prefill schedule at Flash geometry (64 heads of 128, bf16): 256 rows of a chunk, 16 a program,
    against 1,024 entries of a 2,048 buffer from entry 512."""
    rng = np.random.default_rng(9)
    q, w, keys, positions = _inputs(rng, 1, 256, 64, 128, 2048, [4000], jnp.bfloat16)
    got = np.asarray(jax.jit(lambda *a: kernel.indexer_scores(*a, n_entries=1024, rows_per_program=16,
                                                              first_entry=jnp.int32(512)))(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(w), jnp.asarray(keys[:, 512:], jnp.bfloat16),
        jnp.asarray(positions)), np.float64)
    want = _scores64(q, w, keys[:, 512:], positions - 4 * 512, 1024)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-5 * np.abs(want[finite]).max())
