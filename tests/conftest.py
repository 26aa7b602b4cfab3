import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these (the
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # GPU machine runs the suite as
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")  # root); mpirun tests inherit


def _has_cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
