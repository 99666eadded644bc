"""Shims over torch's own code must behave as the code they replace."""

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from shoal.runtime.compat import cheap_rendezvous_event_names


def test_rendezvous_event_names_are_the_ones_torch_gives():
    if not hasattr(dynamic_rendezvous, "get_method_name"):
        assert not cheap_rendezvous_event_names()
        pytest.skip("this torch names its rendezvous events otherwise: nothing to replace")
    original = dynamic_rendezvous.get_method_name

    def handler_method(depth):  # stands for a rendezvous handler's method naming its event
        return dynamic_rendezvous.get_method_name(depth)

    def outer(depth):
        return handler_method(depth)

    def names() -> list[str]:
        found = []
        for depth in (0, 1, 2, 3, 500):
            found.append(outer(depth))
        return found

    expected = names()
    assert expected == ["get_method_name", "handler_method", "outer", "names",
                        "no_method_name"]
    try:
        assert cheap_rendezvous_event_names()
        assert dynamic_rendezvous.get_method_name is not original
        assert cheap_rendezvous_event_names()  # a second call keeps the first replacement
        assert names() == expected
    finally:
        dynamic_rendezvous.get_method_name = original
