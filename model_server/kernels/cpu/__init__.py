"""Native CPU kernels (C, built on first use) and their loader."""
