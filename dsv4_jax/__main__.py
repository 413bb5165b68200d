"""`python -m dsv4_jax` is `python -m dsv4_jax.generate`."""

import sys

from .generate import main

sys.exit(main())
