"""How a scheduled step reaches the devices: executors, workers, the model runner and what it
builds (input batches, CUDA graphs, the memory profile)."""
