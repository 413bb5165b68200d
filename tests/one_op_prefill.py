"""A model prefill with one op on the interpret plan (every other op on the reference) beside the same model on the
reference plan: for the tests of the ops' prefill kernels."""

from __future__ import annotations

import numpy as np


def one_op_prefill(cfg, op: str, seed: int, max_seq_len: int, **options):
    """Two float32 models of `cfg` with seed `seed` (more `options` for both, e.g. prefill_chunk) -> prefill(prompt
    [1, S]) -> (the interpret plan's logits' largest difference from the reference plan's, relative to the largest
    reference logit; the choices `op` made)."""
    import dsv4_jax
    from dsv4_jax.ops import choice

    others = [f"{other}=reference" for other in choice.OPS if other != op]
    kw = dict(dtype="float32", max_seq_len=max_seq_len, simulate_quant=False, **options)
    reference = dsv4_jax.init_random(cfg, seed=seed, kernels="reference", **kw)
    with_kernel = dsv4_jax.init_random(cfg, seed=seed, kernels="interpret", kernel_overrides=others, **kw)

    def prefill(prompt: np.ndarray):
        with choice.record_dispatch(op) as choices:
            got, _ = with_kernel.prefill(prompt)
        want, _ = reference.prefill(prompt)
        err = np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max()
        return err, choices

    return prefill
