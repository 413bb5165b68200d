"""Hashes of the StableHLO text of the engine programs, to show that a change leaves the compiled programs as they
were: run it in two trees (e.g. a checkout of the commit before the change) and compare the lines.

    PYTHONPATH=. python benchmarks/stablehlo_hashes.py > after.txt      # and in the other tree: before.txt
    diff before.txt after.txt

Programs: forward, prefill_chunk, decode_step and generate_chunk of the packaged default model (batch 2), for the
float32 reference plan, bf16 with act_quant fp8 and nvfp4, and the interpret kernel plan. Source locations are
dropped from the text (file paths and line numbers differ between trees).
"""

from __future__ import annotations

import hashlib

import jax.numpy as jnp

import dsv4_jax
from dsv4_jax import engine, generation
from dsv4_jax.sampling import Sampling

CASES = (("float32", "none", "reference"), ("bfloat16", "fp8", "reference"), ("bfloat16", "nvfp4", "reference"),
         ("bfloat16", "none", "interpret"))


def lowered_programs(dtype: str, act_quant: str, kernels: str) -> dict:
    model = dsv4_jax.load(dtype=dtype, act_quant=act_quant, kernels=kernels, max_batch=2)
    ctx, cfg = model.context, model.config
    state = model.init_state(2)
    tokens = jnp.zeros((2, 16), jnp.int32)
    last_logits = jnp.zeros((2, cfg.vocab_size))
    gen = generation.start(state, last_logits, Sampling.rows(2, max_new_tokens=8))[0]
    return {
        "forward": engine.forward.lower(model.params, tokens, cfg=cfg, ctx=ctx),
        "prefill_chunk": engine.prefill_chunk.lower(model.params, state, tokens, jnp.full((2,), 16, jnp.int32),
                                                    last_logits, cfg=cfg, ctx=ctx),
        "decode_step": engine.decode_step.lower(model.params, state, jnp.zeros((2,), jnp.int32), cfg=cfg, ctx=ctx,
                                                max_seq_len=model.max_seq_len),
        "generate_chunk": generation.generate_chunk.lower(model.params, gen, jnp.zeros((2,), bool), cfg=cfg,
                                                          ctx=model.context_for(64), max_seq_len=model.max_seq_len,
                                                          chunk=4),
    }


def main() -> None:
    for case in CASES:
        for name, lowered in lowered_programs(*case).items():
            lines = (line.split(" loc(")[0] for line in lowered.as_text().splitlines() if not line.startswith("#loc"))
            text = "\n".join(lines)
            print(f"{case[0]:9} {case[1]:6} {case[2]:9} {name:15} {hashlib.sha256(text.encode()).hexdigest()[:16]} "
                  f"{len(text)}")


if __name__ == "__main__":
    main()
