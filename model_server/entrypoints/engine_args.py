"""Engine flags shared by every subcommand (`generate`, `bench`, `worker`, `serve`); names mirror
vLLM's. Declared in model_server/settings_spec.py."""

from __future__ import annotations

import argparse

from model_server.settings_spec import add_arguments


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags with their defaults (these commands do not read the environment)."""
    add_arguments(parser, "engine", from_environment=False)
