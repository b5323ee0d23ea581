"""cfir-jax: Coarse-to-Fine Index-shared Retrieval (CFIR) with a Decoupling-BEiT-3 dual encoder in JAX/Flax."""

__version__ = "0.1.0"
