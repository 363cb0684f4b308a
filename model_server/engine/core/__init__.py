"""Pure bookkeeping of the engine (no torch): requests, the scheduler, the KV block manager."""
