"""`nixl_connect.metrics`: the Rust core's metrics in a real `prometheus_client` registry."""
import asyncio

import pytest

from conftest import waited

prometheus_client = pytest.importorskip("prometheus_client")


def _value(text, name, **labels):
    """The sample `name{labels}` in Prometheus text, or None."""
    for family in prometheus_client.parser.text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def test_metrics_collector_shows_operations_in_generate_latest():
    import nixl_connect as nc
    import nixl_connect.metrics

    registry = prometheus_client.CollectorRegistry()
    registry.register(nixl_connect.metrics.collector)
    before = prometheus_client.generate_latest(registry).decode()
    read_before = _value(before, "nixl_connect_bytes_total", op="read", side="active", path="local") or 0.0
    ops_before = _value(before, "nixl_connect_operations_total", op="read", side="passive",
                        path="local", status="complete") or 0.0

    a, b = nc.Connector(), nc.Connector()
    for _ in range(3):
        src, dst = bytearray(b"x" * 4096), bytearray(4096)
        with await a.create_readable(nc.Descriptor(src)) as readable:
            with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as read_op:
                await waited(asyncio.gather(read_op.wait_for_completion(), readable.wait_for_completion()))
        assert dst == src

    text = prometheus_client.generate_latest(registry).decode()
    assert _value(text, "nixl_connect_bytes_total", op="read", side="active", path="local") == read_before + 3 * 4096
    assert _value(text, "nixl_connect_operations_total", op="read", side="passive", path="local",
                  status="complete") == ops_before + 3
    count = _value(text, "nixl_connect_operation_duration_seconds_count", op="read", side="active", path="local")
    assert count is not None and count >= 3
    assert _value(text, "nixl_connect_operations_in_flight", op="read", side="active") == 0.0
    assert "# TYPE nixl_connect_errors_total counter" in text


def test_metrics_collector_registers_once_per_registry():
    import nixl_connect.metrics

    registry = prometheus_client.CollectorRegistry()
    registry.register(nixl_connect.metrics.collector)
    with pytest.raises(ValueError):
        registry.register(nixl_connect.metrics.NixlConnectCollector())
    assert nixl_connect.metrics.text().endswith("# EOF\n")
