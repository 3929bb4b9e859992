"""Device kernels of the attention backends (Triton; imported only by the backends
that use them, so a machine without Triton never loads this package's modules)."""
