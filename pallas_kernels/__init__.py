"""Pallas kernels for v41jax, each beside the jnp reference that defines it."""
