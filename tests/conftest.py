"""Shared fixtures and hypothesis strategies for the pure core."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, settings

# The suite works on tiny tensors and models, where intra-op threading costs more than it
# gains (about 30x slower forwards on a shared 2-core machine).
torch.set_num_threads(1)

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
settings.load_profile("ci")


collect_ignore = ["vllm"]  # the vLLM plugin's tests: `make test-vllm`, in .venv-vllm


def pytest_addoption(parser):
    parser.addoption(
        "--require-scatter",
        action="store_true",
        help="fail (instead of skip) the scatter-backend tests when torch-scatter is missing",
    )
    parser.addoption(
        "--require-quant",
        action="store_true",
        help="fail (instead of skip) the KV-quantization tests when optimum-quanto (the [quant] "
        "extra) is missing",
    )


@pytest.fixture(scope="session")
def quanto(request):
    """optimum.quanto, or a skip (a failure under --require-quant, as `make test-quant` runs)."""
    try:
        import optimum.quanto as module
    except ImportError as e:
        if request.config.getoption("--require-quant"):
            pytest.fail(
                f"optimum-quanto is required for this run (--require-quant) but cannot import: {e}"
            )
        pytest.skip(
            "optimum-quanto is not installed (`make test-quant` installs the [quant] extra)"
        )
    return module


@pytest.fixture
def torch_scatter_available(request):
    if importlib.util.find_spec("torch_scatter") is None:
        if request.config.getoption("--require-scatter"):
            pytest.fail(
                "torch-scatter is required for this run (--require-scatter) but not importable"
            )
        pytest.skip("torch-scatter not installed (run `make test-scatter`)")
    return True
