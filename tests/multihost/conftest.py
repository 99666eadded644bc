"""Every test here runs on hosts made of network namespaces (see hosts.py), or skips."""

import pytest

from tests.multihost.hosts import Hosts, unavailable


@pytest.fixture
def make_hosts():
    """``make_hosts(n)``: n fresh hosts, removed after the test with all their processes."""
    why = unavailable()
    if why:
        pytest.skip(why)
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        hosts = Hosts(n).__enter__()
        made.append(hosts)
        return hosts
    yield make
    for hosts in made:
        hosts.close()
