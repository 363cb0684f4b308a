"""Speculative decoding: draft proposers and the per-step acceptance bookkeeping."""
