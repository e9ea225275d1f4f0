"""W3C trace context of an incoming request, for lease spans that join the request's trace."""

from __future__ import annotations

from typing import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def parent_context(trace_headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The W3C trace context (``traceparent``/``tracestate``) of an incoming request, or None.

    vLLM keeps a request's trace headers on ``Request.trace_headers`` (vllm 0.32.0
    ``vllm/v1/request.py``, filled from the HTTP headers by ``serving.py: _get_trace_headers``);
    a lease span started in this context joins the request's trace (W3C Trace Context spec)."""
    if not trace_headers:
        return None
    ctx = _PROPAGATOR.extract(carrier=dict(trace_headers))
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None
