"""The multi-process protocol of `degs eval` and `degs reproduce` (a ``jax.distributed``
job): process groups, barriers, shared values and failure propagation over the
coordination service's key-value store. What the processes do between the barriers
(claim batches, write shards, merge) is in :mod:`degs_jax.eval.runner` and
:mod:`degs_jax.reproduce.study`.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, Optional

import jax
from jax._src import distributed

__all__ = ["PeerProcessError", "ProcessGroup", "process_group", "publish_failure",
           "failures_published", "raise_if_peer_failed", "barrier", "share", "shared",
           "from_process_0", "gathered_on_process_0"]


class PeerProcessError(RuntimeError):
    """Another process of a multi-process `degs eval` or `degs reproduce` failed (its error
    is in the message)."""


# Synchronisation goes through the key-value store of jax.distributed's coordination
# service (the client that jax's own multihost_utils and array_serialization use; jax
# 0.10 has no public accessor): a barrier is a counter that every process increments
# and then polls, together with the job's failure messages. The alternatives were
# tried and rejected:
# - multihost_utils.sync_global_devices is an XLA collective (gloo on CPU, NCCL on GPU):
#   a process that raises leaves the others waiting in it;
# - client.wait_at_barrier needs a finite timeout, while the wait before the merge lasts
#   as long as the slowest process's share (hours for MCMC), and it does not notice a
#   peer that raised either: both sides sat in jax's shutdown barrier for 5 minutes.
# A process that dies without a word (SIGKILL, OOM) stops sending heartbeats; the
# coordination service then terminates the others (after ~100 s).

_POLL_S = 0.5
_FAILED = "degs_eval/failed"  # job-wide: after a failure the processes are out of step
_CALLS = itertools.count()  # groups made by this process (run_eval calls, studies): distinct
#                             key namespaces, the same on every process that makes the same calls


@dataclass(frozen=True)
class ProcessGroup:
    """This process's view of the jax.distributed job it belongs to."""

    client: Any  # jax's DistributedRuntimeClient
    index: int
    count: int
    prefix: str  # the KV-store namespace of this run_eval call (same on every process)


def _client():
    return distributed.global_state.client


def process_group() -> Optional[ProcessGroup]:
    """The job's processes, or None when this is the only one."""
    if jax.process_count() == 1:
        return None
    if _client() is None:
        raise RuntimeError("several JAX processes but no jax.distributed client; call "
                           "jax.distributed.initialize() first")
    return ProcessGroup(_client(), jax.process_index(), jax.process_count(),
                  f"degs_eval/{next(_CALLS)}")


def publish_failure(error: BaseException) -> None:
    """Tell the other processes of this jax.distributed job that this one failed with
    ``error``: they raise :class:`PeerProcessError` at their next barrier or batch
    instead of waiting for it. A no-op outside a job, and for a PeerProcessError (the
    failure is another process's, already published)."""
    client = _client()
    if client is None or isinstance(error, PeerProcessError):
        return
    try:
        client.key_value_set(f"{_FAILED}/{jax.process_index()}",
                             f"{type(error).__name__}: {error}", allow_overwrite=True)
    except Exception:  # the coordinator is gone too; jax then stops the others itself
        pass


def raise_if_peer_failed(group: ProcessGroup) -> None:
    for key, message in sorted(group.client.key_value_dir_get(f"{_FAILED}/")):
        process = int(key.rsplit("/", 1)[1])
        if process != group.index:
            raise PeerProcessError(f"process {process} of {group.count} failed: {message}")


def barrier(group: ProcessGroup, name: str) -> None:
    """Wait until every process has reached ``name``; PeerProcessError if one failed."""
    key = f"{group.prefix}/barrier/{name}"
    group.client.key_value_increment(key, 1)
    while True:
        raise_if_peer_failed(group)
        if group.client.key_value_increment(key, 0) >= group.count:
            return
        time.sleep(_POLL_S)


def share(group: ProcessGroup, name: str, value: Any) -> None:
    group.client.key_value_set(f"{group.prefix}/{name}", json.dumps(value))


def shared(group: ProcessGroup, name: str) -> Any:
    """A value ``share``d before a barrier that this process has passed."""
    return json.loads(group.client.key_value_try_get(f"{group.prefix}/{name}"))


def from_process_0(group: Optional[ProcessGroup], name: str, value: Any) -> Any:
    """Process 0's ``value`` (JSON), on every process once all have reached ``name`` (a
    name new to ``group``); ``value`` itself outside a job. What the other processes pass
    is ignored."""
    if group is None:
        return value
    if group.index == 0:
        share(group, name, value)
    barrier(group, name)
    return shared(group, name)


def gathered_on_process_0(group: Optional[ProcessGroup], name: str, value: Any) -> Optional[list]:
    """Every process's ``value`` (JSON), by process index, on process 0 once all have
    reached ``name`` (a name new to ``group``); None on the others; ``[value]`` outside a
    job."""
    if group is None:
        return [value]
    share(group, f"{name}/{group.index}", value)
    barrier(group, name)
    return [shared(group, f"{name}/{k}") for k in range(group.count)] if group.index == 0 else None


def failures_published(fn):
    """Decorator: an exception escaping ``fn`` is published to the job's other processes
    (:func:`publish_failure`) before it propagates."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as error:  # KeyboardInterrupt too: the others must stop
            publish_failure(error)
            raise
    return wrapper
