"""areal-jax: fully asynchronous RL for language-model reasoning, in JAX."""

__version__ = "0.1.0"
