"""The sharded model against the single-device one, run by tests/test_sharding.py in a process of its own with 8
fake CPU devices (jax_num_cpu_devices must be set before JAX starts, and the rest of the suite keeps one device).

    python tests/sharded_checks.py CHECKPOINT_DIR        # exits non-zero with the failed check's message

On meshes of 2, 4 and 8 devices, for a synthetic official-format tiny checkpoint loaded onto the mesh: each
parameter has its planned sharding and each device holds 1 / n of every expert stack's bytes; prefill and
decode-step logits (and at 8 devices forward logits and greedy generated tokens) equal the single-device model's (float32, 1e-5 of the largest logit; fake quant off so that a float32 difference in the
order of the experts' psum cannot move an FP8 rounding); a decode step compiles once; the compiled decode step
holds one all-reduce per layer and no all-gather. A tiny geometry whose heads and shared expert split into whole
FP8 blocks at 8 devices (tensor parallel): logits equal, weights split, two all-reduces per layer, and its layer
statistics (NVFP4 activations) those of one device. Then a 2-layer Flash-geometry decode step lowered for CUDA with the ffi/ kernels planned, at 2 and 8
devices: every routed-expert custom call sees E / n experts, at 8 wq_b's GEMV its local rows, and the program has
one all-reduce per layer at 2 devices, two at 8. And the tiny preset's random weights made on an 8-device mesh
(init_random: each device generates its own shards) are bit for bit those made on one device.
"""

from __future__ import annotations

import collections
import os
import re
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ.get(          # as tests/conftest.py
    "DSV4_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsv4_jax", "jit")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_jax  # noqa: E402
from dsv4_jax import engine, presets  # noqa: E402
from dsv4_jax.params import init_params  # noqa: E402
from dsv4_jax.ops.plan import KernelPlan  # noqa: E402
from dsv4_jax.run_context import RunContext  # noqa: E402
from dsv4_jax.sharding import EXPERT, param_shardings, splits_heads, splits_shared_expert, state_shardings  # noqa: E402
from dsv4_jax.state import init_state  # noqa: E402

MESHES = (2, 4, 8)                           # devices, all along "expert"
KW = dict(dtype="float32", simulate_quant=False, max_seq_len=64, max_batch=2)
COLLECTIVES = r"\b(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\("


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"FAILED: {message}")


def run(model, tokens, everything: bool):
    """prefill logits (prompts of 20 and 7 tokens) and one decode step's logits; with `everything` also the
    forward logits and 6 greedy tokens per prompt (each program costs seconds to load: those at 8 devices only)."""
    forward = np.asarray(model.forward(tokens)) if everything else None
    prefill, state = model.prefill(tokens, np.array([tokens.shape[1], 7], np.int32))
    step, state = model.decode(np.array([5, 9], np.int32), state)
    generated = None
    if everything:
        generated = model.generate([list(tokens[0]), list(tokens[1, :7])], max_new_tokens=6).tokens
    return forward, np.asarray(prefill), np.asarray(step), generated


def check_logits(name: str, whats, got, want, scale: float) -> None:
    """Each named logits array (None: not run) within 1e-5 of the largest single-device logit of one device's."""
    for what, a, b in zip(whats, got, want):
        if a is None:
            continue
        err = np.abs(a - b).max() / scale
        check(err < 1e-5, f"{name}: {what} logits differ from one device's by {err:.3g} of the largest")


def check_decode_step(model, state, name: str, all_reduces_per_layer: int) -> dict:
    """Three more decode steps compile nothing new, and the compiled step holds exactly the given number of
    all-reduces per layer and no other collective. Returns the collectives counted."""
    cfg = model.config
    compiled = engine.decode_step._cache_size()
    for t in range(3):
        _, state = model.decode(np.array([t, t + 1], np.int32), state)
    check(engine.decode_step._cache_size() == compiled, f"{name}: the decode step recompiled")
    hlo = engine.decode_step.lower(model.params, state, jnp.asarray([1, 2], jnp.int32), cfg=cfg,
                                   ctx=model.context, max_seq_len=model.max_seq_len).compile().as_text()
    ops = collections.Counter(re.findall(COLLECTIVES, hlo))
    want = all_reduces_per_layer * cfg.n_layers
    check(ops == {"all-reduce": want}, f"{name}: decode-step collectives {dict(ops)}, want "
                                       f"{all_reduces_per_layer} all-reduce(s) per layer ({want})")
    return dict(ops)


def check_model(directory: str) -> None:
    tokens = np.random.default_rng(95).integers(0, presets.tiny().vocab_size, (2, 20)).astype(np.int32)
    single = dsv4_jax.load(directory, **KW)
    want = run(single, tokens, everything=True)
    scale = np.abs(want[0]).max()
    for n in MESHES:
        mesh = dsv4_jax.make_mesh(n)
        model = dsv4_jax.load(directory, mesh=mesh, **KW)
        cfg, name = model.config, f"{n} devices"
        planned = param_shardings(cfg, mesh, model.params)
        check(jax.tree.all(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), model.params,
                                        planned)), f"{name}: a parameter's sharding is not the planned one")
        for layer in model.params["layers"] + model.params["mtp"]:
            for stack in jax.tree.leaves(layer["ffn"]["experts"]):
                check(all(s.data.nbytes * mesh.shape[EXPERT] == stack.nbytes for s in stack.addressable_shards),
                      f"{name}: an expert shard holds {stack.addressable_shards[0].data.nbytes} of "
                      f"{stack.nbytes} bytes")
        got = run(model, tokens, everything=n == MESHES[-1])
        check_logits(name, ("forward", "prefill", "decode step"), got[:3], want[:3], scale)
        check(got[3] is None or got[3] == want[3], f"{name}: greedy tokens {got[3]} != one device's {want[3]}")
        _, state = model.prefill(tokens)
        ops = check_decode_step(model, state, name, all_reduces_per_layer=1)
        print(f"ok: {name}: logits, tokens, shardings, {ops}")


# The tiny model with heads, output groups and a shared expert that split into whole FP8 blocks over 8 devices
# (sharding.rules): 8 heads of 128, 8 output groups of 128, 1024 hidden units.
TENSOR_PARALLEL = presets.tiny().replace(n_heads=8, head_dim=128, rope_head_dim=64, index_head_dim=128, o_groups=8,
                                         o_lora_rank=128, moe_inter_dim=1024, dim=256)


def check_tensor_parallel() -> None:
    """Attention heads and the shared expert split over 8 devices: prefill and decode logits equal one device's,
    the weights carry the split, a decode step compiles once and holds two all-reduces per layer (attention, MoE)
    and no other collective. (One mesh: each costs seconds of compiling; the rules at 4 devices are
    test_sharding.py's.)"""
    cfg = TENSOR_PARALLEL
    tokens = np.random.default_rng(131).integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)

    def logits(model):
        prefill, state = model.prefill(tokens, np.array([20, 7], np.int32))
        step, state = model.decode(np.array([5, 9], np.int32), state)
        return np.asarray(prefill), np.asarray(step), state

    want = logits(dsv4_jax.init_random(cfg, seed=3, **KW))
    scale = np.abs(want[0]).max()
    n = 8
    name = f"tensor parallel at {n} devices"
    check(splits_heads(cfg, n) and splits_shared_expert(cfg, n), f"{name}: unexpected rules")
    model = dsv4_jax.init_random(cfg, seed=3, mesh=dsv4_jax.make_mesh(n), **KW)
    layer = model.params["layers"][1]
    check(layer["attn"]["wq_b"]["weight"].weight.sharding.spec == jax.sharding.PartitionSpec(EXPERT, None)
          and layer["attn"]["wo_b"]["weight"].scale.sharding.spec == jax.sharding.PartitionSpec(None, EXPERT),
          f"{name}: wq_b / wo_b are not split")
    shared = layer["ffn"]["shared_experts"]["w1"]["weight"].weight.sharding.spec
    check(shared == jax.sharding.PartitionSpec(EXPERT, None), f"{name}: shared expert w1 sharding {shared}")
    got = logits(model)
    check_logits(name, ("prefill", "decode step"), got[:2], want[:2], scale)
    ops = check_decode_step(model, got[2], name, all_reduces_per_layer=2)
    print(f"ok: {name}: logits, shardings, {ops}")


def check_flash_lowering() -> None:
    """A 2-layer Flash-geometry decode step lowered for CUDA devices with the dsv4_jax/ffi/ kernels planned: at 2
    devices the experts split, at 8 also the attention heads and the shared expert (sharding.rules)."""
    from jax._src.pallas.triton import gpu_info

    from dsv4_jax import ffi
    ffi.register = lambda *args: None                  # lowering needs no library
    # Pallas's Triton lowering (the mHC kernels) asks the default device, or an abstract mesh's device, which GPU it
    # compiles for; jit's lowering sets the abstract mesh to the CPU mesh the shardings name, so nothing public can
    # say "an H200" here: tell its probe directly (this process only).
    gpu_info.get_device_kind = lambda: "NVIDIA H200"
    cfg = presets.flash().replace(n_layers=2, compress_ratios=(4, 128, 0), n_hash_layers=1)
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    for n in (2, 8):
        mesh = dsv4_jax.make_mesh(n)
        ctx = RunContext.create(kernels=KernelPlan("auto", "cuda", ffi=True, target="NVIDIA H200"), mesh=mesh)
        on_mesh = lambda tree, shardings: jax.tree.map(  # noqa: E731
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
        params = on_mesh(abstract, param_shardings(cfg, mesh, abstract))
        state = jax.eval_shape(lambda: init_state(cfg, 1, 4096, jnp.bfloat16))
        state = on_mesh(state, state_shardings(state, mesh))
        text = engine.decode_step.trace(params, state, jax.ShapeDtypeStruct((1,), jnp.int32), cfg=cfg, ctx=ctx,
                                        max_seq_len=4096).lower(lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"stablehlo.custom_call @(dsv4_\w+)\(.*?: \((.*?)\) ->", text)
        routed = [operands for target, operands in calls if re.match(r"dsv4_(mx|nv)fp4_gemv", target)]
        local = f"tensor<{cfg.n_routed_experts // n}x"
        check(len(routed) == 2 * cfg.n_layers, f"Flash at {n}: {len(routed)} routed-expert calls, want 2 per layer")
        check(all(operands.split(", ")[1].startswith(local) for operands in routed),
              f"Flash at {n}: a routed-expert call does not see {cfg.n_routed_experts // n} local experts")
        per_layer = 2 if splits_heads(cfg, n) else 1                      # + the attention output's psum
        reduces = text.count("stablehlo.all_reduce")
        check(reduces == per_layer * cfg.n_layers and "all_gather" not in text,
              f"Flash at {n}: {reduces} all-reduces (want {per_layer * cfg.n_layers}), all-gather: "
              f"{'all_gather' in text}")
        heads = cfg.n_heads * cfg.head_dim // (n if splits_heads(cfg, n) else 1)    # wq_b rows this device holds
        fp8 = [operands for target, operands in calls if target.startswith("dsv4_fp8_gemv")]
        check(any(f"x{heads}x{cfg.q_lora_rank}xui8>" in operands for operands in fp8),     # [slot, rows, K] bytes
              f"Flash at {n}: no FP8 GEMV sees wq_b's {heads} local rows")
        print(f"ok: Flash geometry at {n} devices: {len(calls)} custom calls, routed ones on "
              f"{cfg.n_routed_experts // n} experts, {reduces} all-reduces")


def check_random_model() -> None:
    single = dsv4_jax.init_random(presets.tiny(), seed=5, **KW)
    sharded = dsv4_jax.init_random(presets.tiny(), seed=5, mesh=dsv4_jax.make_mesh(8), **KW)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), single.params, sharded.params)
    check(jax.tree.all(same), "init_random on 8 devices: the weights differ from those made on one device")
    stack = sharded.params["layers"][3]["ffn"]["experts"]["w2"]["weight"].packed
    check(stack.addressable_shards[0].data.shape[0] == presets.tiny().n_routed_experts // 8,
          "init_random on 8 devices: the expert stack is not split")
    print("ok: init_random on 8 devices")


def check_serving() -> None:
    """The server's continuous batching on a 2-device mesh (the packaged model): greedy rows equal generate."""
    from dsv4_jax.serving.scheduler import Request, Scheduler
    from serving_runs import run_requests
    model = dsv4_jax.load(dtype="float32", max_seq_len=256, max_batch=4, mesh=dsv4_jax.make_mesh(2))
    tok = model.tokenizer
    prompts = [[tok.bos_id] + tok.encode(p) for p in ("In the beginning", "And it came to pass that", "Then")]
    want = [model.generate([p], max_new_tokens=10 + i).tokens[0] for i, p in enumerate(prompts)]
    scheduler = Scheduler(model, chunk=4).start()
    try:
        got = run_requests(scheduler, [Request(prompt_ids=p, max_tokens=10 + i, on_event=None)
                                       for i, p in enumerate(prompts)])
    finally:
        scheduler.stop()
    check([tokens for tokens, _ in got] == want, f"serving on 2 devices: {got} != generate's {want}")
    print("ok: serving on 2 devices")


def check_stats() -> None:
    """Layer statistics on the 8-device tensor-parallel mesh (experts and heads in shard_map, NVFP4 activations into
    the FP4 experts) against one device's: the streams' and outputs' sizes, routing and mixing equal to rounding, the
    NVFP4 global scales' range equal (pmin / pmax over the devices), and the shares of saturated and
    underflowing block scales equal (the block counts are of the quantizations every device ran)."""
    from dsv4_jax import stats_report
    cfg = TENSOR_PARALLEL
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    kw = dict(KW, act_quant="nvfp4")
    reports = []
    for mesh in (None, dsv4_jax.make_mesh(8)):
        model = dsv4_jax.init_random(cfg, seed=3, mesh=mesh, **kw)
        _, summary = model.forward(tokens, stats=True)
        reports.append(stats_report.report(summary, cfg))
    one, split = reports
    for a, b in zip(one.layers, split.layers, strict=True):
        for key in ("in_resid_rms", "attn_resid_rms", "moe_resid_rms", "attn_out_rms", "moe_out_rms",
                    "router_entropy", "mix_max", "moe_scale_min", "moe_scale_max"):
            # (NVFP4 roundings turn the psums' float32 order differences into ~1e-4 of the streams by layer 3)
            check(np.isclose(a["mean"][key], b["mean"][key], rtol=2e-3), f"stats on the mesh: layer {a['layer']} "
                  f"{key} {b['mean'][key]} != {a['mean'][key]}")
        moved = np.abs(np.subtract(a["expert_load"], b["expert_load"])).sum()      # a routing tie may flip once
        check(moved <= 2, f"stats on the mesh: layer {a['layer']} expert load differs by {moved}")
        check(b["moe_quant_blocks"] > 0 and a["moe_saturated_share"] == b["moe_saturated_share"]
              and a["moe_underflow_share"] == b["moe_underflow_share"],
              f"stats on the mesh: layer {a['layer']} block-scale shares differ")
    check(not one.flags and not split.flags, "stats on the mesh: a healthy model flagged")
    print("ok: layer statistics on the tensor-parallel mesh equal one device's")


if __name__ == "__main__":
    check(len(jax.devices()) == 8, f"expected 8 fake CPU devices, got {jax.devices()}")
    check_model(sys.argv[1])
    check_random_model()
    check_tensor_parallel()
    check_stats()
    check_flash_lowering()
    check_serving()
    print("all sharded checks passed")
