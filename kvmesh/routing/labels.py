"""Prometheus children by label values, kept: ``metric.labels(...)`` takes a lock and builds
tuples on every call, as much as a small part of a routing decision."""

from __future__ import annotations

from typing import Any


class LabelCache:
    """``get(metric, *labels)`` is ``metric.labels(*labels)``, made once per label set."""

    __slots__ = ("_children",)

    def __init__(self) -> None:
        self._children: dict[tuple[object, ...], Any] = {}

    def get(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def forget(self, metric: Any, *labels: str) -> None:
        """Drop a label set (the metric's own ``remove`` is the caller's)."""
        self._children.pop((id(metric), *labels), None)
