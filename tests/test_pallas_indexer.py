"""The indexer scores kernel (dsv4_jax/pallas_kernels/indexer.py) in Pallas interpret mode against a float64 numpy
reference written from the spec (docs/model.md 4.4: sum over heads of w_h ReLU(q_h . key), entries j < (t+1)//4
visible); the model's decode on it against the jnp path; the lowering for an H200; and (marker gpu) the compiled
kernel on a GPU."""

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
