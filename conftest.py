"""Repository-wide pytest setup."""

from __future__ import annotations

import pytest

from model_server.openmp_env import set_openmp_wait_defaults

# Before any test imports torch (see model_server/openmp_env.py): the suite runs on shared CI
# machines too.
set_openmp_wait_defaults()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need CUDA: on machines without one they are deselected (reported as such),
    not collected as skips, so a green CPU run never hides a skipped test.

    Tests that take the `device` fixture (tests/kernels/conftest.py) run on CUDA when it is
    present and interpreted on the CPU otherwise: with CUDA they get the `gpu` mark too, so that
    `pytest -m gpu` selects every test that runs on the GPU.

    `container` tests (podman image builds, minutes, root) run only when asked for by marker:
    `-m container`."""
    if "container" not in (config.getoption("markexpr", "") or ""):
        container = [item for item in items if item.get_closest_marker("container")]
        if container:
            config.hook.pytest_deselected(items=container)
            items[:] = [item for item in items if not item.get_closest_marker("container")]
    try:
        import torch

        if torch.cuda.is_available():
            for item in items:
                if "device" in getattr(item, "fixturenames", ()):
                    item.add_marker(pytest.mark.gpu)
            return
    except ImportError:  # a microservice-only environment has no torch
        pass
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
