"""Building blocks of the sampler: batched metadata, penalties and the top-k/top-p/min-p ops.

`model_server.layers.sampler` composes them; import the public API from there.
"""
