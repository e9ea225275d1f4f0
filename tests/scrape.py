"""Test helper: one labelled counter from a server's /metrics (Prometheus text, prometheus-client's parser)."""

from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families


def labelled(url: str, sample_name: str, label: str, timeout_s: float = 5.0) -> Counter:
    """``{value of label: sum of sample_name over the other labels}`` scraped from ``<url>/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    out: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name:
                out[sample.labels.get(label, "")] += sample.value
    return out
