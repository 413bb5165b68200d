"""What this device can do, measured in the benchmark's own process: the floors a model step is held against.

- `memory_bandwidth`: XLA's bf16 GEMV on a square weight of >= 256 MB (on a GPU; smaller on a CPU), ten GEMVs
  chained inside one program so launch overhead is not in the figure; bytes of the weight read per GEMV / time.
- `matmul_rate`: XLA's [n, n] x [n, n] matmul with float8_e4m3fn or bfloat16 operands, bf16 output; 2 n^3 / time.
Each is the median over several calls after a warm-up call (which also compiles).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

CHAINED_GEMVS = 10


def median_seconds(fn, calls: int) -> float:
    """Median wall time of fn() (which must return a JAX value) over `calls` calls after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth(weight_bytes: int, calls: int = 10) -> float:
    """Bytes/s of XLA's bf16 GEMV reading a square weight of about `weight_bytes`."""
    side = max(256, int((weight_bytes / 2) ** 0.5) // 256 * 256)
    kw, kx = jax.random.split(jax.random.PRNGKey(0))
    w = jax.random.normal(kw, (side, side), jnp.bfloat16)
    x = jax.random.normal(kx, (1, side), jnp.bfloat16)

    @jax.jit
    def chained(x, w):
        def body(_, x):
            y = jnp.dot(x, w, preferred_element_type=jnp.float32)
            return (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(jnp.bfloat16)   # keep values O(1)
        return jax.lax.fori_loop(0, CHAINED_GEMVS, body, x)

    seconds = median_seconds(lambda: chained(x, w), calls)
    return CHAINED_GEMVS * side * side * 2 / seconds


def matmul_rate(n: int, dtype=jnp.float8_e4m3fn, calls: int = 10) -> float:
    """FLOP/s of XLA's n x n x n matmul with `dtype` operands (bf16 output)."""
    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16))
    return 2.0 * n ** 3 / median_seconds(lambda: f(a, b), calls)
