"""The public port's limits (router/edge.py) as the config checks them (on a real socket:
tests/component/test_edge.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("field,value", [("max_header_bytes", 10), ("header_timeout_s", 0),
                                         ("max_connections", 0)])
def test_limits_are_checked_in_the_config(field, value):
    from pdserve.config.loader import parse_args
    from pdserve.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        parse_args({"http": {field: value}}, source="t")
