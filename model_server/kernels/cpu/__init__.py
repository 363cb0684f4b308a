"""CPU kernels: the decode-friendly matmuls (`linear`) and native C kernels built on first use
(`native`, with their loader)."""
