"""Tensor parallelism on torch.distributed: process groups, collectives, sharding arithmetic,
rendezvous settings and the step broadcast from rank 0 to the workers."""
