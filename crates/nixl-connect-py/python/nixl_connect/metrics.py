"""Prometheus metrics of every nixl_connect Connector in this process, for `prometheus_client`.

A Dynamo worker that already serves `/metrics` with `prometheus_client` shows ours with one line::

    import prometheus_client, nixl_connect.metrics
    prometheus_client.REGISTRY.register(nixl_connect.metrics.collector)

Every Connector of the process records into one registry of the Rust core; at each scrape the
collector parses its OpenMetrics text into `prometheus_client` metric families (names, types,
labels and meaning: docs/METRICS.md in the repository, `nixl_connect_*`). `prometheus_client` is
needed only by this module (`pip install prometheus-client`); nothing here runs unless it is
imported.
"""

from typing import Iterator, List

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from . import _core

__all__ = ["NixlConnectCollector", "collector", "text"]


def text() -> str:
    """Every Connector's metrics as OpenMetrics text (ends in `# EOF`)."""
    return _core.metrics_text()


class NixlConnectCollector:
    """A `prometheus_client` collector of the Rust core's metrics (register it once)."""

    def collect(self) -> Iterator[Metric]:
        yield from text_string_to_metric_families(text())

    def describe(self) -> List[Metric]:
        # `CollectorRegistry.register` calls this to refuse duplicate names: the families, as
        # they are now (all of them exist from the start).
        return list(self.collect())


collector = NixlConnectCollector()
"""The collector to register: `prometheus_client.REGISTRY.register(collector)`."""
