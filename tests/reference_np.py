"""Float64 numpy reference of DeepSeek-V4 (Flash/Pro family), written directly from the DeepSeek-V4 specification.

Independent of the `dsv4_jax` implementation; docs/model.md summarises the model and numbers the sections cited
here. It operates on the LOGICAL weight dict returned by `tests/ckpt_writer.write_checkpoint` (name -> float64 array,
dequantized; `tid2eid` int64), with official tensor names.

Conventions
- Every activation is float64 (the spec's bf16 storage of streams / layer outputs is NOT simulated: this is the exact
  math). Only the QAT fake-quant sites of docs/model.md 3.2 are simulated, when `simulate_quant=True`:
    * window KV and main-compressor entries: FP8 e4m3 fake quant (block 64, power-of-two scale) on dims [0:nope];
    * indexer query and indexer-compressor entries: normalised Hadamard, then FP4 e2m1 fake quant (block 32).
  With `simulate_quant=False` none of these (and no Hadamard, which is orthonormal and cancels in q.k) is applied.
  The FP8 activation quantization inside quantized linears (docs/model.md 3.1) is NOT simulated.
- Decisions at the discontinuous sites (the fake-quant roundings, the indexer's and the router's top-k) go through
  a `decisions` object, by default `SpecDecisions` (the spec's own). A test may pass another one that makes the
  reference take an implementation's decisions where both sides are within rounding noise of a tie
  (tests/shared_decisions.py); every other value is still computed here in float64.
- Teacher-forced full-sequence forward from position 0 (prefill semantics, docs/model.md 5.2 = per-query semantics
  of 4.3).
- `rope_head_dim` (r) replaces every "64 rope dims" in the spec, `head_dim` replaces 512, `index_head_dim` 128,
  `index_n_heads` 64, `hc_mult` 4, `n_activated_experts` 6.

Shapes: B batch, S sequence, n = hc_mult, D = dim, H = n_heads, d = head_dim, r = rope_head_dim.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

# ---------------------------------------------------------------------------------------------------------------
# elementary helpers
# ---------------------------------------------------------------------------------------------------------------


def sub(weights: dict, prefix: str) -> dict:
    """The entries of `weights` under `prefix`, with the prefix stripped (e.g. sub(w, 'layers.1.attn.compressor.'))."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x @ W^T for W [out, in]."""
    return x @ w.T


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """w * x / sqrt(mean(x^2, -1) + eps) over the last axis (w=None: unweighted)."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def silu(x):
    return x * sigmoid(x)


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


# ---------------------------------------------------------------------------------------------------------------
# RoPE (docs/model.md 3.4): interleaved pairs (2i, 2i+1) on the LAST r dims, two tables
# ---------------------------------------------------------------------------------------------------------------


def rope_freqs(cfg, layer_ratio: int) -> np.ndarray:
    """Per-pair angular frequencies f'_i, i = 0..r/2-1 (float64 [r/2]).

    ratio 0: theta = rope_theta, no YaRN. ratio > 0: theta = compress_rope_theta with YaRN
    (factor rope_factor, original length original_seq_len, beta_fast / beta_slow). No mscale.
    """
    r = cfg.rope_head_dim
    theta = cfg.rope_theta if layer_ratio == 0 else cfg.compress_rope_theta
    i = np.arange(r // 2, dtype=np.float64)
    f = theta ** (-2.0 * i / r)
    if layer_ratio == 0:
        return f

    def corr(beta):
        return r * math.log(cfg.original_seq_len / (2 * math.pi * beta)) / (2 * math.log(theta))

    low = max(math.floor(corr(cfg.beta_fast)), 0)
    high = min(math.ceil(corr(cfg.beta_slow)), r - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    return f * (1.0 - ramp) + (f / cfg.rope_factor) * ramp


def apply_rope(x: np.ndarray, positions, freqs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate the last 2*len(freqs) dims of x, interleaved pairs (x[2i], x[2i+1]), at `positions`.

    `positions` is broadcast against x.shape[:-1] after appending trailing singleton axes (so positions [S] works
    for x [S, H, d]; use positions [B?, S] aligned with the leading axes). inverse=True rotates by -angle.
    Returns a new array; dims before the rope slice are unchanged.
    """
    x = np.asarray(x, dtype=np.float64)
    r = 2 * len(freqs)
    pos = np.asarray(positions, dtype=np.float64)
    pos = pos.reshape(pos.shape + (1,) * (x.ndim - 1 - pos.ndim))
    ang = pos[..., None] * freqs  # [..., r/2]
    if inverse:
        ang = -ang
    c, s = np.cos(ang), np.sin(ang)
    out = x.copy()
    xr = x[..., x.shape[-1] - r:]
    x0, x1 = xr[..., 0::2], xr[..., 1::2]
    rot = np.empty_like(xr)
    rot[..., 0::2] = x0 * c - x1 * s
    rot[..., 1::2] = x0 * s + x1 * c
    out[..., x.shape[-1] - r:] = rot
    return out


# ---------------------------------------------------------------------------------------------------------------
# fake quantization (docs/model.md 3.3) and Hadamard
# ---------------------------------------------------------------------------------------------------------------


def _pow2_ceil(ratio: np.ndarray) -> np.ndarray:
    """2^ceil(log2(ratio)) computed exactly (ratio > 0)."""
    m, e = np.frexp(ratio)
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(1.0, e)


def fp8_fake_quant(x: np.ndarray, block: int = 64) -> np.ndarray:
    """Blockwise (last axis) FP8 e4m3 quantize->dequantize with power-of-two (ue8m0) scales.

    amax = max(|x_block|, 1e-4); s = 2^ceil(log2(amax/448)); q = e4m3(clamp(x/s, +-448)); return q*s.
    """
    x = np.asarray(x, dtype=np.float64)
    shp = x.shape
    assert shp[-1] % block == 0
    xb = x.reshape(shp[:-1] + (shp[-1] // block, block))
    amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), 1e-4)
    s = _pow2_ceil(amax / 448.0)
    q = np.clip(xb / s, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * s).reshape(shp)


_E2M1_THRESH = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_UPPER_EVEN = (False, True, False, True, False, True, False)
_E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_e2m1(y: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto {0, .5, 1, 1.5, 2, 3, 4, 6} (sign kept), saturating at 6."""
    a = np.minimum(np.abs(y), 6.0)
    code = np.zeros(a.shape, dtype=np.int64)
    for t, ev in zip(_E2M1_THRESH, _E2M1_UPPER_EVEN):
        code += (a > t) | ((a == t) & ev)
    return np.sign(y) * _E2M1_GRID[code]


def fp4_fake_quant(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Blockwise (last axis) FP4 e2m1 quantize->dequantize with power-of-two scales.

    amax = max(|x_block|, 6*2^-126); s = 2^ceil(log2(amax/6)); q = rne_e2m1(clamp(x/s, +-6)); return q*s.
    """
    x = np.asarray(x, dtype=np.float64)
    shp = x.shape
    assert shp[-1] % block == 0
    xb = x.reshape(shp[:-1] + (shp[-1] // block, block))
    amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), 6.0 * 2.0 ** -126)
    s = _pow2_ceil(amax / 6.0)
    q = round_e2m1(np.clip(xb / s, -6.0, 6.0))
    return (q * s).reshape(shp)


class SpecDecisions:
    """The spec's decisions at the reference's discontinuous sites, named by `site` (e.g. 'layers.1.attn.kv',
    'layers.1.attn.compressor', 'layers.1.attn.indexer.compressor', 'layers.1.attn.indexer.q',
    'layers.1.attn.indexer', 'layers.2.ffn.gate'; 'mtp.0.' for the MTP block)."""

    def fp8(self, site: str, x: np.ndarray) -> np.ndarray:
        """FP8 e4m3 fake quant, block 64 (docs/model.md 3.3)."""
        return fp8_fake_quant(x, 64)

    def fp4(self, site: str, x: np.ndarray) -> np.ndarray:
        """FP4 e2m1 fake quant, block 32 (docs/model.md 3.3); x is already Hadamard-rotated."""
        return fp4_fake_quant(x, 32)

    def top_k(self, site: str, scores: np.ndarray, k: int) -> np.ndarray:
        """Bool mask [..., N] of the k highest finite scores of each row (ties -> lower index); rows with fewer
        finite scores select all of those."""
        order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
        mask = np.zeros(scores.shape, dtype=bool)
        np.put_along_axis(mask, order, True, axis=-1)
        return mask & np.isfinite(scores)


SPEC_DECISIONS = SpecDecisions()


def hadamard_matrix(d: int) -> np.ndarray:
    """Sylvester-ordered Walsh-Hadamard matrix H_d (entries +-1), d a power of two."""
    assert d > 0 and d & (d - 1) == 0
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(x: np.ndarray) -> np.ndarray:
    """Normalised Walsh-Hadamard transform over the last axis: x @ H_d * d^-1/2 (H symmetric)."""
    d = x.shape[-1]
    return (x @ hadamard_matrix(d)) / math.sqrt(d)


# ---------------------------------------------------------------------------------------------------------------
# mHC (docs/model.md 4.2, 4.7)
# ---------------------------------------------------------------------------------------------------------------


def sinkhorn(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """[..., n, n] logits (row j = source stream, col k = destination) -> approximately doubly stochastic C.

    softmax over k + eps, column-normalise, then (iters-1) x (row-normalise, column-normalise).
    """
    c = softmax(logits, axis=-1) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c


def hc_pre(X: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, cfg):
    """mHC coefficients and collapse. X [..., n, D]; fn [(2+n)n, nD]; base [(2+n)n]; scale [3].

    Returns (u [..., D], post [..., n], comb [..., n, n]) with u = sum_i pre_i X_i.
    """
    n = cfg.hc_mult
    v = X.reshape(X.shape[:-2] + (-1,))
    rho = 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + cfg.norm_eps)
    m = rho * (v @ fn.T)
    pre = sigmoid(m[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2.0 * sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(m.shape[:-1] + (n, n))
    comb = sinkhorn(comb_logits, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    u = np.einsum("...i,...id->...d", pre, X)
    return u, post, comb


def hc_post(y: np.ndarray, X: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """X'_k = post_k * y + sum_j C_jk X_j (transposed mixing). y [..., D], X [..., n, D] -> [..., n, D]."""
    return post[..., :, None] * y[..., None, :] + np.einsum("...jk,...jd->...kd", comb, X)


def hc_head(X: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, cfg) -> np.ndarray:
    """Final stream collapse (docs/model.md 4.7): pre_i = sigmoid(m_i*scale + base_i) + eps; h = sum_i pre_i X_i.
    -> [..., D]."""
    v = X.reshape(X.shape[:-2] + (-1,))
    rho = 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + cfg.norm_eps)
    m = rho * (v @ fn.T)
    pre = sigmoid(m * np.reshape(scale, (-1,))[0] + base) + cfg.hc_eps
    return np.einsum("...i,...id->...d", pre, X)


# ---------------------------------------------------------------------------------------------------------------
# compressor (docs/model.md 4.4) and indexer (docs/model.md 4.5)
# ---------------------------------------------------------------------------------------------------------------


def compressor_entries(x_seq: np.ndarray, w: dict, ratio: int, head_dim: int, rotate: bool, cfg, freqs: np.ndarray,
                       simulate_quant: bool = True, decisions: SpecDecisions = SPEC_DECISIONS,
                       site: str = "compressor") -> np.ndarray:
    """All complete compressed entries of a sequence that starts at position 0.

    x_seq [..., S, D]: the attn_norm'd layer input. w: dict with keys 'wkv.weight', 'wgate.weight', 'ape',
    'norm.weight' (e.g. sub(weights, 'layers.1.attn.compressor.')). ratio 4 = overlap mode (coff 2), else plain.
    Returns [..., S//ratio, head_dim]: entry j pools positions [j*c, (j+1)*c) (plus the previous window's first
    halves in overlap mode), then RMSNorm(norm.weight) -> RoPE on the last r dims at position j*c ->
    simulate_quant: rotate=False (main): FP8 fake quant of dims [0:nope]; rotate=True (indexer): Hadamard + FP4.
    `site` names the fake-quant site for `decisions`.
    """
    c, dh = ratio, head_dim
    S = x_seq.shape[-2]
    lead = x_seq.shape[:-2]
    N = S // c
    if N == 0:
        return np.zeros(lead + (0, dh))
    x = x_seq[..., :N * c, :]
    a = linear(x, w["wkv.weight"])                                        # [..., N*c, coff*dh]
    g = linear(x, w["wgate.weight"]) + np.tile(w["ape"], (N, 1))            # ape[t mod c]
    if c == 4:
        a = a.reshape(lead + (N, c, 2 * dh))
        g = g.reshape(lead + (N, c, 2 * dh))
        A, GA, Bv, GB = a[..., :dh], g[..., :dh], a[..., dh:], g[..., dh:]
        # previous-window (Ca) slots: window j-1's A halves; empty (0, -inf) for j = 0
        A_prev = np.concatenate([np.zeros_like(A[..., :1, :, :]), A[..., :-1, :, :]], axis=-3)
        GA_prev = np.concatenate([np.full_like(GA[..., :1, :, :], -np.inf), GA[..., :-1, :, :]], axis=-3)
        vals = np.concatenate([A_prev, Bv], axis=-2)                         # [..., N, 2c, dh]
        logits = np.concatenate([GA_prev, GB], axis=-2)
    else:
        vals = a.reshape(lead + (N, c, dh))
        logits = g.reshape(lead + (N, c, dh))
    p = softmax(logits, axis=-2)                                           # per channel over the slots
    ent = np.sum(p * vals, axis=-2)                                        # [..., N, dh]
    ent = rms_norm(ent, w["norm.weight"], cfg.norm_eps)
    ent = apply_rope(ent, (np.arange(N) * c).reshape((1,) * len(lead) + (N,)), freqs)
    if simulate_quant:
        if rotate:
            ent = decisions.fp4(site, hadamard(ent))
        else:
            nope = dh - cfg.rope_head_dim
            ent = np.concatenate([decisions.fp8(site, ent[..., :nope]), ent[..., nope:]], axis=-1)
    return ent


def indexer_topk(cfg, w: dict, x: np.ndarray, cq: np.ndarray, freqs: np.ndarray, simulate_quant: bool = True,
                 ratio: int = 4, decisions: SpecDecisions = SPEC_DECISIONS, site: str = "indexer"):
    """Lightning indexer of a CSA layer over a full sequence.

    w: sub(weights, 'layers.L.attn.indexer.') (keys 'wq_b.weight', 'weights_proj.weight', 'compressor.*').
    x [B, S, D] attn_norm'd input; cq [B, S, q_lora_rank] the q_norm'd latent.
    Returns (selected [B, S, N] bool, scores [B, S, N] with -inf where invisible); N = S // ratio.
    Query t sees entries j < (t+1)//ratio and selects the min(index_topk, #visible) highest-scoring ones
    (ties -> lower index). Sites for `decisions`: `site` (the top-k), site + '.compressor', site + '.q'.
    """
    B, S, _ = x.shape
    IH, ID = cfg.index_n_heads, cfg.index_head_dim
    keys = compressor_entries(x, sub(w, "compressor."), ratio, ID, True, cfg, freqs, simulate_quant, decisions,
                              site + ".compressor")                               # [B, N, ID]
    N = keys.shape[-2]
    q = linear(cq, w["wq_b.weight"]).reshape(B, S, IH, ID)
    q = apply_rope(q, np.arange(S)[None, :], freqs)
    if simulate_quant:
        q = decisions.fp4(site + ".q", hadamard(q))
    hw = linear(x, w["weights_proj.weight"]) * (ID ** -0.5) * (IH ** -0.5)       # [B, S, IH]
    dots = np.einsum("bshd,bnd->bshn", q, keys)
    scores = np.einsum("bsh,bshn->bsn", hw, np.maximum(dots, 0.0))
    t = np.arange(S)
    visible = np.arange(N)[None, :] < ((t + 1) // ratio)[:, None]                  # [S, N]
    scores = np.where(visible[None], scores, -np.inf)
    selected = decisions.top_k(site, scores, min(cfg.index_topk, N))
    return selected, scores


# ---------------------------------------------------------------------------------------------------------------
# attention (docs/model.md 4.3)
# ---------------------------------------------------------------------------------------------------------------


def attention(cfg, weights: dict, prefix: str, layer_id: int, x: np.ndarray, simulate_quant: bool = True,
              return_aux: bool = False, decisions: SpecDecisions = SPEC_DECISIONS):
    """One attention sub-layer over a full sequence starting at position 0.

    prefix: e.g. 'layers.2.' or 'mtp.0.'; layer_id selects the ratio c = compress_ratios[layer_id].
    x [B, S, D] = attn_norm(u). Returns out [B, S, D] (and an aux dict if return_aux).
    Keys for query t: window positions max(0, t-W+1)..t and, if c > 0, compressed entries j < (t+1)//c
    (HCA: all of them; CSA: the indexer's top-min(index_topk, #visible)). One softmax with the sink in the
    denominator, scale head_dim^-1/2, values = keys; inverse RoPE at t; grouped wo_a then wo_b.
    """
    w = sub(weights, prefix + "attn.")
    B, S, D = x.shape
    H, d, r = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
    nope = d - r
    ratio = cfg.compress_ratios[layer_id]
    freqs = rope_freqs(cfg, ratio)
    pos = np.arange(S)

    cq = rms_norm(linear(x, w["wq_a.weight"]), w["q_norm.weight"], cfg.norm_eps)    # [B, S, ql]
    q = linear(cq, w["wq_b.weight"]).reshape(B, S, H, d)
    q = rms_norm(q, None, cfg.norm_eps)
    q = apply_rope(q, pos[None, :], freqs)

    kv = rms_norm(linear(x, w["wkv.weight"]), w["kv_norm.weight"], cfg.norm_eps)  # [B, S, d]
    kv = apply_rope(kv, pos[None, :], freqs)
    if simulate_quant:
        kv = np.concatenate([decisions.fp8(prefix + "attn.kv", kv[..., :nope]), kv[..., nope:]], axis=-1)

    # window mask [S, S]
    win = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.window_size)
    keys = kv
    mask = np.broadcast_to(win[None], (B, S, S))
    aux = {"q": q, "kv": kv, "cq": cq}
    if ratio > 0:
        comp = compressor_entries(x, sub(w, "compressor."), ratio, d, False, cfg, freqs, simulate_quant, decisions,
                                  prefix + "attn.compressor")                     # [B, N, d]
        N = comp.shape[1]
        visible = np.arange(N)[None, :] < ((pos + 1) // ratio)[:, None]
        if ratio == 4:
            sel, iscores = indexer_topk(cfg, sub(w, "indexer."), x, cq, freqs, simulate_quant, ratio, decisions,
                                        prefix + "attn.indexer")
            cmask = sel & visible[None]
            aux["index_scores"], aux["index_selected"] = iscores, sel
        else:
            cmask = np.broadcast_to(visible[None], (B, S, N))
        keys = np.concatenate([kv, comp], axis=1)
        mask = np.concatenate([mask, cmask], axis=2)
        aux["compressed"] = comp
    logits = np.einsum("bshd,bkd->bhsk", q, keys) * d ** -0.5
    logits = np.where(mask[:, None], logits, -np.inf)
    sink = w["attn_sink"][None, :, None]                                        # [1, H, 1]
    mx = np.maximum(np.max(logits, axis=-1), sink)                              # [B, H, S]
    p = np.exp(logits - mx[..., None])
    denom = p.sum(-1) + np.exp(sink - mx)
    o = np.einsum("bhsk,bkd->bshd", p / denom[..., None], keys)                # [B, S, H, d]
    o = apply_rope(o, pos[None, :], freqs, inverse=True)

    G, R = cfg.o_groups, cfg.o_lora_rank
    og = o.reshape(B, S, G, (H // G) * d)
    wo_a = w["wo_a.weight"].reshape(G, R, (H // G) * d)
    z = np.einsum("bsgi,gri->bsgr", og, wo_a).reshape(B, S, G * R)
    out = linear(z, w["wo_b.weight"])
    aux["o"] = o
    return (out, aux) if return_aux else out


# ---------------------------------------------------------------------------------------------------------------
# MoE (docs/model.md 4.6)
# ---------------------------------------------------------------------------------------------------------------


def router(cfg, w: dict, x: np.ndarray, tokens: np.ndarray, layer_id: int, hash_layer: bool | None = None,
           decisions: SpecDecisions = SPEC_DECISIONS, site: str = "gate"):
    """w: sub(weights, prefix + 'ffn.gate.'). x [..., D], tokens [...] (int).

    Returns (idx [..., K] int, weights [..., K]). s = sqrt(softplus(W x)); hash layers: idx = tid2eid[token];
    others: idx = top-K(s + bias) (bias only for selection; experts in increasing id, the decision is `decisions`'
    at `site`). weights = s[idx] / sum(s[idx]) * route_scale.
    """
    if hash_layer is None:
        hash_layer = cfg.is_hash_layer(layer_id)
    s = np.sqrt(softplus(linear(x, w["weight"])))
    K = cfg.n_activated_experts
    if hash_layer:
        idx = w["tid2eid"][np.asarray(tokens)].astype(np.int64)
    else:
        picked = decisions.top_k(site, s + w["bias"], K)
        idx = np.nonzero(picked)[-1].reshape(s.shape[:-1] + (K,))
    sel = np.take_along_axis(s, idx, axis=-1)
    return idx, sel / sel.sum(-1, keepdims=True) * cfg.route_scale


def swiglu_expert(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, limit: float) -> np.ndarray:
    """W2 (SiLU(min(W1 x, limit)) * clamp(W3 x, -limit, limit))."""
    g = np.minimum(linear(x, w1), limit)
    up = np.clip(linear(x, w3), -limit, limit)
    return linear(silu(g) * up, w2)


def moe(cfg, weights: dict, prefix: str, layer_id: int, x: np.ndarray, tokens: np.ndarray,
        hash_layer: bool | None = None, decisions: SpecDecisions = SPEC_DECISIONS) -> np.ndarray:
    """Routed experts (weighted) + shared expert. x [B, S, D] = ffn_norm(u); tokens [B, S]."""
    w = sub(weights, prefix + "ffn.")
    idx, rw = router(cfg, sub(w, "gate."), x, tokens, layer_id, hash_layer, decisions, prefix + "ffn.gate")
    xf = x.reshape(-1, x.shape[-1])
    idx_f = idx.reshape(xf.shape[0], -1)
    rw_f = rw.reshape(xf.shape[0], -1)
    y = np.zeros_like(xf)
    for e in np.unique(idx_f):
        rows, slot = np.nonzero(idx_f == e)
        ye = swiglu_expert(xf[rows], w[f"experts.{e}.w1.weight"], w[f"experts.{e}.w2.weight"],
                           w[f"experts.{e}.w3.weight"], cfg.swiglu_limit)
        np.add.at(y, rows, rw_f[rows, slot][:, None] * ye)
    y = y + swiglu_expert(xf, w["shared_experts.w1.weight"], w["shared_experts.w2.weight"],
                          w["shared_experts.w3.weight"], cfg.swiglu_limit)
    return y.reshape(x.shape)


# ---------------------------------------------------------------------------------------------------------------
# block, model, MTP
# ---------------------------------------------------------------------------------------------------------------


def block(cfg, weights: dict, prefix: str, layer_id: int, X: np.ndarray, tokens: np.ndarray,
          simulate_quant: bool = True, hash_layer: bool | None = None, trace: dict | None = None,
          decisions: SpecDecisions = SPEC_DECISIONS) -> np.ndarray:
    """One Block: mHC-wrapped attention then mHC-wrapped MoE. X [B, S, n, D] -> [B, S, n, D].

    trace: optional dict filled with intermediates keyed '<prefix><what>' (attn_in, attn_out, attn.q, attn.kv,
    attn.compressed, attn.index_scores, attn.index_selected, attn.o, hc_attn_post/comb, ffn_in, router_idx,
    router_weights, ffn_out, hc_ffn_post/comb, mid (streams after attention), out).
    """
    w = sub(weights, prefix)
    u, post, comb = hc_pre(X, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], cfg)
    xa = rms_norm(u, w["attn_norm.weight"], cfg.norm_eps)
    y, aux = attention(cfg, weights, prefix, layer_id, xa, simulate_quant, return_aux=True, decisions=decisions)
    if trace is not None:
        trace.update({prefix + "attn_in": xa, prefix + "attn_out": y, prefix + "hc_attn_post": post,
                      prefix + "hc_attn_comb": comb})
        trace.update({prefix + "attn." + k: v for k, v in aux.items()})
    X = hc_post(y, X, post, comb)
    u, post, comb = hc_pre(X, w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"], cfg)
    xf = rms_norm(u, w["ffn_norm.weight"], cfg.norm_eps)
    y = moe(cfg, weights, prefix, layer_id, xf, tokens, hash_layer, decisions)
    out = hc_post(y, X, post, comb)
    if trace is not None:
        idx, rw = router(cfg, sub(w, "ffn.gate."), xf, tokens, layer_id, hash_layer, decisions, prefix + "ffn.gate")
        trace.update({prefix + "mid": X, prefix + "ffn_in": xf, prefix + "router_idx": idx,
                      prefix + "router_weights": rw, prefix + "ffn_out": y, prefix + "hc_ffn_post": post,
                      prefix + "hc_ffn_comb": comb, prefix + "out": out})
    return out


def reference_forward_hidden(cfg, weights: dict, tokens, simulate_quant: bool = True,
                             return_layers: bool = False, trace: dict | None = None,
                             decisions: SpecDecisions = SPEC_DECISIONS):
    """Final residual streams [B, S, n, D] (before hc_head) for tokens [B, S] starting at position 0.

    return_layers=True also returns the list of streams after every layer (index 0 = embedding streams).
    trace: optional dict collecting per-layer intermediates (see `block`).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    e = weights["embed.weight"][tokens]                                       # [B, S, D]
    X = np.repeat(e[:, :, None, :], cfg.hc_mult, axis=2)
    layers = [X]
    for layer in range(cfg.n_layers):
        X = block(cfg, weights, f"layers.{layer}.", layer, X, tokens, simulate_quant, trace=trace, decisions=decisions)
        layers.append(X)
    return (X, layers) if return_layers else X


def logits_from_hidden(cfg, weights: dict, X: np.ndarray, prefix: str = "") -> np.ndarray:
    """head(norm(hc_head(X))) with the hc_head/norm params under `prefix` ('' main model, 'mtp.0.' MTP)."""
    h = hc_head(X, weights[prefix + "hc_head_fn"], weights[prefix + "hc_head_base"], weights[prefix + "hc_head_scale"],
                cfg)
    h = rms_norm(h, weights[prefix + "norm.weight"], cfg.norm_eps)
    return linear(h, weights["head.weight"])


def reference_forward(cfg, weights: dict, tokens, simulate_quant: bool = True,
                      decisions: SpecDecisions = SPEC_DECISIONS) -> np.ndarray:
    """Teacher-forced logits float64 [B, S, vocab] for every position of tokens [B, S] (positions 0..S-1)."""
    hidden = reference_forward_hidden(cfg, weights, tokens, simulate_quant, decisions=decisions)
    return logits_from_hidden(cfg, weights, hidden)


def reference_mtp(cfg, weights: dict, tokens, next_tokens, simulate_quant: bool = True, hidden=None,
                  mtp_index: int = 0, trace: dict | None = None,
                  decisions: SpecDecisions = SPEC_DECISIONS) -> np.ndarray:
    """MTP logits [B, S, V] (docs/model.md 4.8).

    e = enorm(embed[next_tokens]); Hn = hnorm(main final streams) per stream; X = h_proj(Hn) + e_proj(e) broadcast
    over streams; X = Block(X) with layer id n_layers + mtp_index (positions 0..S-1, its own window attention, score
    routed; MoE token ids = next_tokens); logits = head(norm(hc_head_mtp(X))) with mtp's own norm / hc_head params.
    `hidden` may pass precomputed main streams [B, S, n, D].
    """
    p = f"mtp.{mtp_index}."
    tokens = np.asarray(tokens, dtype=np.int64)
    next_tokens = np.asarray(next_tokens, dtype=np.int64)
    if hidden is None:
        hidden = reference_forward_hidden(cfg, weights, tokens, simulate_quant, decisions=decisions)
    e = rms_norm(weights["embed.weight"][next_tokens], weights[p + "enorm.weight"], cfg.norm_eps)
    hn = rms_norm(hidden, weights[p + "hnorm.weight"], cfg.norm_eps)
    X = linear(hn, weights[p + "h_proj.weight"]) + linear(e, weights[p + "e_proj.weight"])[:, :, None, :]
    if trace is not None:
        trace[p + "in"] = X
    X = block(cfg, weights, p, cfg.n_layers + mtp_index, X, next_tokens, simulate_quant, hash_layer=False,
              trace=trace, decisions=decisions)
    return logits_from_hidden(cfg, weights, X, prefix=p)
