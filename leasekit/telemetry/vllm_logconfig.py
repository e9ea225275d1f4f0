"""The logging config that makes stock vLLM's own log lines lease evidence (the stock-NixlConnector
chaos target): vLLM's default format plus the record's epoch time and logger name, and the loggers
that carry lease transitions at DEBUG.

Launch the servers with the file :func:`write_logging_config` writes (env
``VLLM_LOGGING_CONFIG_PATH``); :func:`leasekit.telemetry.vllm_log.parse_stock_lease_log` reads P's
log back into lease timelines. Logger names and formats are vllm 0.32.0's (files under
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` unless named otherwise; the lines
themselves are listed in :mod:`leasekit.telemetry.vllm_log`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

GRANT_LOGGER = f"{_NIXL}.pull_scheduler"
"""Logger of the grant line (``init_logger(__name__)`` in ``nixl/pull_scheduler.py``)."""

PUSH_GRANT_LOGGER = f"{_NIXL}.push_scheduler"
"""Logger of push mode's grant line (``nixl/push_scheduler.py``, vLLM's NixlPushConnector). At DEBUG it
also logs a few lines per push request, each with its ``kv_transfer_params``, and one per scheduling
attempt of a request waiting for KV blocks (``get_num_new_matched_tokens``): more than pull mode's
grant logger, still per request, not per idle step."""

WORKER_LOGGER = f"{_NIXL}.base_worker"
"""Logger of the heartbeat and expiry lines (``nixl/base_worker.py``)."""

PULL_WORKER_LOGGER = f"{_NIXL}.pull_worker"
"""Logger of the late-read line (``nixl/pull_worker.py``)."""

RELEASE_LOGGER = "vllm.v1.core.sched.scheduler"
"""Logger of "Finished sending KV transfer" (``vllm/v1/core/sched/scheduler.py``): the direct
evidence of a release. Six DEBUG calls in all, none per step on P, so DEBUG costs little."""

LEASE_LOGGERS = (GRANT_LOGGER, PUSH_GRANT_LOGGER, WORKER_LOGGER, PULL_WORKER_LOGGER)
"""The loggers that carry the lease events proper."""

DEFAULT_DEBUG_LOGGERS = (*LEASE_LOGGERS, RELEASE_LOGGER)
"""Loggers :func:`write_logging_config` sets to DEBUG by default; every other stays INFO."""

DATE_FORMAT = "%m-%d %H:%M:%S"
"""vLLM's default ``datefmt`` (``vllm/logger.py: _DATE_FORMAT``)."""

LOG_FORMAT = (
    "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s.%(msecs)03d "
    "t=%(created).6f %(name)s [%(fileinfo)s:%(lineno)d] %(message)s"
)
"""vLLM's default format (``vllm/logger.py: _FORMAT``) plus milliseconds, the record's epoch seconds
(``t=``, ``time.time()`` at the call: P's wall clock, microsecond resolution) and the logger name."""


def logging_config(
    *, stream: str = "ext://sys.stdout", prefix: str = "", debug_loggers: Iterable[str] = DEFAULT_DEBUG_LOGGERS
) -> dict:
    """The ``logging.config.dictConfig`` dict :func:`write_logging_config` writes.

    vLLM's ``DEFAULT_LOGGING_CONFIG`` (vllm 0.32.0 ``vllm/logger.py``) with only these changes: the
    format is :data:`LOG_FORMAT`, the handler passes DEBUG, and ``debug_loggers`` are set to DEBUG
    (they propagate to the ``vllm`` logger's handler); the ``vllm`` logger stays INFO. The
    formatter is vLLM's ``NewLineFormatter`` (continuation lines repeat the prefix) and the handler
    keeps the name ``vllm`` (``vllm/logger.py: current_formatter_type`` looks it up by name).

    Args:
        stream: the handler's stream, as ``VLLM_LOGGING_STREAM`` (default ``ext://sys.stdout``).
        prefix: ``VLLM_LOGGING_PREFIX`` to put before every line (the parser tolerates any prefix).
        debug_loggers: logger names to set to DEBUG.
    """
    fmt = {
        "()": "vllm.logging_utils.NewLineFormatter",
        "datefmt": DATE_FORMAT,
        "format": prefix + LOG_FORMAT,
        # "INFO" as in vLLM's default: [file.py:line] rather than a relative path.
        "log_level": "INFO",
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": fmt},
        "handlers": {
            "vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "DEBUG", "stream": stream},
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            **{name: {"level": "DEBUG"} for name in debug_loggers},
        },
    }


def write_logging_config(
    path: str | Path, *, stream: str = "ext://sys.stdout", prefix: str = "",
    debug_loggers: Iterable[str] = DEFAULT_DEBUG_LOGGERS,
) -> Path:
    """Write the JSON logging config for vLLM servers whose P log
    :func:`leasekit.telemetry.vllm_log.parse_stock_lease_log` reads.

    Use it with ``VLLM_LOGGING_CONFIG_PATH=<path>`` (vLLM loads it with ``json.loads`` +
    ``dictConfig`` in every process: API server, EngineCore, workers; ``vllm/logger.py:
    _configure_vllm_root_logger``). A custom config replaces vLLM's default entirely, so
    ``VLLM_LOGGING_LEVEL`` no longer applies; ``VLLM_CONFIGURE_LOGGING`` must stay 1 (vLLM raises
    otherwise). See :func:`logging_config` for the content and the arguments.

    Returns:
        ``path`` as a :class:`~pathlib.Path` (parent directories are created).

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = logging_config(stream=stream, prefix=prefix, debug_loggers=debug_loggers)
    out.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
