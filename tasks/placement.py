"""Where machines 1…N−1's parts of a multi-machine launch start (machine 0's is the task's own):
by hand, from the command machine 0 logs, or on a Dask worker of that machine. Machine 0 places
them once it has written the spec; the gang (``infra.core.gang``) then starts and stops all of
them as one, whoever started them.

Dask, because the project runs it already (sweeps) and a worker per machine with a resource naming
that machine is all it takes: ``dask worker tcp://host:8786 --nthreads 1 --resources
alignflow-machine-1=1`` on machine 1. Another engine (Prefect work queues, Ray placement groups) is
one more :class:`Placement`. Inside a flow run, prefect-dask's client runs each part as a task run
of that flow run, with its own logs.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol
from urllib.parse import urlsplit

from prefect import Task
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL

from infra.core.launching import Finished
from infra.core.stage_io import LaunchSpec
from tasks.machine import LaunchFailed, checkout_command

if TYPE_CHECKING:
    from distributed import Future

Log = Callable[[str], None]
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def machine_resource(machine: int) -> str:
    """The Dask worker resource of machine ``machine``."""
    return f"alignflow-machine-{machine}"


def worker_command(scheduler: str, machine: int) -> str:
    """The Dask worker machine ``machine`` runs, from the same checkout, to take its parts of every launch."""
    dask = str(Path(sys.executable).parent / "dask")
    return checkout_command(
        [dask, "worker", scheduler, "--nthreads", "1", "--resources", f"{machine_resource(machine)}=1"]
    )


def reaches_api(api_url: str | None, workers: list[str]) -> bool:
    """Whether Dask workers at ``workers`` (their addresses) can reach the Prefect API ``api_url``:
    any worker when the API listens beyond this host; when it is this host's (loopback, e.g. the
    temporary server of ``alignflow run``), only workers on loopback, which are on this host too."""
    if not api_url:
        return False
    if urlsplit(api_url).hostname not in LOOPBACK:
        return True
    hosts = {urlsplit(address).hostname for address in workers}
    return bool(hosts) and hosts <= LOOPBACK


class Placement(Protocol):
    def place(self, spec: LaunchSpec, machine: int) -> None:
        """Start ``machine``'s part of ``spec``'s launch (its spec is written)."""

    def lost(self) -> str | None:
        """Why a placed part ended before it could join (where it was placed), or None."""

    def release(self, started: Callable[[int], bool]) -> None:
        """After machine 0's part ended: the parts that ``started`` (joined the gang) have ended or
        end (the gang stops them on a failure), the others are withdrawn; their last output is logged."""


class ByHand:
    """Nothing starts the other machines: machine 0 logs the command each must run."""

    def __init__(self, name: str, log: Log, command: Callable[[LaunchSpec, int], str]):
        self.name, self.log, self.command = name, log, command

    def place(self, spec: LaunchSpec, machine: int) -> None:
        self.log(f"{self.name}: machine {machine} must run: {self.command(spec, machine)}")

    def lost(self) -> str | None:
        return None  # nothing here sees the other machines' commands

    def release(self, started: Callable[[int], bool]) -> None:
        pass


class OnDask:
    """Each machine's part on the Dask worker that offers its resource: inside a flow run as a task
    run of it (``part``) where that worker reaches the Prefect API, else as the plain function."""

    TAIL_LINES = 10  # of a machine's output, logged on machine 0 when its part ended

    def __init__(
        self, address: str, name: str, log: Log, part: Task[[str, int, str], Finished], machines: Iterable[int]
    ):
        """A placement of ``machines``' parts on the scheduler at ``address``: a :class:`LaunchFailed`
        at once when no worker offers one of their resources (its part would wait for a worker until
        the join timeout), naming the machine, its resource and the worker command to run there."""
        from prefect_dask import PrefectDaskClient

        self.client = PrefectDaskClient(address, timeout=30, set_as_default=False)
        self.address, self.name, self.log, self.part = address, name, log, part
        self.futures: dict[int, Future[Finished]] = {}
        try:
            self.check_workers(machines)
        except BaseException:
            self.client.close()
            raise

    def offering(self, resource: str, workers: dict | None = None) -> list[str]:
        """The addresses of the scheduler's workers (``workers``: its info of them, asked for when
        None) that offer ``resource``."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"] if workers is None else workers
        return [address for address, info in workers.items() if info["resources"].get(resource, 0) >= 1]

    def check_workers(self, machines: Iterable[int]) -> None:
        workers = self.client.scheduler_info(n_workers=-1)["workers"]  # asked once for every machine
        missing = [machine for machine in machines if not self.offering(machine_resource(machine), workers)]
        if missing:
            needs = "; nor ".join(
                f"{machine_resource(m)}, which machine {m}'s part needs: on machine {m} run "
                f"`{worker_command(self.address, m)}`"
                for m in missing
            )
            scheduler = f"the Dask scheduler {self.address} (compute.machine_scheduler)"
            raise LaunchFailed(f"{self.name}: no worker of {scheduler} offers {needs}")

    def workers_reach_prefect_api(self, resource: str) -> bool:
        """Whether the workers offering ``resource`` can report a task run to this process's Prefect API."""
        return reaches_api(PREFECT_API_URL.value(), self.offering(resource))

    def place(self, spec: LaunchSpec, machine: int) -> None:
        resource = machine_resource(machine)
        part = self.part.with_options(task_run_name=f"{self.name}: machine {machine}")
        in_flow_run = FlowRunContext.get() is not None
        as_task_run = in_flow_run and self.workers_reach_prefect_api(resource)
        if in_flow_run and not as_task_run:
            self.log(
                f"{self.name}: machine {machine}'s part runs as a plain Dask task, its output in its worker's "
                f"log: no worker with {resource} reaches the Prefect API at {PREFECT_API_URL.value()} (loopback; "
                "with a Prefect server that machine reaches, the part is a task run of this flow run)"
            )
        self.futures[machine] = self.client.submit(
            part if as_task_run else part.fn,
            str(spec.spec_file),
            machine,
            self.name,
            resources={resource: 1},
            key=f"{resource}-{uuid.uuid4().hex[:8]}",
            pure=False,
            retries=0,
        )
        self.log(f"{self.name}: machine {machine}'s part submitted to the Dask worker with {resource} ({self.address})")

    @staticmethod
    def worker_error(future) -> str | None:
        """The error of a part whose Dask task failed on its worker, as ``Type: message``; else None."""
        if future.status != "error":
            return None
        error = future.exception()
        return f"{type(error).__name__}: {error}"

    def lost(self) -> str | None:
        """A part whose Dask task failed while machine 0 waits for the machines to join: its worker
        could not start it (the shared storage missing there, the flow or the Prefect API out of
        its reach). Machine 0 then fails at once, not at the join timeout."""
        for machine, future in self.futures.items():
            if (error := self.worker_error(future)) is not None:
                return f"machine {machine}'s part failed on its Dask worker: {error}"
        return None

    def release(self, started: Callable[[int], bool]) -> None:
        try:
            for machine, future in self.futures.items():
                if not started(machine):
                    if (error := self.worker_error(future)) is not None:  # e.g. its spec was not there
                        failed = f"machine {machine}'s part failed on its Dask worker before it joined"
                        self.log(f"{self.name}: {failed}: {error}")
                        continue
                    future.cancel()  # no worker offered its resource in time: the gang failed it
                    self.log(f"{self.name}: machine {machine}'s part never started on Dask; withdrawn")
                    continue
                try:
                    finished = future.result(timeout=60)
                except Exception as error:  # its worker died, or its part failed (its ranks' error)
                    self.log(f"{self.name}: machine {machine}'s part ended with {type(error).__name__}: {error}")
                    continue
                tail = "\n".join(finished.tail[-self.TAIL_LINES :])
                self.log(
                    f"{self.name}: machine {machine}'s part exited with {finished.returncode}; its last lines:\n{tail}"
                )
        finally:
            self.client.close()
