"""Joining a ``jax.distributed`` job from the command line: the options `degs eval` and
`degs reproduce` share, their checks, and the join itself (the protocol the processes
then follow is in :mod:`degs_jax.eval.processes`)."""

from __future__ import annotations

import signal
from typing import Optional

import jax

LAUNCH_HELP = """Several processes (hosts, or GPUs of one host) share the work as one
jax.distributed job: start the same command once per process, adding the coordinator
(process 0's address and a free port) and each process's id; OUT must be a directory all
of them see. Two processes on one machine:
  {command} --coordinator 127.0.0.1:8476 --num-processes 2 --process-id 0 &
  {command} --coordinator 127.0.0.1:8476 --num-processes 2 --process-id 1
(one GPU each: prefix CUDA_VISIBLE_DEVICES=0 and =1). Under Slurm or Open MPI,
--distributed alone detects the three from the environment."""


def add_distributed_args(parser) -> None:
    """The options that make a command one process of a jax.distributed job."""
    d = parser.add_argument_group("several processes (jax.distributed; see above)")
    d.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address and a free port (the same for every process)")
    d.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    d.add_argument("--process-id", type=int, metavar="K", help="this process, 0..N-1")
    d.add_argument("--distributed", action="store_true",
                   help="join a jax.distributed job, detecting what the three options above "
                        "leave out from the cluster environment (Slurm, Open MPI, TPU)")


def distributed_options(args) -> Optional[dict]:
    """``jax.distributed.initialize`` arguments from the command's options; None when the
    run is not a distributed one. ValueError for an incomplete or inconsistent set."""
    given = {"coordinator_address": args.coordinator, "num_processes": args.num_processes,
             "process_id": args.process_id}
    if not args.distributed and all(v is None for v in given.values()):
        return None
    if not args.distributed and any(v is None for v in given.values()):
        missing = [f"--{k.replace('_address', '').replace('_', '-')}"
                   for k, v in given.items() if v is None]
        raise ValueError(f"--coordinator, --num-processes and --process-id go together (missing "
                         f"{', '.join(missing)}); or add --distributed to detect the missing ones "
                         "from a Slurm, Open MPI or TPU environment")
    n, k = args.num_processes, args.process_id
    if n is not None and n < 1:
        raise ValueError(f"--num-processes must be positive, got {n}")
    if k is not None and not (0 <= k and (n is None or k < n)):
        raise ValueError(f"--process-id {k} is out of range"
                         + (f" 0..{n - 1} (--num-processes {n})" if n is not None else ""))
    if args.coordinator is not None:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    return {key: v for key, v in given.items() if v is not None}


def join_job(options: dict) -> None:
    """Join the jax.distributed job; it must precede every JAX computation (model load).

    SIGTERM (kill, Slurm's scancel) then ends this process through an exception, which
    tells the others to stop (the failure publishing of :mod:`degs_jax.eval.processes`).
    jax's preemption service, which would otherwise catch SIGTERM and carry on, is
    switched off: an eval or a study has no preemption sync points.

    The backend starts here too, in every process, before the model load: starting it
    waits until every process has sent its device topology. Started later, by the first
    JAX operation, it deadlocked the first run on a fresh cache. One process converted
    the built-in GGUF under the conversion's file lock and its first JAX array waited
    for the others' topologies, while they waited for the lock without having started
    their backends. After jax's 2-minute topology timeout the converting process
    failed (seen on 2 x H200 and reproduced on CPU)."""
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(**options)
    except ValueError as e:  # auto-detection found no cluster environment
        raise ValueError(f"cannot join a jax.distributed job: {e} (pass --coordinator, "
                         "--num-processes and --process-id)") from e
    jax.devices()  # the backend, and with it the topology exchange (docstring)
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum, frame):
    raise SystemExit(f"degs: terminated by {signal.Signals(signum).name}")
