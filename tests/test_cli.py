"""The `jaxstream` dispatcher: what every command runs under."""
import argparse

import numpy as np  # noqa: F401  (loads numpy's BLAS, so threadpoolctl can see it)
import pytest
from threadpoolctl import threadpool_info

from jaxstream import cli


def _blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_commands_run_with_single_threaded_blas(monkeypatch):
    """numpy's BLAS threads would fight XLA's for the cores (the host front end's filterbank product): every
    command runs with BLAS limited to one thread, and the limit is lifted afterwards."""
    before = _blas_threads()
    if not before:
        pytest.skip("numpy's BLAS is not one that threadpoolctl controls")
    seen = []

    def probe_parser():
        parser = argparse.ArgumentParser()
        parser.set_defaults(command="probe", func=lambda args: seen.append(_blas_threads()))
        return parser

    monkeypatch.setattr(cli, "build_parser", probe_parser)
    assert cli.main([]) == 0
    assert seen == [{1}] and _blas_threads() == before
