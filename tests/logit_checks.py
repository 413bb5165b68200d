"""Comparing a model's logits with a reference's when rounding noise is expected (bf16): both ways, each sequence's
top token must be among the other's top k. Noise moves logits by up to ~17% (relative Frobenius; the default model,
bf16 vs float32 with FP8 activations, benchmarks/bf16_logit_noise.py) without breaking this; an unrelated result
(~100%) breaks it. Shared by tests/test_kernel_dispatch.py and benchmarks/bf16_logit_noise.py."""

import numpy as np


def top_tokens_agree(a, b, k: int = 5) -> bool:
    """a, b logits [..., V]: each row's argmax of a is among b's top k and b's argmax among a's top k."""
    a = np.asarray(a, np.float32).reshape(-1, np.shape(a)[-1])
    b = np.asarray(b, np.float32).reshape(-1, np.shape(b)[-1])
    ta, tb = np.argsort(-a, axis=-1)[:, :k], np.argsort(-b, axis=-1)[:, :k]
    return all(ta[i, 0] in tb[i] and tb[i, 0] in ta[i] for i in range(ta.shape[0]))
