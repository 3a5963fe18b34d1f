"""The processes of a tensor-parallel stack (`engine.tensor_parallel: N`): rank 0 and its followers.

SPMD, as in gpt-fast: every rank builds the same stack (its shard of every model) and runs the same request driver.
Rank 0 is the user's process: it owns the requests and the host side, and once per driver turn broadcasts that
turn's control inputs (the requests it took, with their resolved parameters and seeds; cancellations; the stack's
graph mode) over local sockets (`ControlChannel`). Followers apply them and run the same turn; everything after
that is identical on every rank by construction (the all-reduced activations and all-gathered logits are the same
bits everywhere, and every draw comes from the rows' seeded streams), so no device result is ever sent between
ranks and followers drop their outputs. Ranks are spawned here (`start_ranks`), or come from `torchrun`'s
environment. The device collectives run on the default group: NCCL on CUDA, gloo on the CPU.

The group outlives a decoder: a closed decoder hands its ranks back to the process's `RankPool` (one per process,
as torch's default group is), the next decoder of the same size leases them and sends the followers its config,
and the group ends with the process. Starting ranks costs seconds (each imports torch and hsmc), loading a
stack on them only what its shards take.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hsmc.errors import ConfigError, HsmcError
from hsmc.models.parallel import SymmetricAllReduce, TensorParallel

STARTUP_TIMEOUT = timedelta(minutes=30)  # of the groups (joining and `check` wait for every rank's start and load)


@dataclass
class Ranks:
    """This process's rank in a running tensor-parallel group, and the group's control channel."""

    tp: TensorParallel
    control: Any  # the gloo group of the collectives on the host (setting up, `check`)
    channel: ControlChannel  # rank 0's messages to the others, once per driver turn
    threads: int  # torch's CPU threads before joining (the ranks of a CPU group share the cores)
    device: str  # the device type: cuda or cpu
    followers: list[BaseProcess] = field(default_factory=list)  # the processes rank 0 spawned

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0's `message` on every rank (followers pass nothing and wait for it)."""
        if self.leader:
            self.channel.send(message)
            return message
        return self.channel.receive()

    def check(self, error: BaseException | None) -> None:
        """Every rank reports how building its stack went (`error`: its own failure); if one failed, every rank
        raises: its own error, or the first failing rank's as an HsmcError."""
        errors: list[str | None] = [None] * self.tp.world_size
        dist.all_gather_object(errors, None if error is None else str(error), group=self.control)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if error is not None:
            raise error
        if failed:
            raise HsmcError(f"tensor-parallel rank {failed[0][0]}: {failed[0][1]}")

    def close(self) -> None:
        """End the group; rank 0 first tells the followers to stop (`broadcast(None)` where they wait for a
        config)."""
        if self.leader:
            self.broadcast(None)
        self.leave()

    def leave(self) -> None:
        """Destroy this process's groups and wait for the followers it spawned."""
        self.channel.close()
        dist.destroy_process_group()
        torch.set_num_threads(self.threads)
        for p in self.followers:
            p.join()


class ControlChannel:
    """Rank 0's messages to the other ranks of the host: a length-prefixed pickle over one local TCP socket per
    follower. A driver turn sends one, so its latency is on every step's path: gloo's `broadcast_object_list` took
    374 µs for an empty turn on an H200 host, about what a 0.6B decode step costs on the GPU; a socket took 9 µs on
    an H100 host. Followers block in `receive` (no spinning) for as long as rank 0 has nothing to say."""

    HEADER = struct.Struct("<Q")

    def __init__(self, rank: int, world_size: int, control: Any) -> None:
        """Collective over `control`: rank 0 listens and tells the others its port, they connect."""
        self.peers: list[socket.socket] = []
        if rank == 0:
            with socket.create_server(("127.0.0.1", 0)) as server:
                dist.broadcast_object_list([server.getsockname()[1]], src=0, group=control)
                self.peers = [server.accept()[0] for _ in range(world_size - 1)]
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            self.peers = [socket.create_connection(("127.0.0.1", box[0]))]
        for peer in self.peers:
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for peer in self.peers:
            peer.sendall(self.HEADER.pack(len(data)) + data)

    def receive(self) -> Any:
        (size,) = self.HEADER.unpack(self._read(self.HEADER.size))
        return pickle.loads(self._read(size))

    def _read(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self.peers[0].recv(size - len(data))
            if not chunk:
                raise HsmcError("tensor parallelism: rank 0 closed the control channel (its process ended)")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


class RankPool:
    """The group this process leads while no decoder uses it, so that the next decoder of the same size and
    device type starts in the time its shards take to load."""

    def __init__(self) -> None:
        self.idle: Ranks | None = None

    def lease(self, world_size: int, device: str, follow: Callable[..., None]) -> Ranks:
        """The idle group if it fits, else a new one (`start_ranks`; the idle one ends first)."""
        idle, self.idle = self.idle, None
        if idle is not None and (idle.tp.world_size, idle.device) == (world_size, torch.device(device).type):
            return idle
        if idle is not None:
            idle.close()
        return start_ranks(world_size, device, follow)

    def give_back(self, ranks: Ranks) -> None:
        """A decoder is done with its ranks (its followers wait for the next config)."""
        self.close()
        self.idle = ranks

    def close(self) -> None:
        if self.idle is not None:
            self.idle.close()
            self.idle = None


POOL = RankPool()
atexit.register(POOL.close)  # the followers end with this process


def check_world(world_size: int, device: str) -> None:
    """One-line errors for a tensor_parallel the machine cannot run."""
    if world_size < 1:
        raise ConfigError(f"engine.tensor_parallel={world_size} must be >= 1")
    if device.startswith("cuda") and world_size > max(1, torch.cuda.device_count()):  # no GPU: build_stack says so
        raise ConfigError(
            f"engine.tensor_parallel={world_size} but {torch.cuda.device_count()} CUDA device(s) are visible"
        )


def start_ranks(world_size: int, device: str, follow: Callable[..., None], args: tuple[Any, ...] = ()) -> Ranks:
    """Join (under torchrun) or start the group of `world_size` ranks on `device`'s type; this process is rank 0
    unless torchrun says otherwise. Spawned followers run `follow(rank, world_size, init_method, device, *args)`."""
    check_world(world_size, device)
    if dist.is_initialized():
        raise HsmcError("a tensor-parallel decoder is already running in this process: close() it first")
    if "WORLD_SIZE" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ConfigError(
                f"engine.tensor_parallel={world_size} but torchrun started {os.environ['WORLD_SIZE']} processes"
            )
        return join(int(os.environ["RANK"]), world_size, "env://", device)
    init_method = local_init_method()
    context = mp.get_context("spawn")
    followers = [
        context.Process(target=follow, args=(rank, world_size, init_method, device, *args), daemon=True)
        for rank in range(1, world_size)
    ]
    for p in followers:
        p.start()
    ranks = join(0, world_size, init_method, device)
    ranks.followers = followers
    return ranks


def join(rank: int, world_size: int, init_method: str, device: str) -> Ranks:
    """Enter the group as `rank`: the default group carries the device collectives (NCCL on CUDA, each rank on its
    own GPU; gloo on the CPU, where each rank takes its share of torch's threads: ranks that each spin on all the
    cores wait for one another's collectives about 10x longer), a gloo group for the host's collectives, and the
    control channel."""
    cuda = device.startswith("cuda")
    threads = torch.get_num_threads()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, threads // world_size))
    dist.init_process_group(  # on CUDA NCCL connects now, not inside the first forward, between all-reduce kernels
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=STARTUP_TIMEOUT,
        device_id=torch.device("cuda", rank) if cuda else None,
    )
    control = dist.new_group(backend="gloo", timeout=STARTUP_TIMEOUT)
    channel = ControlChannel(rank, world_size, control)
    symmetric = _symmetric_all_reduce(torch.device("cuda", rank), control) if cuda else None
    tp = TensorParallel(rank, world_size, symmetric=symmetric)
    return Ranks(tp, control, channel, threads, torch.device(device).type)


def _symmetric_all_reduce(device: torch.device, control: Any) -> SymmetricAllReduce | None:
    """The one-shot all-reduce over the default group, or None (NCCL alone, with a warning) where the GPUs cannot
    map one another's memory; the ranks agree on which (one rank on NCCL and another waiting in a one-shot kernel
    would hang)."""
    try:
        symmetric: SymmetricAllReduce | None = SymmetricAllReduce(dist.group.WORLD, device)
    except Exception as e:  # noqa: BLE001 (an optional fast path: whatever stops it, NCCL still works)
        warnings.warn(f"tensor parallelism: no symmetric memory ({e}); all-reduces go through NCCL", stacklevel=2)
        symmetric = None
    everywhere = torch.tensor([int(symmetric is not None)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=control)
    return symmetric if everywhere.item() else None


def local_init_method() -> str:
    """A torch.distributed init method for ranks of this host: TCP on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
