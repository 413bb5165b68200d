"""A model's decode steps on the "interpret" kernel plan against the reference plan (XLA only), from one state:
shared by the kernel tests that check the model takes their kernel and still gives the jnp path's logits."""

import jax
import jax.numpy as jnp
import numpy as np


def decode_matches_reference(cfg, max_seq_len: int, prompt_len: int, lengths, steps: int = 2, rtol: float = 1e-4,
                             **init_kw) -> None:
    """Prefill two sequences (lengths) on the reference plan, then decode `steps` tokens on both plans from the same
    state; each step's logits must agree to rtol of their largest value (float32 models: the interpret plan's
    matmuls meet float32 as bf16 hi + lo parts, test_kernel_dispatch.py). The reference's tokens and state go on."""
    import dsv4_jax

    kw = dict(dtype="float32", max_seq_len=max_seq_len, max_batch=2, simulate_quant=False, **init_kw)
    reference = dsv4_jax.init_random(cfg, seed=3, kernels="reference", **kw)
    with_kernels = dsv4_jax.init_random(cfg, seed=3, kernels="interpret", **kw)
    prompt = np.random.default_rng(8).integers(0, cfg.vocab_size, (2, prompt_len)).astype(np.int32)
    _, state = reference.prefill(prompt, lengths=np.asarray(lengths, np.int32))
    tokens = jnp.asarray([5, 9], jnp.int32)
    for step in range(steps):
        got, _ = with_kernels.decode(tokens, jax.tree.map(jnp.copy, state))     # decode donates its state
        want, state = reference.decode(tokens, state)
        err = np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max()
        assert err < rtol, (step, err)
        tokens = jnp.argmax(want, axis=-1).astype(jnp.int32)
