"""Multi-host serving: process start-up through `jax.distributed` and the leader / follower step protocol.

JAX on several hosts is multi-controller: every process runs the same executables in the same order with the same
inputs, each driving its own devices, and the collectives inside a step (tensor parallelism's all-reduces) meet
across processes. jaxserve keeps one scheduler: process 0 leads (scheduler, front end, output processing) and the
others follow. The runner is the only module that runs device work (`runner.py`), and every run goes through
`dispatch` (`run_many` = `dispatch` + `fetch`), which calls `runner.publish(items)` with the step's packed inputs
right before `runner.execute(items)`.
`lead` sets `publish` to a send of the items to every follower; `follow` is the follower's loop: receive the items,
`runner.execute(items)`, never fetch, until the leader's stop message. Compilation needs nothing: an executable is
compiled on first use (`ModelRunner.executable`) in every process from the same bucket, or by the same `warmup`
when every process builds the engine with the same config.

Transport: one TCP connection from each follower to the leader, not a device collective. A step's items are a few
KiB of int32 already packed on the host; a socket sends them without touching a device, with no per-shape compile
(`multihost_utils.broadcast_one_to_all` compiles one broadcast per buffer size, i.e. per bucket, and would put a
collective on the device queue ahead of every step) and with no barrier on the leader: it sends and dispatches at
once, and the step's own collectives hold it until the followers have dispatched theirs. The leader listens on a
free port (or `JAXSERVE_STEP_PORT`) and publishes `host:port` in the coordination service's key-value store, so
nothing else has to agree on a port; the host is the coordinator address's (process 0 runs the coordinator).

Messages (network byte order): a header `!4sII` (b"JXS1", kind, item count), then per item `!IIIIBQ` (the bucket's
num_tokens, num_seqs, max_pages, num_rows, with prompt logprobs, int32 count) and the int32 buffer. Kind 1 is a
step, kind 2 stop.

Meshes: tensor parallelism may span processes (every array of a step lives on every process's devices; the leader
reads its own replica of the outputs). Pipeline stages may sit on different processes: the stage boundary is then a
cross-process `device_put`, which the CPU backend runs only with `jax_cross_host_transfer_socket_address` set
(`initialize` sets it on CPU, or from `JAXSERVE_TRANSFER_ADDRESS`; without it jax raises "does not support
cross-host device transfers"), and outputs that live only on other processes' devices are copied to process 0's in
every process, the same copy in the same order (`_gather_outputs`). Speculation with a device-side proposer (draft
model, EAGLE-3) runs its own steps outside `dispatch` and is refused (`check_supported`); n-gram runs.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.batch import Bucket

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAXSERVE_COORDINATOR"
ENV_NUM_PROCESSES = "JAXSERVE_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSERVE_PROCESS_ID"
ENV_STEP_PORT = "JAXSERVE_STEP_PORT"
ENV_TRANSFER_ADDRESS = "JAXSERVE_TRANSFER_ADDRESS"
CONNECT_TIMEOUT_MS = 300_000

_MAGIC = b"JXS1"
_STEP, _STOP = 1, 2
_HEADER = struct.Struct("!4sII")
_ITEM = struct.Struct("!IIIIBQ")

Item = tuple[Bucket, bool, np.ndarray]  # (bucket, with prompt logprobs, packed i32[*]): what `runner.execute` takes


@dataclass(frozen=True, kw_only=True)
class DistributedContext:
    process_id: int
    num_processes: int
    coordinator: str | None  # HOST:PORT; None when a cluster environment chose it

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def add_cli_args(parser) -> None:
    """--coordinator / --num-processes / --process-id (each defaults to its JAXSERVE_* environment variable)."""
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help=f"multi-host: process 0's address for jax.distributed (or ${ENV_COORDINATOR}); with "
                             "--num-processes and --process-id. Without them, a SLURM / Open MPI job or "
                             "JAX_COORDINATOR_ADDRESS is detected by jax")
    parser.add_argument("--num-processes", type=int, default=None,
                        help=f"multi-host: processes (or ${ENV_NUM_PROCESSES})")
    parser.add_argument("--process-id", type=int, default=None,
                        help=f"multi-host: this process's index, 0 leads (or ${ENV_PROCESS_ID})")


def cluster_detected() -> bool:
    """Whether the environment describes a multi-process job that `jax.distributed.initialize()` detects on its own
    (JAX's own variable, a SLURM step of several tasks, an Open MPI job of several ranks)."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")):
        return int(env.get("SLURM_NTASKS", "1")) > 1
    if "OMPI_MCA_orte_hnp_uri" in env:
        return int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    return False


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> DistributedContext | None:
    """Start this process's part of a multi-host job (before any jax computation). The three values, else their
    JAXSERVE_* environment variables, must be given together; with none of them, a detected cluster environment
    (`cluster_detected`) is initialised by jax itself; otherwise this is one process and None is returned."""
    env = os.environ
    coordinator = coordinator if coordinator is not None else env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = int(env[ENV_NUM_PROCESSES])
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = int(env[ENV_PROCESS_ID])
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if all(v is None for v in given.values()):
        if not cluster_detected():
            return None
    else:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"multi-host needs --coordinator, --num-processes and --process-id together (missing "
                             f"{', '.join(missing)}; or set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id must be in [0, --num-processes) (got {process_id} of {num_processes})")
        if ":" not in coordinator:
            raise ValueError(f"--coordinator must be HOST:PORT (got {coordinator!r})")
    _enable_cross_host_transfers(coordinator)
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        # CPU devices' collectives across processes need an implementation (the default has none); harmless where
        # the accelerators have their own
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    ctx = DistributedContext(process_id=jax.process_index(), num_processes=jax.process_count(),
                             coordinator=coordinator or _coordinator_address())
    logger.info("process %d of %d (coordinator %s): %d of %d devices local", ctx.process_id, ctx.num_processes,
                ctx.coordinator, len(jax.local_devices()), len(jax.devices()))
    return ctx


def _enable_cross_host_transfers(coordinator: str | None) -> None:
    """Cross-process `device_put` (pipeline stages on different processes): on CPU it needs a transfer server's
    address, this process's interface towards the coordinator and a port free now, unless one is set (port 0 does
    not work: the address is published as given, and the receiving end of a copy then waits forever)."""
    from jax._src import xla_bridge  # the flag is defined there, not on jax.config's attributes

    if xla_bridge.CROSS_HOST_TRANSFER_SOCKET_ADDRESS.value:
        return
    address = os.environ.get(ENV_TRANSFER_ADDRESS)
    if address is None and os.environ.get("JAX_PLATFORMS", jax.config.jax_platforms or "") == "cpu" and coordinator:
        host, port = coordinator.rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: the routing table answers
            s.connect((host, int(port)))
            ip = s.getsockname()[0]
        with socket.socket() as s:
            s.bind((ip, 0))
            address = f"{ip}:{s.getsockname()[1]}"
    if address:
        jax.config.update("jax_cross_host_transfer_socket_address", address)


def initialize_from_args(args) -> DistributedContext | None:
    """`initialize` from `add_cli_args`'s parsed flags."""
    return initialize(args.coordinator, args.num_processes, args.process_id)


def check_supported(engine_cfg) -> None:
    """Refuse, naming the field, what multi-host serving does not run (see the module docstring)."""
    spec = engine_cfg.speculative_config
    if spec is not None and spec.method != "ngram":
        raise NotImplementedError(f"speculative_config.method={spec.method!r} is not available on several processes "
                                  "(its proposer runs device steps the followers do not replay); ngram is")
    mesh = engine_cfg.mesh
    if mesh is not None and mesh.dp > 1:
        raise NotImplementedError(f"mesh {mesh.name or mesh.shape}: data parallelism (mesh.dp={mesh.dp}) is not "
                                  "available on several processes (each replica is an engine with its own "
                                  "scheduler); run one server per replica")


def lead_engine(engine, ctx: DistributedContext) -> Leader:
    """`lead` for an LLMEngine (process 0 of `jaxserve serve`), after refusing what several processes do not run."""
    check_supported(engine.config)
    return lead(engine.runner, ctx)


def follow_engine(model: str | None, engine_config) -> int:
    """Every process but 0 of `jaxserve serve`: build the leader's engine (the same model and config give the same
    placements and executables), then run its steps until it stops (`follow`)."""
    from jaxserve.engine import LLMEngine

    check_supported(engine_config)
    return follow(LLMEngine(model, engine_config).runner)


# ---- the leader / follower step channel ----------------------------------------------------------------------


class Leader:
    """The leader's end: one connection per follower; `publish` sends a step's items to all of them."""

    def __init__(self, connections: list[socket.socket]):
        self.connections = connections

    def publish(self, items: list[Item]) -> None:
        message = _encode(_STEP, items)
        for c in self.connections:
            c.sendall(message)

    def stop(self) -> None:
        """Tell every follower to return from `follow`, and close the connections (idempotent)."""
        message = _encode(_STOP, [])
        for c in self.connections:
            try:
                c.sendall(message)
            except OSError as e:  # a follower already gone: nothing left to stop
                logger.warning("stop: a follower's connection failed (%s)", e)
            c.close()
        self.connections = []


def lead(runner, ctx: DistributedContext | None = None, channel: str = "steps") -> Leader:
    """On process 0: accept every follower's connection and set `runner.publish` to send each step's items to them.
    Returns the `Leader`, whose `stop()` ends the followers' loops (call it at shutdown). `runner.execute` is wrapped
    so its outputs are readable here (`_gather_outputs`, then this process's replica). `channel`: a name the
    followers' `follow` gives too, one per runner led."""
    num_followers = jax.process_count() - 1
    port = int(os.environ.get(ENV_STEP_PORT, "0"))
    server = socket.create_server(("", port), backlog=max(1, num_followers))
    host = _channel_host(ctx)
    _kv_set(f"jaxserve/{channel}", f"{host}:{server.getsockname()[1]}")
    by_id: dict[int, socket.socket] = {}
    try:
        server.settimeout(CONNECT_TIMEOUT_MS / 1000)
        while len(by_id) < num_followers:
            conn, _ = server.accept()
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            by_id[struct.unpack("!I", _recv_exact(conn, 4))[0]] = conn
    finally:
        server.close()
    leader = Leader([by_id[i] for i in sorted(by_id)])
    runner.publish = leader.publish
    runner.execute = _readable_here(_gather_outputs(runner.execute))
    logger.info("leading %d followers", num_followers)
    return leader


def follow(runner, channel: str = "steps") -> int:
    """On every process but 0: connect to the leader's `channel` and run its steps (`runner.execute`, outputs never
    fetched) until it says stop. Returns the number of steps run; raises ConnectionError if the leader goes away
    without saying stop."""
    execute = _gather_outputs(runner.execute)
    host, port = _kv_get(f"jaxserve/{channel}").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_MS / 1000)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(struct.pack("!I", jax.process_index()))
    num_steps = 0
    with conn:
        while True:
            try:
                kind, items = _receive(conn)
            except ConnectionError as e:  # the leader died: this process cannot go on alone
                raise ConnectionError(f"the leader's step channel {channel!r} closed without a stop message after "
                                      f"{num_steps} steps ({e})") from e
            if kind == _STOP:
                break
            execute(items)
            num_steps += 1
    return num_steps


def _encode(kind: int, items: list[Item]) -> bytes:
    parts = [_HEADER.pack(_MAGIC, kind, len(items))]
    for bucket, with_prompt, packed in items:
        packed = np.ascontiguousarray(packed, dtype=">i4")
        parts.append(_ITEM.pack(bucket.num_tokens, bucket.num_seqs, bucket.max_pages, bucket.num_rows,
                                bool(with_prompt), packed.size))
        parts.append(packed.tobytes())
    return b"".join(parts)


def _receive(conn: socket.socket) -> tuple[int, list[Item]]:
    magic, kind, n = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
    if magic != _MAGIC or kind not in (_STEP, _STOP):
        raise ValueError(f"step channel: unexpected message header {magic!r} kind {kind} (leader and follower "
                         "must run the same jaxserve version)")
    items = []
    for _ in range(n):
        num_tokens, num_seqs, max_pages, num_rows, with_prompt, size = _ITEM.unpack(_recv_exact(conn, _ITEM.size))
        packed = np.frombuffer(_recv_exact(conn, 4 * size), dtype=">i4").astype(np.int32)
        items.append((Bucket(num_tokens, num_seqs, max_pages, num_rows), bool(with_prompt), packed))
    return kind, items


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _gather_outputs(execute):
    """`execute` whose outputs living only on other processes' devices (a last pipeline stage there) are copied to
    as many of process 0's devices, replicated. Every process runs it: a cross-process copy has both ends take
    part, in the same order."""
    shardings: dict[int, NamedSharding] = {}

    def to_leader(array):
        if not isinstance(array, jax.Array) or any(d.process_index == 0 for d in array.sharding.device_set):
            return array
        n = len(array.sharding.device_set)  # the copy keeps the device count (CopyArrays requires it)
        if n not in shardings:
            devices = [d for d in jax.devices() if d.process_index == 0][:n]
            if len(devices) < n:
                raise ValueError(f"a step output on {n} devices of other processes cannot be copied to process 0, "
                                 f"which has {len(devices)}: give the last pipeline stage no more devices than it")
            shardings[n] = NamedSharding(Mesh(np.asarray(devices, dtype=object), ("copy",)), PartitionSpec())
        return jax.device_put(array, shardings[n])

    def execute_gathered(items):
        return [jax.tree.map(to_leader, out) for out in execute(items)]

    return execute_gathered


def _readable_here(execute):
    """`execute` whose outputs are this process's replica of each (replicated) output array: on a mesh spanning
    processes the whole array is not addressable, so `jax.device_get` on it would fail."""
    def local(array):
        if isinstance(array, jax.Array) and not array.is_fully_addressable:
            return array.addressable_data(0)
        return array

    def execute_local(items):
        return [jax.tree.map(local, out) for out in execute(items)]

    return execute_local


def _client():
    from jax._src import distributed  # the coordination service's key-value store has no public API yet

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialised: call jaxserve.distributed.initialize first")
    return distributed.global_state.client


def _coordinator_address() -> str | None:
    from jax._src import distributed

    return distributed.global_state.coordinator_address


def _channel_host(ctx: DistributedContext | None) -> str:
    coordinator = (ctx.coordinator if ctx is not None else None) or _coordinator_address()
    return coordinator.rsplit(":", 1)[0] if coordinator else socket.gethostname()


def _kv_set(key: str, value: str) -> None:
    _client().key_value_set(key, value)


def _kv_get(key: str) -> str:
    return _client().blocking_key_value_get(key, CONNECT_TIMEOUT_MS)


__all__ = ["DistributedContext", "Leader", "add_cli_args", "check_supported", "cluster_detected", "follow",
           "follow_engine", "initialize", "initialize_from_args", "lead", "lead_engine"]
