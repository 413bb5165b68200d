"""The model-level benchmark: `python -m dsv4_jax.bench --help` (bench/__main__.py says what it measures)."""
