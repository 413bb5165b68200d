"""Train the small default model (every DeepSeek-V4 mechanism present) on the KJV corpus and export it in the
official on-disk format into dsv4_jax/default_model/.

    python scripts/train_tiny.py                       # defaults: data/corpus, out/train_tiny, 1200 steps
    python scripts/train_tiny.py --time-budget 240     # fit the run (compilation included) into 240 s

What is trained: `default_config()` below (6 layers: window-only + hash-routed, CSA + hash-routed, HCA, CSA, HCA,
CSA, then one window-only MTP block; mHC with 4 streams; 16 routed experts top-2 plus a shared expert). The
parameter tree has the structure of `dsv4_jax.params.weight_specs` with float32 arrays at every leaf (FP8 linears as
dense [out, in], routed experts as dense [E, out, in]); the model code (`dsv4_jax.model.backbone`, `head_logits`,
`mtp_block`) runs on it with a float32 training run context (below).

Loss = next-token cross-entropy + `--mtp-weight` x the MTP block's next-next-token cross-entropy + `--indexer-weight`
x the indexer's KL loss (below). Optimiser: AdamW written here (no optax dependency), linear warmup + cosine decay,
global-norm clipping.

What training needs from the model is part of the model, asked for with `RunContext(training=Training(...))`
(dsv4_jax/run_context.py):

- Straight-through fake quant. The architecture's activation roundings (KV nope dims -> FP8, indexer q / keys ->
  Hadamard + FP4) cast through float8/float4 dtypes, and JAX's derivative of those casts is zero, so no gradient
  would reach the KV projections; under training they pass the gradient through unchanged.
- Lightning-indexer training. The indexer only chooses which compressed entries a CSA query reads (top-k), so the
  language-model loss gives its weights no gradient. As in DeepSeek-V3.2's DSA, each CSA layer returns a KL loss
  between the main attention's distribution over the compressed entries (summed over heads, normalised; a constant
  target) and the softmax of the indexer scores, on detached inputs, so it trains only the indexer
  (dsv4_jax/layers/indexer_loss.py).
- Capacity-slot routed experts (`--moe-capacity`, the default on the CPU), where lax.ragged_dot would run every
  expert over every row.
- Aux-loss-free load balancing (DeepSeek-V3): after every step each score-routed layer's `gate.bias` moves by
  `--bias-rate` x sign(mean load - load of expert e). Hash-routed layers use a fixed seeded random `tid2eid`
  (K distinct experts per token id).
- Quantization-aware tail: during the last `--qat-frac` of the steps, every FP8 linear and routed expert is replaced
  in the forward pass by its shipped quantization (FP8 e4m3 with a power-of-two scale per 128x128 block; MXFP4 e2m1
  with a power-of-two scale per 32 inputs), straight-through in the backward pass, so the shipped checkpoint loses
  little to its quantization.

Outputs: `<run-dir>/params.npz` (float32 master weights under their official names, experts stacked [E, out, in],
plus tid2eid and the gate biases; `__config__` holds config.json), `<run-dir>/train_log.json`, and the checkpoint in
`--out-dir`: config.json + model.safetensors (exactly the tensors `dsv4_jax.params.disk_tensor_specs(cfg)` lists)
+ tokenizer.json (copied when the tokenizer lives elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from dsv4_jax.config import ModelConfig, to_hf_config  # noqa: E402
from dsv4_jax.params import disk_tensor_specs, expert_disk_names, tree_set, weight_specs  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_DIR = os.path.join(REPO, "data", "corpus")   # inside the repository; data/ is gitignored
DEFAULT_OUT = os.path.join(REPO, "dsv4_jax", "default_model")
BOS, EOS = 0, 1
T_START = time.time()


def default_config() -> ModelConfig:
    """The shipped default model: ~16M parameters, ~4M active per token."""
    return ModelConfig(
        vocab_size=4096, dim=256, n_layers=6, n_heads=4, head_dim=128, rope_head_dim=64,
        q_lora_rank=128, o_groups=2, o_lora_rank=64,
        compress_ratios=(0, 4, 128, 4, 128, 4, 0), n_mtp_layers=1, window_size=128,
        index_n_heads=4, index_head_dim=128, index_topk=32,
        n_routed_experts=16, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=128, route_scale=1.5,
        n_hash_layers=2, max_position_embeddings=4096)


# ---- data ----------------------------------------------------------------------------------------------------

def read_documents(path: str) -> list[str]:
    """One document (chapter) per blank-line-separated block, as scripts/train_tokenizer.py reads them."""
    with open(path, encoding="utf-8") as f:
        return [d + "\n" for d in f.read().split("\n\n") if d.strip()]


def token_stream(tokenizer, path: str) -> np.ndarray:
    """All documents as one int32 stream, each one BOS + tokens + EOS."""
    docs = read_documents(path)
    parts = [np.array([BOS] + enc.ids + [EOS], np.int32) for enc in tokenizer.encode_batch(docs)]
    return np.concatenate(parts)


def eval_windows(stream: np.ndarray, window: int):
    """Non-overlapping windows: inputs stream[kW : kW+W], targets stream[kW+1 : kW+W+1]; every token but the first
    is predicted exactly once. The last window is padded with EOS (mask 0). Returns (inputs, targets, mask)."""
    n_pred = len(stream) - 1
    n_win = -(-n_pred // window)
    inputs = np.full((n_win, window), EOS, np.int32)
    targets = np.full((n_win, window), EOS, np.int32)
    mask = np.zeros((n_win, window), np.float32)
    for k in range(n_win):
        a = k * window
        m = min(window, n_pred - a)
        inputs[k, :m] = stream[a:a + m]
        targets[k, :m] = stream[a + 1:a + 1 + m]
        mask[k, :m] = 1.0
    return inputs, targets, mask


# ---- parameters ----------------------------------------------------------------------------------------------

def init_train_params(cfg: ModelConfig, seed: int):
    """(trainable float32 params {official name: array}, buffers {name: array}: tid2eid int32 and gate.bias f32).
    Initialisation follows weight_specs' std, with the residual-output projections scaled by 1/sqrt(2 n_layers),
    zero attention sinks and zero gate biases."""
    rng = np.random.default_rng(seed)
    depth_scale = 1.0 / math.sqrt(2 * (cfg.n_layers + cfg.n_mtp_layers))
    params, buffers = {}, {}
    for spec in weight_specs(cfg):
        name = spec.name
        if spec.fmt == "i64":     # hash routing: K distinct experts per token id, fixed
            buffers[name] = np.argsort(rng.random((cfg.vocab_size, cfg.n_routed_experts)), axis=1)[
                :, :cfg.n_activated_experts].astype(np.int32)
            continue
        if name.endswith("gate.bias"):
            buffers[name] = np.zeros(spec.shape, np.float32)
            continue
        if name.endswith("attn_sink"):
            value = np.zeros(spec.shape, np.float32)
        elif spec.init_std == 0.0:
            value = np.ones(spec.shape, np.float32)
        elif name.endswith("_scale") and "hc_" in name:
            value = np.full(spec.shape, 1.0, np.float32)
        else:
            std = spec.init_std
            if name.endswith(("attn.wo_b.weight", "w2.weight")):
                std *= depth_scale
            value = (std * rng.standard_normal(spec.shape)).astype(np.float32)
        params[name] = value
    return params, buffers


def build_tree(cfg: ModelConfig, params: dict, buffers: dict) -> dict:
    """Nested parameter tree (as dsv4_jax.params.init_params makes) from flat {name: array} dicts."""
    tree: dict = {}
    for name, value in list(params.items()) + list(buffers.items()):
        tree_set(tree, name, value)
    return tree


def quant_names(cfg: ModelConfig):
    specs = weight_specs(cfg)
    return ({s.name for s in specs if s.fmt == "fp8"}, {s.name for s in specs if s.fmt == "mxfp4"})


# ---- fake quantization of weights (shipped formats) -----------------------------------------------------------

def _pow2_ceil(x):
    mantissa, exponent = jnp.frexp(x)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.ldexp(jnp.ones_like(x), exponent)


def fp8_block_quant(w: jax.Array, block: int = 128) -> jax.Array:
    """Dequantized FP8 e4m3 with one power-of-two scale per block x block tile (what export writes)."""
    rows, cols = w.shape
    pr, pc = -rows % block, -cols % block
    wp = jnp.pad(w, ((0, pr), (0, pc)))
    tiles = wp.reshape((rows + pr) // block, block, (cols + pc) // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(tiles), axis=(1, 3), keepdims=True), 1e-30)
    scale = _pow2_ceil(amax / 448.0)
    q = jnp.clip(tiles / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return q.reshape(wp.shape)[:rows, :cols]


def mxfp4_quant(w: jax.Array) -> jax.Array:
    """Dequantized MXFP4: e2m1 (round to nearest even) with one power-of-two scale per 32 inputs."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), 6.0 * 2.0 ** -126)
    scale = _pow2_ceil(amax / 6.0)
    q = jnp.clip(blocks / scale, -6.0, 6.0).astype(jnp.float4_e2m1fn).astype(jnp.float32) * scale
    return q.reshape(w.shape)


def apply_qat(params: dict, fp8_names, fp4_names, qat) -> dict:
    """Forward with the shipped quantization when qat == 1 (straight-through), the master weights when qat == 0."""
    out = dict(params)
    # sorted: a set's order changes from process to process, and with it the program (no compilation cache hit)
    for name in sorted(fp8_names):
        w = params[name]
        out[name] = w + qat * jax.lax.stop_gradient(fp8_block_quant(w) - w)
    for name in sorted(fp4_names):
        w = params[name]
        out[name] = w + qat * jax.lax.stop_gradient(mxfp4_quant(w) - w)
    return out


# ---- loss -----------------------------------------------------------------------------------------------------

def _cross_entropy(logits, targets, mask):
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)


def forward_losses(params, buffers, inputs, targets, mask, next_targets, next_mask, qat, *, cfg, ctx, qnames):
    """Sums and counts of the main and MTP cross-entropies, the mean indexer KL over the CSA layers, and the
    expert loads of the score-routed layers [layers, E] (the model's training statistics, ctx.training)."""
    from dsv4_jax.layers.chunk import Chunk
    from dsv4_jax.model import backbone, head_logits, mtp_block
    from dsv4_jax.state import init_state
    batch, seq = inputs.shape
    tree = build_tree(cfg, apply_qat(params, *qnames, qat), buffers)
    state = init_state(cfg, batch, seq, jnp.float32)
    start = jnp.zeros((batch,), jnp.int32)
    n_valid = jnp.full((batch,), seq, jnp.int32)
    X, _, stats, _ = backbone(tree, cfg, ctx, Chunk(inputs, start, n_valid), state.layers)
    main_sum, main_count = _cross_entropy(head_logits(tree, tree, cfg, X, ctx), targets, mask)
    mtp_logits, _, mtp_stats = mtp_block(tree, cfg, ctx, X, Chunk(targets, start, n_valid), state.mtp[0])
    mtp_sum, mtp_count = _cross_entropy(mtp_logits, next_targets, next_mask)
    stats = stats + [mtp_stats]
    kls = [s["indexer_kl"] for s in stats if "indexer_kl" in s]
    kl = sum(kls) / max(len(kls), 1)
    loads = [s["expert_load"] for s in stats if "expert_load" in s]
    loads = jnp.stack(loads) if loads else jnp.zeros((0, cfg.n_routed_experts))
    return main_sum, main_count, mtp_sum, mtp_count, kl, loads


def split_batch(tokens):
    """tokens [B, S+2] -> inputs, targets, mask, next-next targets, their mask."""
    inputs, targets, nxt = tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]
    ones = jnp.ones(inputs.shape, jnp.float32)
    return inputs, targets, ones, nxt, ones


# ---- optimiser --------------------------------------------------------------------------------------------------

def adamw_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": jax.tree_util.tree_map(jnp.zeros_like, params), "t": jnp.zeros((), jnp.int32)}


def adamw_update(params, grads, opt, lr, *, b1, b2, eps, weight_decay, decay_names):
    t = opt["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    c1 = 1 - b1 ** t.astype(jnp.float32)
    c2 = 1 - b2 ** t.astype(jnp.float32)
    new = {}
    for name, p in params.items():
        step = (m[name] / c1) / (jnp.sqrt(v[name] / c2) + eps)
        if name in decay_names:
            step = step + weight_decay * p
        new[name] = p - lr * step
    return new, {"m": m, "v": v, "t": t}


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- export -----------------------------------------------------------------------------------------------------

def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    m, e = np.frexp(amax / qmax)
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def quantize_fp8_np(w: np.ndarray, block: int = 128):
    """[out, in] float32 -> (e4m3 [out, in], E8M0 bytes [ceil(out/128), ceil(in/128)])."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    pad = np.zeros((br * block, bc * block), np.float32)
    pad[:rows, :cols] = np.abs(w)
    amax = np.maximum(pad.reshape(br, block, bc, block).max(axis=(1, 3)), 1e-30)
    k = np.clip(_pow2_exponent(amax, 448.0), -127, 127)
    s = np.repeat(np.repeat(np.exp2(k.astype(np.float32)), block, 0), block, 1)[:rows, :cols]
    q = np.clip(w / s, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q, (k + 127).astype(np.uint8)


def quantize_mxfp4_np(w: np.ndarray):
    """[..., out, in] float32 -> (packed e2m1 pairs uint8 [..., out, in/2], low nibble first; E8M0 [..., in/32])."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.maximum(np.abs(blocks).max(axis=-1), 6.0 * 2.0 ** -126)
    k = np.clip(_pow2_exponent(amax, 6.0), -127, 127)
    y = np.clip(blocks / np.exp2(k.astype(np.float32))[..., None], -6.0, 6.0)
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(w.shape) & 0xF
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (k + 127).astype(np.uint8)


def export_checkpoint(cfg: ModelConfig, params: dict, buffers: dict, out_dir: str, tokenizer_path: str,
                      metadata: dict | None = None) -> dict:
    """Write config.json + model.safetensors (+ tokenizer.json) in the official format. Returns file sizes."""
    from dsv4_jax.checkpoint import write_safetensors
    os.makedirs(out_dir, exist_ok=True)
    values = {**{k: np.asarray(v, np.float32) for k, v in params.items()},
              **{k: np.asarray(v) for k, v in buffers.items()}}
    tensors: dict = {}
    for spec in weight_specs(cfg):
        w = values[spec.name]
        if spec.fmt == "bf16":
            tensors[spec.name] = ("BF16", w.astype(ml_dtypes.bfloat16))
        elif spec.fmt == "f32":
            tensors[spec.name] = ("F32", w.astype(np.float32))
        elif spec.fmt == "i64":
            tensors[spec.name] = ("I64", w.astype(np.int64))
        elif spec.fmt == "fp8":
            q, scale = quantize_fp8_np(w)
            tensors[spec.name] = ("F8_E4M3", q)
            tensors[spec.name[:-len("weight")] + "scale"] = ("F8_E8M0", scale)
        else:
            packed, scale = quantize_mxfp4_np(w)
            for e in range(spec.shape[0]):
                name = expert_disk_names(spec, e)
                tensors[name] = ("I8", packed[e])
                tensors[name[:-len("weight")] + "scale"] = ("F8_E8M0", scale[e])
    expected = disk_tensor_specs(cfg)
    assert set(tensors) == set(expected), sorted(set(tensors) ^ set(expected))[:5]
    for name, (dtypes, shape) in expected.items():
        assert tensors[name][0] == dtypes[0] and tuple(tensors[name][1].shape) == tuple(shape), name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f, indent=2)
        f.write("\n")
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt", **(metadata or {})})
    tok_dst = os.path.join(out_dir, "tokenizer.json")
    if os.path.abspath(tokenizer_path) != os.path.abspath(tok_dst):
        shutil.copyfile(tokenizer_path, tok_dst)
    return {f: os.path.getsize(os.path.join(out_dir, f)) for f in ("config.json", "model.safetensors",
                                                                    "tokenizer.json")}


def save_npz(path: str, cfg: ModelConfig, params: dict, buffers: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    arrays = {k: np.asarray(v) for k, v in {**params, **buffers}.items()}
    arrays["__config__"] = np.array(json.dumps(to_hf_config(cfg)))
    np.savez(path, **arrays)


def load_npz(path: str):
    """(config, params float32 {name: array}, buffers {name: array}) from a params.npz of this script."""
    from dsv4_jax.config import from_hf_config
    with np.load(path) as z:
        cfg = from_hf_config(json.loads(str(z["__config__"])), source=path)
        arrays = {k: z[k] for k in z.files if k != "__config__"}
    buffers = {k: v for k, v in arrays.items() if k.endswith(("gate.tid2eid", "gate.bias"))}
    params = {k: v for k, v in arrays.items() if k not in buffers}
    return cfg, params, buffers


# ---- main ---------------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", default=os.path.join(CORPUS_DIR, "train.txt"))
    ap.add_argument("--valid", default=os.path.join(CORPUS_DIR, "valid.txt"))
    ap.add_argument("--tokenizer", default=os.path.join(DEFAULT_OUT, "tokenizer.json"))
    ap.add_argument("--out-dir", default=DEFAULT_OUT, help="where the official-format checkpoint is written")
    ap.add_argument("--run-dir", default=os.path.join(REPO, "out", "train_tiny"),
                    help="params.npz and train_log.json")
    ap.add_argument("--steps", type=int, default=1200, help="maximum number of optimiser steps")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="wall-clock seconds for the whole run up to the end of training (compilation included); "
                         "after 20 steps the step count and LR schedule are fitted to the time left (0: no limit)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512, help=">= 256 so the ratio-128 layers hold entries")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--final-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--indexer-weight", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-2, help="gate.bias load-balancing step (gamma)")
    ap.add_argument("--qat-frac", type=float, default=0.3,
                    help="fraction of the steps, at the end, trained through the shipped weight quantization")
    ap.add_argument("--moe-capacity", type=float, default=-1.0,
                    help="expert capacity factor for capacity-slot dispatch in training (0: exact grouped matmul; "
                         "default: 2 on CPU, where the grouped matmul is slow, 0 elsewhere)")
    ap.add_argument("--no-simulate-quant", action="store_true", help="train without the activation fake quant")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-eval-windows", type=int, default=0, help="evaluate on the first N valid windows (0: all)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-export", action="store_true")
    args = ap.parse_args(argv)
    if args.seq_len < 256:
        ap.error("--seq-len must be >= 256 so that the ratio-128 (HCA) layers produce compressed entries")

    from tokenizers import Tokenizer
    from dsv4_jax.run_context import RunContext, Training

    if args.moe_capacity < 0:
        args.moe_capacity = 2.0 if jax.default_backend() == "cpu" else 0.0
    cfg = default_config()
    ctx = RunContext.create(dtype="float32", simulate_quant=not args.no_simulate_quant, kernels="reference",
                            training=Training(straight_through=True, moe_capacity=args.moe_capacity))
    qnames = tuple(frozenset(s) for s in quant_names(cfg))
    t0 = time.time()
    tokenizer = Tokenizer.from_file(args.tokenizer)
    tokenizer.encode_special_tokens = True  # documents and prompts are text: special-token strings in them stay text
    train_stream = token_stream(tokenizer, args.train)
    valid_stream = token_stream(tokenizer, args.valid)
    v_in, v_tgt, v_mask = eval_windows(valid_stream, args.seq_len)
    if args.max_eval_windows:
        v_in, v_tgt, v_mask = v_in[:args.max_eval_windows], v_tgt[:args.max_eval_windows], v_mask[:args.max_eval_windows]
    print(f"devices: {jax.devices()}")
    print(f"data: train {len(train_stream):,} tokens, valid {len(valid_stream):,} tokens "
          f"({len(v_in)} windows of {args.seq_len}); tokenized in {time.time() - t0:.1f}s", flush=True)

    params_np, buffers_np = init_train_params(cfg, args.seed)
    n_params = sum(v.size for v in params_np.values())
    n_expert = sum(v.size for k, v in params_np.items() if ".experts." in k)
    print(f"model: {n_params:,} parameters ({n_expert:,} in routed experts; "
          f"~{n_params - n_expert * (1 - cfg.n_activated_experts / cfg.n_routed_experts):,.0f} active per token)")
    params = jax.device_put(params_np)
    buffers = jax.device_put(buffers_np)
    opt = adamw_init(params)
    decay_names = frozenset(k for k, v in params_np.items() if k.endswith(".weight") and v.ndim >= 2)
    score_bias_names = [s.name for s in weight_specs(cfg) if s.name.endswith("gate.bias")]
    losses = functools.partial(forward_losses, cfg=cfg, ctx=ctx, qnames=qnames)

    def loss_fn(params, buffers, tokens, qat):
        inputs, targets, mask, nxt, nmask = split_batch(tokens)
        ms, mc, ts, tc, kl, loads = losses(params, buffers, inputs, targets, mask, nxt, nmask, qat)
        main, mtp = ms / mc, ts / tc
        return main + args.mtp_weight * mtp + args.indexer_weight * kl, (main, mtp, kl, loads)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_step(params, opt, buffers, tokens, lr, qat):
        (loss, (main, mtp, kl, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, buffers, tokens, qat)
        gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        factor = jnp.minimum(1.0, args.clip / (gnorm + 1e-6))
        grads = jax.tree_util.tree_map(lambda g: g * factor, grads)
        params, opt = adamw_update(params, grads, opt, lr, b1=0.9, b2=0.95, eps=1e-8,
                                   weight_decay=args.weight_decay, decay_names=decay_names)
        loads = loads.astype(jnp.float32)
        buffers = dict(buffers)
        for i, name in enumerate(score_bias_names):
            buffers[name] = buffers[name] + args.bias_rate * jnp.sign(jnp.mean(loads[i]) - loads[i])
        imbalance = jnp.max(loads, axis=-1) / jnp.mean(loads, axis=-1)
        return params, opt, buffers, {"loss": loss, "main": main, "mtp": mtp, "kl": kl, "gnorm": gnorm,
                                      "max_load": jnp.max(imbalance), "layer_load": imbalance}

    @jax.jit
    def eval_step(params, buffers, inputs, targets, mask, qat):
        nxt = jnp.concatenate([targets[:, 1:], jnp.full((targets.shape[0], 1), EOS, jnp.int32)], axis=1)
        nmask = jnp.concatenate([mask[:, 1:], jnp.zeros((mask.shape[0], 1), jnp.float32)], axis=1)
        ms, mc, ts, tc, kl, _ = losses(params, buffers, inputs, targets, mask, nxt, nmask, qat)
        return ms, mc, ts, tc

    eval_batch = min(args.batch, 16)

    def evaluate(params, buffers, qat):
        tot = np.zeros(4)
        for a in range(0, len(v_in), eval_batch):
            sl = slice(a, a + eval_batch)
            inp, tgt, msk = v_in[sl], v_tgt[sl], v_mask[sl]
            if len(inp) < eval_batch:     # pad to one shape (one compilation)
                pad = eval_batch - len(inp)
                inp = np.concatenate([inp, np.full((pad, inp.shape[1]), EOS, np.int32)])
                tgt = np.concatenate([tgt, np.full((pad, tgt.shape[1]), EOS, np.int32)])
                msk = np.concatenate([msk, np.zeros((pad, msk.shape[1]), np.float32)])
            tot += np.array(jax.device_get(eval_step(params, buffers, inp, tgt, msk, jnp.float32(qat))), np.float64)
        return tot[0] / tot[1], tot[2] / tot[3]

    rng = np.random.default_rng(args.seed + 1)
    span = args.seq_len + 2

    def batch_tokens():
        starts = rng.integers(0, len(train_stream) - span, args.batch)
        return np.stack([train_stream[s:s + span] for s in starts])

    log = {"config": to_hf_config(cfg), "args": vars(args), "steps": [], "evals": []}
    total = args.steps
    qat_start = int(round(total * (1 - args.qat_frac)))
    calibrate = 20 if args.time_budget > 0 else 0
    best = None                 # (valid loss, step, host params, host buffers): best eval of the QAT phase
    step = 0
    tokens_seen = 0
    metrics = None

    def run_eval(qat):
        te = time.time()
        v_main, v_mtp = evaluate(params, buffers, qat)
        rec = {"step": step, "qat": qat, "valid_loss": v_main, "valid_ppl": math.exp(v_main),
               "valid_mtp_loss": v_mtp, "eval_s": round(time.time() - te, 1)}
        log["evals"].append(rec)
        print(f"  valid loss {v_main:.4f} ppl {math.exp(v_main):.2f} mtp {v_mtp:.4f} (qat {qat:.0f}, "
              f"{time.time() - te:.1f}s)", flush=True)
        return v_main

    t_compile = time.time()
    while step < total:
        qat = 1.0 if step >= qat_start else 0.0
        lr = lr_at(step, total, args.lr, args.warmup, args.final_lr_frac)
        params, opt, buffers, metrics = train_step(params, opt, buffers, batch_tokens(), jnp.float32(lr),
                                                   jnp.float32(qat))
        if step == 0:
            jax.block_until_ready(metrics)
            print(f"compiled train step in {time.time() - t_compile:.1f}s", flush=True)
            t_train0 = time.time()
        step += 1
        tokens_seen += args.batch * args.seq_len
        if args.time_budget > 0 and time.time() - T_START > 1.1 * args.time_budget and step < total:
            print(f"time budget exceeded at step {step}: stopping", flush=True)
            total = step
        if step % args.log_every == 0 or step == total or step == calibrate:
            m = {k: (np.asarray(v).round(3).tolist() if np.ndim(v) else float(v))
                 for k, v in jax.device_get(metrics).items()}
            elapsed = time.time() - t_train0
            log["steps"].append({"step": step, "lr": lr, "qat": qat, "time": round(elapsed, 1),
                                 "tokens": tokens_seen, **m})
            print(f"step {step:5d}/{total} lr {lr:.2e} qat {qat:.0f} loss {m['loss']:.3f} main {m['main']:.3f} "
                  f"mtp {m['mtp']:.3f} idx_kl {m['kl']:.3f} gnorm {m['gnorm']:.2f} max_load {m['max_load']:.2f} "
                  f"[{elapsed:.0f}s]", flush=True)
        if step == calibrate:
            # Fit the schedule to the time left (the first evaluation, which compiles, is done here first).
            jax.block_until_ready(metrics)
            per_step = (time.time() - t_train0) / (calibrate - 1)
            run_eval(qat)
            left = args.time_budget - (time.time() - T_START)
            n_evals = max(1, (total - step) // args.eval_every)
            eval_s = log["evals"][-1]["eval_s"]
            fitted = step + int(max(0.0, 0.95 * left - n_evals * min(eval_s, 5.0)) / per_step)
            if fitted < total:
                total = max(fitted, step + 1)
                qat_start = max(step, int(round(total * (1 - args.qat_frac))))
            print(f"step time {per_step * 1000:.1f} ms, {left:.0f}s left -> {total} steps "
                  f"(QAT from step {qat_start})", flush=True)
        if step % args.eval_every == 0 or step == total:
            v = run_eval(qat)
            if qat == 1.0 and (best is None or v < best[0]):
                best = (v, step, jax.device_get(params), jax.device_get(buffers))
    jax.block_until_ready(metrics)
    train_time = time.time() - t_train0
    log.update(train_seconds=round(train_time, 1), total_steps=step, tokens_seen=tokens_seen,
               epochs=tokens_seen / len(train_stream), devices=[str(d) for d in jax.devices()],
               train_tokens=len(train_stream), valid_tokens=len(valid_stream))
    print(f"trained {step} steps, {tokens_seen:,} tokens ({log['epochs']:.1f} epochs) in {train_time:.0f}s")

    chosen = step
    if best is not None and best[1] != step and best[0] < log["evals"][-1]["valid_loss"]:
        chosen = best[1]
        params, buffers = jax.device_put(best[2]), jax.device_put(best[3])
        print(f"keeping the best QAT-phase evaluation, step {chosen} (valid loss {best[0]:.4f})")
    log["exported_step"] = chosen
    final = {}
    for name, qat in (("master_f32", 0.0), ("quantized_f32", 1.0)):
        loss, _ = evaluate(params, buffers, qat)
        final[name] = {"loss": loss, "ppl": math.exp(loss)}
    log["final_valid"] = final
    print("final valid (float32 activations): " + ", ".join(
        f"{k} loss {v['loss']:.4f} ppl {v['ppl']:.2f}" for k, v in final.items()))

    params_np = {k: np.asarray(v) for k, v in jax.device_get(params).items()}
    buffers_np = {k: np.asarray(v) for k, v in jax.device_get(buffers).items()}
    os.makedirs(args.run_dir, exist_ok=True)
    save_npz(os.path.join(args.run_dir, "params.npz"), cfg, params_np, buffers_np)
    if not args.no_export:
        sizes = export_checkpoint(cfg, params_np, buffers_np, args.out_dir, args.tokenizer,
                                  {"producer": "scripts/train_tiny.py", "step": chosen})
        log["files"] = sizes
        print("exported to", args.out_dir + ":", ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))
    with open(os.path.join(args.run_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"wrote {args.run_dir}/params.npz, train_log.json; total {time.time() - T_START:.0f}s")


if __name__ == "__main__":
    main()
