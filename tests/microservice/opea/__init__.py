"""GenAIComps' real megaservice around Wick's microservice: `megaservice.py` runs under a venv
of its own with opea-comps (see `env.py`), the tests drive it over HTTP."""
