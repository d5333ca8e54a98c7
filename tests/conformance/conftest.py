"""The CLIs install in the background while the session's server starts (npm_tools.prefetch)."""

import pytest

from npm_tools import prefetch


@pytest.fixture(scope="session", autouse=True)
def clis_install_in_the_background():
    prefetch()
