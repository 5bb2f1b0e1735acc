"""Shared fixtures: tiny random models of each supported architecture, built with
transformers' own classes and saved to a temporary directory."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import ARCHITECTURES, build_tiny_model


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny_model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny_model(request.param, path)
    return path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Without CUDA, Triton kernels run in Triton's CPU interpreter; this must be set before
# any kernel module is imported.
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
