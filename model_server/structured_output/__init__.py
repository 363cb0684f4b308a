"""Grammar-constrained decoding (structured outputs): what a request asks for
(`StructuredOutputsParams`), the grammar engine that compiles it (`backend.py`), and the manager
that caches compiled grammars and fills the per-step token bitmask (`manager.py`).

Nothing here imports the grammar engine at import time: it loads on the first constrained request.
"""
