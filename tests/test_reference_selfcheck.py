"""Self-checks of the test helpers (synthetic checkpoint writer and float64 numpy reference); not of dsv4_jax."""

import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_writer as cw  # noqa: E402
import reference_np as R  # noqa: E402
from dsv4_jax import presets  # noqa: E402
from dsv4_jax.config import to_hf_config  # noqa: E402

FP8_NAMES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
             "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
             "ffn.shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")


@pytest.fixture(scope="module")
def cfg():
    return presets.tiny()


@pytest.fixture(scope="module")
def weights(cfg, tmp_path_factory):
    return cw.write_checkpoint(str(tmp_path_factory.mktemp("ckpt_ref")), cfg, seed=0)


def _expected_kind(name):
    if name.endswith("tid2eid"):
        return "I64"
    if ".experts." in name:  # routed experts (".shared_experts." does not contain ".experts.")
        return "FP4"
    if name.endswith(FP8_NAMES):
        return "FP8"
    if name.endswith(("attn_sink", "ape", "gate.bias")) or "hc_" in name.split(".")[-1]:
        return "F32"
    return "BF16"


def _decode_checkpoint(directory, raw):
    """Decode every logical tensor of a raw checkpoint independently of the writer's return value."""
    out = {}
    for name, (dt, shape, data) in raw.items():
        if name.endswith((".scale", ".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        base = name[:-len("weight")]
        if dt == "F8_E4M3" and base + "scale" in raw:
            sdt, sshape, sdata = raw[base + "scale"]
            assert sdt == "F8_E8M0"
            assert sshape == [-(-shape[0] // 128), -(-shape[1] // 128)]
            w = cw.decode_raw(dt, shape, data)
            s = np.frombuffer(sdata, np.uint8).reshape(sshape).astype(np.float64)
            s = np.repeat(np.repeat(2.0 ** (s - 127), 128, 0), 128, 1)[:shape[0], :shape[1]]
            out[name] = w * s
        elif dt in ("I8", "U8"):
            b = np.frombuffer(data, np.uint8).reshape(shape)
            table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
            vals = np.stack([table[b & 15], table[b >> 4]], axis=-1).reshape(shape[0], shape[1] * 2)
            if dt == "I8":
                sdt, sshape, sdata = raw[base + "scale"]
                assert sdt == "F8_E8M0" and sshape == [shape[0], shape[1] * 2 // 32]
                s = 2.0 ** (np.frombuffer(sdata, np.uint8).reshape(sshape).astype(np.float64) - 127)
                out[name] = vals * np.repeat(s, 32, 1)
            else:
                sdt, sshape, sdata = raw[base + "weight_scale"]
                assert sdt == "F8_E4M3" and sshape == [shape[0], shape[1] * 2 // 16]
                s = np.frombuffer(sdata, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(sshape)
                dt2, shp2, d2 = raw[base + "weight_scale_2"]
                assert dt2 == "F32" and shp2 == []
                assert raw[base + "input_scale"][0] == "F32" and raw[base + "input_scale"][1] == []
                out[name] = vals * np.repeat(s, 16, 1) * float(np.frombuffer(d2, "<f4")[0])
        else:
            out[name] = cw.decode_raw(dt, shape, data)
    return out


@pytest.mark.parametrize("expert_format,num_shards", [("mxfp4", 3), ("nvfp4", 1)])
def test_writer_roundtrip(cfg, tmp_path, expert_format, num_shards):
    logical = cw.write_checkpoint(str(tmp_path), cfg, seed=1, num_shards=num_shards, expert_format=expert_format)
    with open(tmp_path / "config.json") as f:
        assert json.load(f) == json.loads(json.dumps(to_hf_config(cfg)))
    if num_shards > 1:
        with open(tmp_path / "model.safetensors.index.json") as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
        assert files == [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]
        assert not (tmp_path / "model.safetensors").exists()
        for fn in files:
            part = cw.read_safetensors_raw(str(tmp_path / fn))
            assert all(index["weight_map"][k] == fn for k in part)
        assert "total_size" in index["metadata"]
    raw = cw.read_checkpoint_raw(str(tmp_path))
    if num_shards > 1:
        assert set(raw) == set(index["weight_map"])
    decoded = _decode_checkpoint(str(tmp_path), raw)
    assert set(decoded) == set(logical)
    for name, val in logical.items():
        np.testing.assert_array_equal(decoded[name], val, err_msg=name)
        dt = raw[name][0]
        kind = _expected_kind(name)
        if kind == "FP4":
            if expert_format == "nvfp4" and name.startswith("layers."):
                assert dt == "U8" and raw[name[:-6] + "weight_scale"][0] == "F8_E4M3", name
                assert name[:-6] + "scale" not in raw
            else:
                assert dt == "I8" and raw[name[:-6] + "scale"][0] == "F8_E8M0", name
        else:
            assert dt == {"FP8": "F8_E4M3", "BF16": "BF16", "F32": "F32", "I64": "I64"}[kind], name
    # inventory details
    assert "layers.0.ffn.gate.tid2eid" in raw and "layers.0.ffn.gate.bias" not in raw
    assert "layers.2.ffn.gate.bias" in raw and "layers.2.ffn.gate.tid2eid" not in raw
    assert "mtp.0.ffn.gate.bias" in raw and "mtp.0.embed.weight" not in raw and "mtp.0.head.weight" not in raw
    assert "mtp.0.attn.compressor.wkv.weight" not in raw and "layers.0.attn.compressor.ape" not in raw
    assert raw["layers.1.attn.compressor.ape"][1] == [4, 2 * cfg.head_dim]
    assert raw["layers.1.attn.indexer.compressor.ape"][1] == [4, 2 * cfg.index_head_dim]
    assert raw["layers.2.attn.compressor.ape"][1] == [128, cfg.head_dim]
    assert raw["layers.2.attn.compressor.norm.weight"][1] == [cfg.head_dim]
    assert "layers.2.attn.indexer.wq_b.weight" not in raw
    assert raw["hc_head_scale"][1] == [1] and raw["layers.0.hc_attn_fn"][1] == [cfg.hc_mix_dim, cfg.hc_dim]
    t = logical["layers.0.ffn.gate.tid2eid"]
    assert t.shape == (cfg.vocab_size, cfg.n_activated_experts)
    assert all(len(set(row)) == len(row) for row in t[:50])


def test_fp4_nibble_order_and_rounding():
    vals = np.array([[0.5, -1.0, 6.0, 0.0] + [0.0] * 28])  # scale exponent: amax 6 -> s = 1
    packed, sb, deq = cw.quantize_mxfp4(vals)
    assert sb[0, 0] == 127
    assert packed[0, 0] == (0x1 | (0xA << 4))  # 0.5 = code 1 (low), -1.0 = code 0xA (high)
    assert packed[0, 1] == 0x07  # 6.0 = code 7 (low), 0 (high)
    np.testing.assert_array_equal(deq, vals)
    np.testing.assert_array_equal(cw.unpack_fp4(packed), vals)
    # ties go to the even code; compare against ml_dtypes' e2m1 round-to-nearest-even
    y = np.concatenate([np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 7.0, -9.0]),
                        np.random.default_rng(0).uniform(-6, 6, 2000)])
    ref = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(R.round_e2m1(y), ref)
    np.testing.assert_array_equal(cw.FP4_VALUES[cw.fp4_codes(y)], ref)


def test_fake_quant_grids():
    x = np.random.default_rng(0).standard_normal((3, 128)) * np.array([1e-3, 1.0, 50.0])[:, None]
    q8 = R.fp8_fake_quant(x, 64)
    q4 = R.fp4_fake_quant(x, 32)
    for q, blk, qmax in ((q8, 64, 448.0), (q4, 32, 6.0)):
        xb, qb = x.reshape(3, -1, blk), q.reshape(3, -1, blk)
        s = 2.0 ** np.ceil(np.log2(np.abs(xb).max(-1, keepdims=True) / qmax))
        grid = qb / s
        assert np.all(np.abs(grid) <= qmax)
        if blk == 64:
            np.testing.assert_array_equal(grid.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), grid)
            assert np.all(np.abs(qb - xb) <= 2.0 ** -4 * np.abs(xb) + s * 2.0 ** -10)
        else:
            assert np.all(np.isin(np.abs(grid), R._E2M1_GRID))
    np.testing.assert_array_equal(R.fp8_fake_quant(q8, 64), q8)  # idempotent
    np.testing.assert_array_equal(R.fp4_fake_quant(q4, 32), q4)


def test_hadamard_orthonormal():
    h = R.hadamard(np.eye(64))
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-12)
    np.testing.assert_allclose(h[1, :4] * 8, [1, -1, 1, -1])  # Sylvester order


def test_rope_interleaved_and_yarn(cfg):
    r = cfg.rope_head_dim
    freqs = R.rope_freqs(cfg, 4)
    for i in (0, 5, r // 2 - 1):
        x = np.zeros((7, cfg.head_dim))
        x[:, : cfg.nope_head_dim] = 1.0
        x[:, cfg.nope_head_dim + 2 * i] = 0.3
        x[:, cfg.nope_head_dim + 2 * i + 1] = -1.1
        y = R.apply_rope(x, np.arange(7) * 37, freqs)
        mask = np.zeros(cfg.head_dim, bool)
        mask[: cfg.nope_head_dim] = True
        mask[cfg.nope_head_dim + 2 * i: cfg.nope_head_dim + 2 * i + 2] = True
        assert np.all(y[:, ~mask] == 0)
        np.testing.assert_array_equal(y[:, : cfg.nope_head_dim], 1.0)
        np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))
        np.testing.assert_allclose(R.apply_rope(y, np.arange(7) * 37, freqs, inverse=True), x, atol=1e-12)
    # position 1, pair 0, frequency 1: (1, 0) -> (cos 1, sin 1)
    x = np.zeros(r)
    x[0] = 1
    y = R.apply_rope(x[None], np.array([1]), R.rope_freqs(cfg, 0))[0]
    np.testing.assert_allclose(y[:2], [np.cos(1.0), np.sin(1.0)])
    # plain table, and YaRN with the spec's numbers for the real models (r = 64, theta 160000: low 15, high 25)
    np.testing.assert_allclose(R.rope_freqs(cfg, 0), 10000.0 ** (-2 * np.arange(r // 2) / r))
    big = cfg.replace(rope_head_dim=64, head_dim=128, index_head_dim=128)
    f = R.rope_freqs(big, 4)
    base = 160000.0 ** (-2 * np.arange(32) / 64)
    np.testing.assert_allclose(f[:16], base[:16])
    np.testing.assert_allclose(f[25:], base[25:] / 16)
    assert np.all((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16))


def test_sinkhorn_doubly_stochastic(cfg):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, cfg.hc_mult, cfg.dim))
    fn = rng.standard_normal((cfg.hc_mix_dim, cfg.hc_dim)) * 0.01
    base = rng.standard_normal(cfg.hc_mix_dim)
    u, post, comb = R.hc_pre(X, fn, base, np.array([1.0, 1.0, 1.0]), cfg)
    assert comb.shape == (5, cfg.hc_mult, cfg.hc_mult)
    # 20 iterations ending with a column normalisation: columns exact, rows approximately
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(comb.sum(-1), 1.0, atol=2e-2)
    _, _, comb_long = R.hc_pre(X, fn, base, np.array([1.0, 1.0, 1.0]), cfg.replace(hc_sinkhorn_iters=500))
    np.testing.assert_allclose(comb_long.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(u, np.einsum("bi,bid->bd", R.sigmoid(
        np.einsum("bv,iv->bi", X.reshape(5, -1), fn[:cfg.hc_mult]) / np.sqrt(np.mean(X.reshape(5, -1) ** 2, -1,
        keepdims=True) + cfg.norm_eps) + base[:cfg.hc_mult]) + cfg.hc_eps, X))
    assert np.all((post > 0) & (post < 2))
    # transposed mixing: output stream k = post_k y + sum_j C_jk X_j
    y = rng.standard_normal((5, cfg.dim))
    out = R.hc_post(y, X, post, comb)
    np.testing.assert_allclose(out[:, 1], post[:, 1:2] * y + np.einsum("bj,bjd->bd", comb[:, :, 1], X))


def test_compressor_causal(cfg, weights):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 23, cfg.dim))
    for prefix, ratio, dh, rot in (("layers.1.attn.compressor.", 4, cfg.head_dim, False),
                                   ("layers.1.attn.indexer.compressor.", 4, cfg.index_head_dim, True)):
        w = R.sub(weights, prefix)
        freqs = R.rope_freqs(cfg, ratio)
        full = R.compressor_entries(x, w, ratio, dh, rot, cfg, freqs)
        assert full.shape == (1, 5, dh)
        for S in (4, 9, 16):
            part = R.compressor_entries(x[:, :S], w, ratio, dh, rot, cfg, freqs)
            np.testing.assert_allclose(part, full[:, : S // ratio], atol=1e-12)


def test_reference_causal(cfg, weights):
    rng = np.random.default_rng(0)
    S, t = 40, 21
    tok = rng.integers(0, cfg.vocab_size, (1, S))
    tok2 = tok.copy()
    tok2[0, t] = (tok[0, t] + 1) % cfg.vocab_size
    for sq in (True, False):
        a = R.reference_forward(cfg, weights, tok, simulate_quant=sq)
        b = R.reference_forward(cfg, weights, tok2, simulate_quant=sq)
        assert a.shape == (1, S, cfg.vocab_size) and np.all(np.isfinite(a))
        np.testing.assert_allclose(a[:, :t], b[:, :t], rtol=0, atol=1e-12)
        assert np.abs(a[:, t:] - b[:, t:]).max(axis=-1).min() > 1e-6
    m1 = R.reference_mtp(cfg, weights, tok[:, :-1], tok[:, 1:])
    m2 = R.reference_mtp(cfg, weights, tok2[:, :-1], tok2[:, 1:])
    np.testing.assert_allclose(m1[:, : t - 1], m2[:, : t - 1], rtol=0, atol=1e-12)
    assert np.abs(m1[:, t - 1:] - m2[:, t - 1:]).max() > 1e-6


def _compressor_decode(x, w, ratio, dh, rotate, cfg, freqs):
    """Per-token decode rule of docs/model.md 5.3 (state machine), for cross-checking the full-sequence pooling."""
    overlap = ratio == 4
    coff = 2 if overlap else 1
    kv_state = np.zeros((coff * ratio, coff * dh))
    sc_state = np.full((coff * ratio, coff * dh), -np.inf)
    out = []
    for p in range(x.shape[0]):
        a = w["wkv.weight"] @ x[p]
        g = w["wgate.weight"] @ x[p] + w["ape"][p % ratio]
        slot = (ratio + p % ratio) if overlap else p % ratio
        kv_state[slot], sc_state[slot] = a, g
        if (p + 1) % ratio:
            continue
        if overlap:
            vals = np.concatenate([kv_state[:ratio, :dh], kv_state[ratio:, dh:]])
            logits = np.concatenate([sc_state[:ratio, :dh], sc_state[ratio:, dh:]])
            kv_state[:ratio], sc_state[:ratio] = kv_state[ratio:].copy(), sc_state[ratio:].copy()
        else:
            vals, logits = kv_state, sc_state
        e = np.sum(R.softmax(logits, axis=0) * vals, axis=0)
        e = R.rms_norm(e, w["norm.weight"], cfg.norm_eps)
        e = R.apply_rope(e[None], np.array([p + 1 - ratio]), freqs)[0]
        if rotate:
            e = R.fp4_fake_quant(R.hadamard(e), 32)
        else:
            e = np.concatenate([R.fp8_fake_quant(e[:dh - cfg.rope_head_dim], 64), e[dh - cfg.rope_head_dim:]])
        out.append(e)
    return np.array(out)


def test_compressor_matches_decode_rule(cfg, weights):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 261, cfg.dim))
    for prefix, ratio, dh, rot in (("layers.1.attn.compressor.", 4, cfg.head_dim, False),
                                   ("layers.1.attn.indexer.compressor.", 4, cfg.index_head_dim, True),
                                   ("layers.2.attn.compressor.", 128, cfg.head_dim, False)):
        w = R.sub(weights, prefix)
        freqs = R.rope_freqs(cfg, ratio)
        full = R.compressor_entries(x, w, ratio, dh, rot, cfg, freqs)
        assert full.shape == (2, 261 // ratio, dh)
        for b in range(2):
            np.testing.assert_allclose(full[b], _compressor_decode(x[b], w, ratio, dh, rot, cfg, freqs), atol=1e-9)


def test_window_and_hca_visibility(cfg, weights):
    rng = np.random.default_rng(4)
    S = 140
    x = rng.standard_normal((1, S, cfg.dim))
    x2 = x.copy()
    x2[0, 0] += 1.0
    trace = {}
    for layer, far_changes in ((0, False), (2, True)):  # ratio 0: window only; ratio 128: entry 0 visible from t=127
        a = R.attention(cfg, weights, f"layers.{layer}.", layer, x)
        b = R.attention(cfg, weights, f"layers.{layer}.", layer, x2)
        assert np.abs(a[0, 127] - b[0, 127]).max() > 1e-6
        if far_changes:
            assert np.abs(a[0, 128:] - b[0, 128:]).max(-1).min() > 1e-6
        else:
            np.testing.assert_allclose(a[0, 128:], b[0, 128:], rtol=0, atol=1e-12)
    R.reference_forward_hidden(cfg, weights, rng.integers(0, cfg.vocab_size, (1, 24)), trace=trace)
    sel = trace["layers.1.attn.index_selected"][0]
    assert sel.shape == (24, 6)
    np.testing.assert_array_equal(sel.sum(-1), np.minimum(np.arange(1, 25) // 4, cfg.index_topk))
    invisible = np.arange(6)[None, :] >= ((np.arange(24) + 1) // 4)[:, None]
    assert not np.any(sel & invisible)
