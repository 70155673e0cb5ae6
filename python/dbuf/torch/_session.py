"""The process's connection to dbufd as dbuf.torch uses it (like torch.distributed's default group).

A :class:`Session` is one attached :class:`dbuf.Client` (one dbuf job) plus what
its units share: the pool of unsharded slots (``prefetch_depth + 1`` of them,
as dbufd gives each rank, which prefetching stays within; a gather needed now
takes one beyond it), a small fp32 staging group for exact transfers
(full state dicts), and the job's ``DeviceMesh`` that its parameters, as
RaggedShard DTensors, live on. ``init()`` makes the default session;
``fully_shard`` uses it, creating it from torchrun's environment on first use.
A process whose fully_shard calls name meshes of other ranks (a dp slice
beside tensor or expert parallelism) holds a session per set of ranks
(:func:`session_for_ranks`); all of them share one :class:`PassState`, the
models' roots and the pass in progress.
"""

from __future__ import annotations

import os
import socket as socket_module
import threading
import uuid
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dbuf

from . import _patch
from . import _dtensor
from ._dtensor import spmd_mesh


class SessionUnit(Protocol):
    """What a session asks of a unit (_unit.Unit, which depends on this module, not back).

    PassState holds _unit.Unit objects for _hooks.py, which uses the whole of
    _unit.Unit; their type here is the part this module needs.
    """

    label: str
    releasable: bool  # its gradients are reduced or set aside: its unsharded slot may go back

    @property
    def slot_bytes(self) -> int: ...

    def reshard(self) -> None: ...

    def close(self) -> None: ...


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def _job_from_env() -> str | None:
    """The job id the environment names: ``$DBUF_JOB``, else torchrun's run id."""
    explicit = os.environ.get("DBUF_JOB")
    if explicit:
        return explicit
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    return None


#: The key of the default process group's store under which rank 0 names the job (see _job_of_launch).
JOB_KEY = "dbuf.torch/job"


def _job_of_launch() -> str | None:
    """The job id every rank of the launch agrees on, or None (a lone process).

    The environment's (``$DBUF_JOB``, torchrun's run id); else, where
    torch.distributed's default process group exists (``mp.spawn``, Slurm,
    a test harness, ranks as threads), one that its rank 0 makes up and puts
    in the group's store, which the others read (once per group); else
    torchrun's rendezvous address (``MASTER_ADDR``/``MASTER_PORT``), over
    which dbuf.torch then makes the default process group.
    """
    named = _job_from_env()
    if named is not None:
        return named
    if dist.is_initialized():
        return _rank_sessions(create=True).agreed_job()
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if address and port:
        return f"torchrun-{address}-{port}"
    return None


@dataclass
class RootOrder:
    """The order a root's first iteration ran the units of its model in (_hooks.py's prefetching follows it).

    Each model has its own (FSDP2's lazy root per top-level model): two
    models trained side by side in one process never prefetch each other's units.
    """

    forward: list[SessionUnit] = field(default_factory=list)  # units as the first forward entered them
    post_forward: list[SessionUnit] = field(default_factory=list)  # as it left them: backward runs them in reverse
    recorded: bool = False  # a backward began, or the root's forward ran again: the order is complete


@dataclass
class Stats:
    """What this process's units did through dbufd (Session.stats; Session.reset_step_stats() starts a step).

    Bytes are of the unsharded buffers the collectives fill or read (V*S
    elements of the unit's unsharded dtype per op), as FSDP2's are counted.
    Peak unsharded bytes: the most the slots this rank held at once took
    (params + gradients of each).
    """

    all_gathers: int = 0
    all_gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    peak_unsharded_bytes: int = 0


@dataclass
class PassState:
    """The forward and backward passes of a process's units, whichever dbuf job each belongs to.

    One model's units may live in several jobs (expert parallelism: the
    experts' units in a job of their dp slice, the rest in the whole
    launch's), but they run in one forward and one backward: _hooks.py keeps
    the roots and the backward in progress here, for all of them.
    A session shares its PassState with the other sessions of its process
    (see session_for_ranks).
    """

    units: list[SessionUnit] = field(default_factory=list)  # every unit, in the order made
    roots: list[SessionUnit] = field(default_factory=list)  # each model's root unit, in the order they became roots
    running_root: SessionUnit | None = None  # the root of the top-level forward in progress (or last run)
    checked_roots: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # models whose first forward found nothing to refuse
    in_backward: bool = False
    backward_task: int | None = None  # the autograd graph task of the backward in progress
    forwards_running: int = 0
    pass_routes: list[SessionUnit] = field(default_factory=list)  # units whose inputs this top-level forward routed
    # The original parameters units took (id -> (weak reference, unit)): a parameter two units would shard, in
    # any of the process's jobs, is refused (Session.unit_holding).
    claimed: dict[int, tuple[weakref.ref, SessionUnit]] = field(default_factory=dict)
    #: The most bytes of unsharded slots the process held at once, over all its sessions (each session's
    #: Stats has its own); reset_peak() starts a step.
    peak_unsharded_bytes: int = 0

    members: list[Session] = field(default_factory=list)  # the sessions sharing it, in the order made

    def sessions(self) -> list[Session]:
        """The sessions (dbuf jobs) sharing this state, in the order they were made."""
        return list(self.members)

    def unsharded_bytes(self) -> int:
        """Bytes of the unsharded slots the process's sessions hold now."""
        return sum(session.unsharded_bytes for session in self.members)

    def reset_peak(self) -> None:
        self.peak_unsharded_bytes = self.unsharded_bytes()


class Session:
    """An attached client and the state its units share. Made by :func:`init`."""

    def __init__(
        self,
        client: dbuf.Client,
        *,
        job: str,
        rank: int,
        world_size: int,
        local_rank: int,
        prefetch_depth: int,
        mesh: DeviceMesh | None = None,
        passes: PassState | None = None,
        across_nodes: bool = False,
    ) -> None:
        """``mesh``: the job's 1-D DeviceMesh (default: one over torch.distributed's default process group,
        made on first use; see :attr:`mesh`). ``passes``: the forward / backward state shared with the
        process's other sessions (default: its own)."""
        self.client = client
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.across_nodes = across_nodes  # the job's ranks on several nodes' dbufd
        self.slots = prefetch_depth + 1
        #: GPU of this session's memory (None: host memory, dbufd's host backend).
        self.device: int | None = client.device
        self.units: list[SessionUnit] = []  # this job's units (passes.units holds every session's)
        self.passes = passes if passes is not None else PassState()
        self.passes.members.append(self)
        self.slot_holders: list[SessionUnit] = []  # units holding an unsharded slot, oldest first
        self._staging: dbuf.Group | None = None
        self.stats = Stats()
        self._prefetch_stream = None
        self.post_optim_event = None  # GPU: FSDPModule.set_post_optim_event's, waited for by the next prefetch
        self.unwaited: list[dbuf.Op] = []  # GPU: stream-ordered ops used, their results not yet collected
        self._mesh = mesh
        self._owns_process_group = False
        # HSDP (fully_shard's 2-D mesh): this job is one replica's shard group; the sharded gradients are
        # summed over the replicas through the mesh's replicate group (sum_over_replicas).
        self.replicas = 1
        self.replicate_group: dist.ProcessGroup | None = None
        #: The job's ranks in torch.distributed's default group: all of them, or a dp slice of a larger mesh.
        self.global_ranks: list[int] = list(range(world_size))
        self._spmd_meshes: dict[DeviceMesh, DeviceMesh] = {}

    # ------------------------------------------------------------ the job's mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The 1-D DeviceMesh over the job's ranks (collective on first use).

        DTensor needs a process group for what runs outside dbufd: gathering
        a RaggedShard DTensor whole, the norms of torch's gradient clipping,
        and torch.distributed.checkpoint's plans. dbuf.torch uses the default
        process group where the trainer made one (its ranks must be the
        job's), else makes one from torchrun's environment (MASTER_ADDR,
        MASTER_PORT; gloo, for host and CUDA tensors alike), as FSDP2 needs.
        """
        if self._mesh is None:
            self._owns_process_group = _ensure_process_group(self)
            device_type = "cpu" if self.device is None else "cuda"
            if self.device is not None:
                # init_device_mesh would otherwise pick the GPU from LOCAL_RANK, which several
                # virtual ranks on one GPU do not have.
                torch.cuda.set_device(self.device)
            self._mesh = init_device_mesh(device_type, (self.world_size,))
        return self._mesh

    def adopt_mesh(self, mesh: DeviceMesh) -> None:
        """The trainer's 1-D mesh over the job's ranks (fully_shard's mesh=); the first becomes this session's.

        Another mesh over the same ranks (``DeviceMesh.from_group`` of the
        group a dim of a larger mesh has) is accepted: a unit's parameters live
        on the mesh its fully_shard was given, as FSDP2's do.
        """
        ranks = mesh.mesh.flatten().tolist()
        if ranks != self.global_ranks or mesh.get_local_rank() != self.rank:
            raise ValueError(
                f"fully_shard's mesh must hold the dbuf job's ranks {self.global_ranks} in order (this is its rank "
                f"{self.rank}); got ranks {ranks}"
            )
        if self._mesh is None:
            self._mesh = mesh

    def adopt_hsdp_mesh(self, mesh: DeviceMesh) -> None:
        """fully_shard's 2-D (replicate, shard) mesh: this job shards over dim 1, the replicas are dim 0.

        The parameters' DTensors live on the shard dimension (a 1-D mesh of this
        replica's ranks); every replica holds the same shards.
        """
        replicas, shards = mesh.shape
        if (shards, mesh.get_coordinate()[1]) != (self.world_size, self.rank):
            raise ValueError(
                f"fully_shard's HSDP mesh {tuple(mesh.shape)} puts this rank at shard {mesh.get_coordinate()[1]} of "
                f"{shards}; its dbuf job has it as rank {self.rank} of {self.world_size}"
            )
        if self.replicate_group is not None and self.replicas != replicas:
            raise ValueError(f"an HSDP mesh of {replicas} replicas after one of {self.replicas}")
        self.global_ranks = mesh.mesh[mesh.get_coordinate()[0]].tolist()
        # The shard dim as torch's submesh where the dims are named (the one tensor / expert parallel
        # meshes of the same root concatenate with), else a mesh of its group.
        names = mesh.mesh_dim_names
        shard_mesh = mesh[names[1]] if names else DeviceMesh.from_group(mesh.get_group(1), mesh.device_type)
        self.adopt_mesh(shard_mesh)
        self.replicas, self.replicate_group = replicas, mesh.get_group(0)

    def spmd_mesh(self, model_mesh: DeviceMesh) -> DeviceMesh:
        """The (dp, model...) mesh of the parameters tensor / expert parallelism placed on `model_mesh` (one per mesh)."""
        mesh = self._spmd_meshes.get(model_mesh)
        if mesh is None:
            try:
                mesh = spmd_mesh(self.mesh, model_mesh)
            except (RuntimeError, TypeError, ValueError) as error:
                raise ValueError(
                    f"fully_shard: the mesh {model_mesh} of a tensor / expert parallel parameter and fully_shard's "
                    f"mesh {self.mesh} must be named dims of one DeviceMesh (pass mesh=world_mesh['dp'] with "
                    f"parallelize_module(..., world_mesh['tp'])): {error}"
                ) from error
            self._spmd_meshes[model_mesh] = mesh
        return mesh

    def sum_over_replicas(self, tensors: list[torch.Tensor]) -> None:
        """HSDP: each tensor replaced, in place, by its sum over the replicas, added in replica order.

        Gathered, then added here in one order, so that every replica gets the
        same bits (its shards must stay equal to the others') in a defined order.
        """
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        parts = [torch.empty_like(flat) for _ in range(self.replicas)]
        dist.all_gather(parts, flat, group=self.replicate_group)
        total = parts[0]
        for part in parts[1:]:
            total.add_(part)
        offset = 0
        for tensor in tensors:
            tensor.copy_(total[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

    # ------------------------------------------------------------ placement

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.device is None else torch.device("cuda", self.device)

    def stream(self):
        """The stream ops are ordered on: the current CUDA stream for GPU memory, else None (host)."""
        return None if self.device is None else torch.cuda.current_stream(self.device)

    def prefetch_stream(self):
        """GPU memory: the stream prefetching all-gathers are ordered on (after the current stream's
        work so far); None for host memory."""
        if self.device is None:
            return None
        if self._prefetch_stream is None:
            self._prefetch_stream = torch.cuda.Stream(self.device)
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:
            self._prefetch_stream.wait_event(event)  # the shards as the optimizer left them
        else:
            self._prefetch_stream.wait_stream(self.stream())
        return self._prefetch_stream

    def collect(self) -> None:
        """Waits for the stream-ordered ops whose results were not collected yet (their errors raise here)."""
        ops, self.unwaited = self.unwaited, []
        for op in ops:
            op.wait()

    # ------------------------------------------------------------ parameters

    def claim(self, param: torch.nn.Parameter, unit: SessionUnit) -> None:
        """`param` (the module's original parameter) is `unit`'s now."""
        self.passes.claimed[id(param)] = (weakref.ref(param), unit)

    def unit_holding(self, param: torch.nn.Parameter) -> SessionUnit | None:
        """The unit that took this original parameter, if any."""
        claimed = self.passes.claimed.get(id(param))
        if claimed is None or claimed[0]() is not param:
            return None
        return claimed[1]

    # ------------------------------------------------------------ slots

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of the unsharded slots this rank's units hold now."""
        return sum(unit.slot_bytes for unit in self.slot_holders)

    def hold_slot(self, unit: SessionUnit) -> None:
        self.slot_holders.append(unit)
        self.stats.peak_unsharded_bytes = max(self.stats.peak_unsharded_bytes, self.unsharded_bytes)
        self.passes.peak_unsharded_bytes = max(self.passes.peak_unsharded_bytes, self.passes.unsharded_bytes())

    def reset_step_stats(self) -> None:
        """Zeroes the counts; the peak starts from what is held now."""
        self.stats = Stats(peak_unsharded_bytes=self.unsharded_bytes)

    def make_room(self, unit: SessionUnit | None, *, required: bool) -> bool:
        """Makes room in the pool of unsharded slots for `unit` (None: the staging group); whether there is.

        Units whose gradients are being reduced give theirs back first (their
        reduce-scatter is waited for). A prefetch (not `required`) takes a
        slot of the pool only: False when every one is held. A required
        gather always has room: when every slot of the pool is held by units
        still using theirs, it asks dbufd for one beyond the pool
        (``acquire_slot(grow=True)``), within the tenant's quota, as FSDP2
        allocates what its unsharded parameters need.
        """
        if unit is not None and unit in self.slot_holders:
            return True
        while len(self.slot_holders) >= self.slots:
            releasable = next((u for u in self.slot_holders if u.releasable), None)
            if releasable is None:
                return required
            releasable.reshard()
        return True

    # ------------------------------------------------------------ staging

    #: Elements per rank of the staging group (fp32): 1 MiB per rank.
    STAGING_ELEMS = 1 << 18

    def staging(self) -> dbuf.Group:
        """An fp32 -> fp32 group for exact transfers (collective on first use)."""
        if self._staging is None:
            elems = self.STAGING_ELEMS * self.world_size
            self._staging = self.client.register_group(
                "dbuf.torch:staging",
                [dbuf.TensorSpec("stage", (elems,))],
                granularity="element",
                sharded_dtype="fp32",
                unsharded_dtype="fp32",
            )
        return self._staging

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over the job's ranks of a small fp32 vector (every rank calls it: collective).

        Summed in fp32 in rank order by dbufd, through the staging group.
        """
        count = values.numel()
        staging = self.staging()
        if count > self.STAGING_ELEMS * self.world_size:
            raise ValueError(f"all_reduce_sum takes at most {self.STAGING_ELEMS * self.world_size} values")
        self.make_room(None, required=True)
        staging.acquire_slot(grow=True)
        try:
            buffer = staging.unsharded_grad_view(0).torch()
            buffer[:count].copy_(values.reshape(-1))
            staging.all_reduce(op=dbuf.ReduceOp.SUM, stream=self.stream())
            return buffer[:count].clone().reshape(values.shape)
        finally:
            if self.device is None:
                staging.reshard()
            else:
                staging.reshard_on_stream(self.stream())

    # ------------------------------------------------------------ end

    def close(self, *, destroy_process_group: bool = True) -> None:
        """Detaches (every rank should); the views of the units read zeros afterwards.

        The default process group dbuf.torch made for the session is destroyed
        too, unless `destroy_process_group` is False (it is being destroyed).
        """
        for unit in self.units:
            unit.close()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self.client.detach()
        if destroy_process_group and self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._mesh = None


def _ensure_process_group(session: Session) -> bool:
    """Makes torch.distributed's default process group over the job's ranks unless there is one; True if made."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (session.rank, session.world_size):
            raise dbuf.ConflictError(
                f"torch.distributed's default process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"the dbuf job rank {session.rank} of {session.world_size}: they must be the same ranks"
            )
        return False
    # gloo for CUDA tensors too: the traffic is small (see `mesh`), and NCCL refuses two ranks on
    # one GPU, which dbufd's virtual ranks are.
    backend = "gloo"
    if session.world_size == 1 and not os.environ.get("MASTER_ADDR"):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return True
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise ValueError(
            "dbuf.torch needs torch.distributed for its DTensors: launch with torchrun (it sets MASTER_ADDR and "
            "MASTER_PORT) or call torch.distributed.init_process_group() before fully_shard"
        )
    dist.init_process_group(backend, rank=session.rank, world_size=session.world_size)
    return True


class _RankSessions:
    """The sessions of one rank of this process, and the job id its launch agreed on.

    A process is one rank, except where ranks are threads of one process
    (torch's threaded process groups, as torch's own tests use): each
    thread's default process group is then its own, and so are its sessions.
    A rank's sessions end when its default process group is destroyed
    (_end_sessions_with_the_group), so the next group in the process starts
    clean.
    """

    def __init__(self) -> None:
        self.default: Session | None = None
        self.others: list[Session] = []  # further sessions (see session_for_ranks)
        self._agreed_job: str | None = None

    def all(self) -> list[Session]:
        return [] if self.default is None else [self.default, *self.others]

    def agreed_job(self) -> str:
        """The job id of the default process group's ranks: rank 0's, through the group's store (once)."""
        if self._agreed_job is None:
            store = dist.distributed_c10d._get_default_store()
            if dist.get_rank() == 0:
                store.set(JOB_KEY, f"pg-{socket_module.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._agreed_job = store.get(JOB_KEY).decode()
        return self._agreed_job


#: Every rank's sessions in this process, by its default process group (None: made before there was one).
_ranks: dict[object, _RankSessions] = {}
_ranks_lock = threading.Lock()


def _rank_key() -> object:
    """The calling rank's key in _ranks: its thread's default process group, None before there is one."""
    return dist.group.WORLD if dist.is_initialized() else None


def _rank_sessions(*, create: bool = False) -> _RankSessions | None:
    """This rank's sessions: those of the calling thread's default process group, else the process's."""
    key = _rank_key()
    with _ranks_lock:
        found = _ranks.get(key)
        if found is None and key is not None:
            found = _ranks.get(None)  # made before the default process group (which the session then made)
        if found is None and create:
            found = _ranks[key] = _RankSessions()
        return found


def _take_rank_sessions() -> list[Session]:
    """This rank's sessions, no longer registered (those of its default process group and any made before it)."""
    with _ranks_lock:
        taken = [_ranks.pop(key) for key in {_rank_key(), None} if key in _ranks]
    return [session for rank in taken for session in rank.all()]


def _end_sessions_with_the_group(destroy_process_group):
    """torch.distributed.destroy_process_group, ending the calling rank's sessions with its default group."""

    def destroy_process_group_and_sessions(group=None):
        ending = []
        if dist.is_initialized() and (group is None or group is dist.group.WORLD):
            ending = _take_rank_sessions()
        try:
            _close_all(ending, destroy_process_group=False)
        finally:
            destroy_process_group(group)  # whatever closing the sessions raised

    return destroy_process_group_and_sessions


_patch.wrap([dist, dist.distributed_c10d], "destroy_process_group", _end_sessions_with_the_group)


def _close_all(closing: list[Session], *, destroy_process_group: bool = True) -> None:
    first: BaseException | None = None
    for session in reversed(closing):
        try:
            session.close(destroy_process_group=destroy_process_group)
        except BaseException as error:  # noqa: BLE001 - every session is closed; the first error raises
            first = first or error
    if first is not None:
        raise first


def _store_from_env() -> str:
    store = os.environ.get("DBUF_STORE", "")
    if store and "#" not in store:
        run = os.environ.get("TORCHELASTIC_RUN_ID")
        if run:
            store += f"#{run}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return store


def init(
    *,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    socket: str | None = None,
    device: int | None = None,
    prefetch_depth: int | None = None,
    persistent: bool = False,
    local_world_size: int | None = None,
    store: str | None = None,
    timeout: float = 60.0,
) -> Session:
    """Attaches this process to dbufd and makes it the default session of dbuf.torch.

    Unset arguments come from the environment torchrun sets: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and the job id (``$DBUF_JOB``, else torchrun's
    run id, else ``MASTER_ADDR``/``MASTER_PORT``); the socket from
    ``$DBUF_SOCKET``. ``device``: the trainer's GPU (default: the current CUDA
    device when CUDA is available, else none). ``prefetch_depth``: units
    gathered ahead of the one computing (unsharded slots = prefetch_depth + 1;
    a root unit that keeps its parameters for backward holds one throughout;
    default ``$DBUF_PREFETCH_DEPTH``, else 2). ``timeout``: seconds,
    the default of every call (registration waits for every rank).

    A job across nodes: ``local_world_size`` (default ``$LOCAL_WORLD_SIZE``,
    which torchrun sets) ranks run on this node, and the nodes' daemons meet
    in ``store`` (default ``$DBUF_STORE``): ``"file:DIR"`` or
    ``"redis:HOST:PORT"``, to which the run id and restart count torchrun sets
    are appended as the key prefix, so a restarted job never reads an earlier
    run's keys.
    """
    mine = _rank_sessions(create=True)
    if mine.default is not None:
        raise dbuf.ConflictError("dbuf.torch is already initialised in this process (dbuf.torch.destroy() first)")
    mine.default = _attach(job=job, rank=rank, world_size=world_size, local_rank=local_rank, socket=socket,
                           device=device, prefetch_depth=prefetch_depth, persistent=persistent,
                           local_world_size=local_world_size, store=store, timeout=timeout)
    return mine.default


def _attach(*, job, rank, world_size, local_rank=None, socket=None, device=None, prefetch_depth=None,
            persistent=False, local_world_size=None, store=None, timeout=60.0, passes=None) -> Session:
    """A session attached to dbufd with init()'s arguments and defaults; `passes` as Session's."""
    if dist.is_initialized():  # the trainer's ranks, however it was launched
        rank = rank if rank is not None else dist.get_rank()
        world_size = world_size if world_size is not None else dist.get_world_size()
    rank = rank if rank is not None else _env_int("RANK", 0)
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
    local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK", rank if world_size > 1 else 0)
    prefetch_depth = prefetch_depth if prefetch_depth is not None else _env_int("DBUF_PREFETCH_DEPTH", 2)
    local_world_size = local_world_size if local_world_size is not None else _env_int("LOCAL_WORLD_SIZE", 0)
    if local_world_size == world_size:
        local_world_size = 0  # one node
    store = store if store is not None else _store_from_env()
    job = job if job is not None else _job_of_launch()
    if job is None:
        if world_size != 1:
            raise ValueError("no job id: pass job=..., set $DBUF_JOB, launch with torchrun, or call "
                             "torch.distributed.init_process_group() first (its store names the job)")
        job = f"single-{os.getpid()}-{threading.get_ident()}"
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    client = dbuf.Client(socket, timeout)
    try:
        # A unit reads and writes its unsharded tensors only while it holds its slot (the hooks swap
        # them in and out), so a slot may stay mapped after reshard: getting it back maps nothing.
        client.attach(
            job, rank, world_size, local_rank=local_rank, device=device, persistent=persistent,
            prefetch_depth=prefetch_depth, local_world_size=local_world_size, store=store,
            keep_slot_mappings=True,
        )
    except BaseException:
        client.close()
        raise
    return Session(client, job=job, rank=rank, world_size=world_size, local_rank=local_rank,
                   prefetch_depth=prefetch_depth, passes=passes, across_nodes=local_world_size != 0)


def default_session() -> Session:
    """The default session, made from the environment on first use (see :func:`init`)."""
    mine = _rank_sessions()
    return mine.default if mine is not None and mine.default is not None else init()


def sessions() -> list[Session]:
    """This rank's sessions: the default one, then those of the other meshes fully_shard was given."""
    mine = _rank_sessions()
    return [] if mine is None else mine.all()


def _sum_over_job(mesh: DeviceMesh, values: torch.Tensor) -> torch.Tensor | None:
    """`values` summed over the ranks of `mesh` through dbufd, where the mesh is this rank's dbuf job's.

    None (torch's own collective then) where it is no job's, or the values do
    not fit the staging group or sit on another device. Every rank of a mesh
    decides alike: the same mesh, the same values' size.
    """
    ranks = mesh.mesh.flatten().tolist()
    for session in sessions():
        if ranks == session.global_ranks and mesh.get_local_rank() == session.rank:
            fits = values.numel() <= session.STAGING_ELEMS * session.world_size
            return session.all_reduce_sum(values) if fits and values.device == session.torch_device else None
    return None


_dtensor.set_job_sum(_sum_over_job)


def init_replica(replica: int, ranks: list[int]) -> Session:
    """The default session of one HSDP replica: the job of its ranks (made by fully_shard's 2-D mesh).

    Its job id is the launch's with ``.replica<r>`` appended, and where the
    replica's ranks are not the launch's r-th block (HSDP beside tensor
    parallelism: a replica has a shard group per tp rank) a checksum of them.
    """
    mine = _rank_sessions(create=True)
    if mine.default is not None:
        raise dbuf.ConflictError("dbuf.torch is already initialised in this process")
    block = list(range(replica * len(ranks), (replica + 1) * len(ranks)))
    suffix = f"replica{replica}" if ranks == block else f"replica{replica}-{_checksum(ranks)}"
    mine.default = _attach(**_slice_job(suffix, ranks, "HSDP"))
    mine.default.global_ranks = list(ranks)
    return mine.default


def session_for_ranks(ranks: list[int]) -> Session:
    """The session of the dbuf job of these global ranks (fully_shard's 1-D mesh holds them), made if need be.

    The launch's ranks are its job (the default session, as init() makes
    it); a dp slice of a larger mesh (``world_mesh["dp"]`` beside tensor or
    expert parallelism) is a job of its own, named after the launch's with
    ``.dp<first rank>-`` and a checksum of the ranks appended (every rank of
    the slice names it alike, and no other slice does). A process may hold
    several (expert parallelism: the experts' dp slice and the whole
    launch); the sessions after the first share its PassState, since their
    units run in one forward and backward.
    """
    mine = _rank_sessions(create=True)
    for session in mine.all():
        if session.global_ranks == list(ranks):
            return session
    world = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    if list(ranks) == list(range(world)):
        job = {"job": None, "rank": None, "world_size": None}  # init()'s: the launch's job
    else:
        job = _slice_job(f"dp{ranks[0]}-{_checksum(ranks)}", ranks, "a dp mesh beside tensor / expert parallelism")
    session = _attach(**job, passes=mine.default.passes if mine.default is not None else None)
    session.global_ranks = list(ranks)
    if mine.default is None:
        mine.default = session
    else:
        mine.others.append(session)
    return session


def _checksum(ranks: list[int]) -> str:
    """Names a set of ranks in a job id: the same on every rank of the set, another for another set."""
    return f"{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"


def _slice_job(suffix: str, ranks: list[int], what: str) -> dict:
    """_attach's job arguments for a job of some of the launch's ranks (this process's global rank among them).

    A one-node job where they lie within one node (``$LOCAL_WORLD_SIZE``
    ranks each), else one across nodes holding as many of them each.
    """
    job = _job_of_launch()
    if job is None:
        raise ValueError(f"{what} needs a job id: set $DBUF_JOB, launch with torchrun, or call "
                         f"torch.distributed.init_process_group() first")
    me = dist.get_rank() if dist.is_initialized() else _env_int("RANK", 0)
    if me not in ranks:
        raise dbuf.InternalError(f"rank {me} is not among the ranks {ranks} of its own mesh")
    # Without torchrun's variable, the launch is one node's (one dbufd).
    world = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    per_node = _env_int("LOCAL_WORLD_SIZE", 0) or world
    per_node_counts: dict[int, int] = {}
    for rank in ranks:
        per_node_counts[rank // per_node] = per_node_counts.get(rank // per_node, 0) + 1
    counts = set(per_node_counts.values())
    if ranks != sorted(ranks):
        raise ValueError(f"{what} with ranks {ranks}: a dbuf job's ranks must be in ascending order")
    if len(counts) != 1:
        raise ValueError(
            f"{what} with ranks {ranks} and {per_node} ranks per node: each node must hold as many of them"
        )
    local_world_size = 0 if len(per_node_counts) == 1 else counts.pop()
    return {"job": f"{job}.{suffix}", "rank": ranks.index(me), "world_size": len(ranks),
            "local_world_size": local_world_size}


def is_initialized() -> bool:
    """Whether this rank has a default session (init() ran, or fully_shard made one)."""
    mine = _rank_sessions()
    return mine is not None and mine.default is not None


def destroy() -> None:
    """Detaches this rank's sessions (the daemon keeps persistent jobs' shards)."""
    _close_all(_take_rank_sessions())
