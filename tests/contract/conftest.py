"""The contract suites run over every backend present: the `backend` fixture names each one, and
skips with the reason where it is not installed."""

import pytest

from contract import backend_present


@pytest.fixture(params=["fa2", pytest.param("fa3", marks=pytest.mark.sm90), pytest.param("fa4", marks=pytest.mark.sm90)])
def backend(request):
    backend_present(request.param)
    return request.param
