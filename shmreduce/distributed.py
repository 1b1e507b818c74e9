"""One copy per host: the ranks of a ``torch.distributed`` job share objects through shmreduce.

``broadcast_local(obj, src=0, group=None)`` is a collective in the shape of
``torch.distributed.broadcast_object_list``: every rank of *group* calls it after
``init_process_group``; it returns *src*'s ``obj`` on every rank, its tensors and storages
mapped from **one copy per host** in shared memory, everything else pickled as
usual (cloudpickle, as ``shmreduce.dumps``).

What this module owns, and what it must never do:

* **Hosts.** Ranks are on one host when they see the same shm base on the same running
  kernel (hostname, ``boot_id``, the base's path and inode: ``_host_id``). Each host has a
  *leader*: *src* on its own host, the lowest rank of the group elsewhere. *src* sends
  ``obj`` by value, through the engine (``send_object_list``, the group's own pickling),
  to each other host's leader only: one copy crosses the network per host, never one per
  rank. Each leader shares its object into its program (``shmreduce.dumps``, moving
  tensors in place); its host's ranks load those bytes. A leader alone on its host
  (one rank there) keeps its object as it is: nothing to share, nothing copied.
* **One program per host.** A rank that loads from its leader joins the leader's program
  (its directory, its root, its ``multiprocessing`` authkey): from then on its own
  DataLoader workers, pools and spawn children share into that program too, and any rank
  of the host can be the next call's source with no exchange. A rank that already shares
  through a program of its own (it sent or received through shmreduce, or has children)
  cannot switch: it gets a ``SharingError`` (every rank does).
* **The key never crosses the engine.** The group's store and its links are reachable by
  whatever can reach their address; the program's key must stay with this user on this
  host. The leader writes the key into a 0600 file, ``join-<128 random bits>``,
  inside its program directory (0700, this user's: ``protocol.is_program_dir``), with the
  shared bytes after it (handles, and what the object holds besides tensors: of no use on
  another host either); only the file's name goes through the engine, so what the ranks
  gather stays a few bytes a rank however many hosts. A rank reads it only if the file is a
  regular file of its own uid, mode 0600, in a program directory of its own shm base. The
  leader removes the file once every rank answered; killed before that, the file goes with
  the program directory when its broker exits. Ranks of one host running as different users
  are refused before anything is shared (a process of another user could not read the file,
  nor reach the broker); a rank of another job never gets the file's name, and its loads of
  this job's messages are refused by the broker (another authkey).
* **Registration.** A rank that is not registered is registered (``register()``, with the
  strategy set): what it gets is shmreduce's memory, and torch's reducers would move it
  into memory of their own when the rank hands it to a worker (a copy, no more aliased).
* **Errors on every rank, never a hang.** Each step ends in a collective that carries
  every rank's outcome: a failure on one rank (ranks disagreeing on *src*, ``/dev/shm``
  too small for the object, a rank of another user, an object cloudpickle cannot pickle)
  is a ``SharingError`` on every rank, naming the rank and its cause. A rank that dies
  mid-call leaves the others waiting at most the group's own timeout, as with any
  collective of ``torch.distributed``.

Lifetimes are the program's: the memory stays while any rank (or any child of
one) holds a tensor of it, whoever exits or is killed first; the broker counts a killed
rank out; when the last rank of the host is gone, the broker exits and removes the
program directory.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import socket
import stat
from typing import Any

import torch
import torch.distributed as dist

from shmreduce import _native, _platform, program, registry
from shmreduce.broker import client as broker
from shmreduce.broker.protocol import is_program_dir
from shmreduce.errors import SharingError

KEY_PREFIX = "join-"  # the key files' names in a program directory: join-<32 hex digits>

__all__ = ["broadcast_local"]


def broadcast_local(obj: Any, src: int = 0, group: Any = None) -> Any:
    """*src*'s *obj* on every rank of *group*, one copy of its tensors per host.

    Call it on every rank of *group* (default: the whole job) after
    ``torch.distributed.init_process_group``, with the same *src* (a global rank, as in
    ``broadcast_object_list``); *obj* is ignored on the other ranks. On *src*'s host every
    rank gets *src*'s tensors (moved into shared memory in place: *src* keeps using them)
    mapped from one copy: writes by one rank are seen by the others. On every other host,
    one rank receives *obj* by value through the engine and shares it with the ranks of
    its host the same way (one copy per host). Non-tensor parts are pickled with
    cloudpickle on each host.

    Registers the calling process (``shmreduce.register()``, with the strategy set) if it is
    not registered: its DataLoader workers, pools and spawn children then get the returned
    tensors as shared memory, not as copies.

    Raises ``SharingError`` on every rank when any rank fails (before
    ``init_process_group``, ranks disagreeing on *src*, shared memory too small, a rank of
    another user on the host, a rank that already shares through another program).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise SharingError(
            "shmreduce.distributed.broadcast_local is a collective of torch.distributed: call "
            "torch.distributed.init_process_group() on every rank first"
        )
    if not registry.is_registered():
        # What it returns is shmreduce's memory: only a registered process hands it on to its
        # workers and pools as it is (torch's reducers would move it into memory of their own,
        # a copy per rank, and that rank's writes would no longer reach the others).
        registry.register()
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if rank not in ranks:
        raise SharingError(f"rank {rank} is not in the group it called broadcast_local for (ranks {ranks})")

    # 1. Who is where, and does everyone name the same source?
    hosts = _gather((_host_id(), src, os.getuid()), group)
    sources = {s for _host, s, _uid in hosts}
    if len(sources) != 1:
        said = ", ".join(f"rank {r}: src={s}" for r, (_h, s, _u) in zip(ranks, hosts, strict=True))
        raise SharingError(f"broadcast_local: the ranks disagree on src ({said}); every rank must pass the same src")
    if src not in ranks:
        raise SharingError(f"broadcast_local: src={src} is not a rank of the group (ranks {ranks})")
    host_of = {r: h for r, (h, _s, _u) in zip(ranks, hosts, strict=True)}
    users = {(h, u) for h, _s, u in hosts}
    if len(users) != len(set(host_of.values())):
        said = ", ".join(f"rank {r}: uid {u}" for r, (_h, _s, u) in zip(ranks, hosts, strict=True))
        raise SharingError(
            f"broadcast_local: ranks of one host run as different users ({said}); shmreduce shares memory only "
            "between processes of one user (the others could not read its key, nor reach its memory): run the "
            "ranks of a host as one user"
        )
    leaders: dict[str, int] = {}
    for r in ranks:
        leaders.setdefault(host_of[r], r)
    leaders[host_of[src]] = src
    leader = leaders[host_of[rank]]

    # 2. By value to each other host's leader (nothing to do on a single host).
    failure: str | None = None
    if len(leaders) > 1:
        if rank == src:
            failure = _send_by_value(obj, [r for r in leaders.values() if r != src], group)
        elif rank == leader:
            obj, failure = _receive_by_value(src, group)
        _raise_failures(ranks, _gather(failure, group), "sending the object to the other hosts")

    # 3. Each leader with other ranks on its host shares its object into its program, and
    # writes the key and the shared bytes into a private file there (a leader alone on its
    # host keeps its object as it is).
    offer: tuple[str, str] | None = None
    here = sum(host_of[r] == host_of[rank] for r in ranks)
    if rank == leader and here > 1:
        try:
            offer = _offer(obj, here)
        except Exception as exc:  # noqa: BLE001  told to every rank, raised on every rank below
            failure = _why(exc)
    offers = _gather((failure, offer), group)
    try:
        _raise_failures(ranks, [f for f, _o in offers], "sharing the object on its host")
        # 4. The other ranks of each host join its program and load the object.
        result, failure = obj, None
        if rank != leader:
            mine = offers[ranks.index(leader)][1]
            assert mine is not None
            try:
                result = _accept(*mine)
            except Exception as exc:  # noqa: BLE001  as above
                result, failure = None, _why(exc)
        _raise_failures(ranks, _gather(failure, group), "joining the host's program and loading the object")
    finally:
        if offer is not None:
            _remove_key_file(*offer)
    return result


# -- hosts ---------------------------------------------------------------------------


def _host_id() -> str:
    """What ranks share memory by: one kernel (``boot_id``, the hostname) and one shm base
    (its path and inode). Ranks with different ``SHMREDUCE_SHM_DIR`` are on different hosts
    for shmreduce: each such group gets its own copy."""
    base = program.shm_base()
    try:
        st = os.stat(base)
        where = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        where = "?"
    return f"{socket.gethostname()}|{_platform.boot_id()}|{base}|{where}"


# -- collectives ---------------------------------------------------------------------


def _gather(value: Any, group: Any) -> list[Any]:
    """Every rank's *value*, in the group's rank order (pickled by value, by the engine)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _raise_failures(ranks: list[int], failures: list[str | None], step: str) -> None:
    said = [f"rank {r}: {f}" for r, f in zip(ranks, failures, strict=True) if f is not None]
    if said:
        raise SharingError(f"broadcast_local failed {step} ({'; '.join(said)})")


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _send_by_value(obj: Any, leaders: list[int], group: Any) -> str | None:
    """On *src*: *obj* by value to each other host's leader; pickled once, here, so that a
    failure reaches them as a message, not as a receive that never ends."""
    if not leaders:
        return None
    import pickle

    try:
        message: list[Any] = [None, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)]
        failure = None
    except Exception as exc:  # noqa: BLE001  told to the leaders, raised on every rank
        failure = _why(exc)
        message = [failure, None]
    for dst in leaders:
        dist.send_object_list(message, dst=dst, group=group)
    return failure


def _receive_by_value(src: int, group: Any) -> tuple[Any, str | None]:
    import pickle

    message: list[Any] = [None, None]
    dist.recv_object_list(message, src=src, group=group)
    failure, data = message
    if failure is not None:
        return None, f"the source could not pickle the object ({failure})"
    return pickle.loads(data), None


# -- the key, from a leader to the ranks of its host ----------------------------------


def _offer(obj: Any, ranks_here: int) -> tuple[str, str]:
    """On a leader: *obj* shared into this process's program; the program directory and
    the name of the file written there: the program's root and key (a line of JSON), then
    the shared bytes (refs: a few hundred bytes however large its tensors). Host-local,
    all of it: nothing of it is any use on another host.

    Its copies run on the intra-op threads of the *ranks_here* ranks of this host (within
    this process's CPU affinity mask): the others wait in the next collective meanwhile,
    their cores idle. torchrun starts every rank with one intra-op thread
    (OMP_NUM_THREADS=1): one thread would copy a host's whole dataset while the others
    wait for it."""
    _native.set_intra_op_threads(torch.get_num_threads() * ranks_here)
    try:
        data = registry.dumps(obj)
    finally:
        _native.set_intra_op_threads(torch.get_num_threads())  # the process's own again (patches)
    prog = program.current()
    # A live broker keeps the directory (the key file's home) while the ranks read it;
    # a fresh one is started if the object held no tensor.
    broker.client_for(prog.directory, prog.root_pid).connect()
    name = f"{KEY_PREFIX}{secrets.token_hex(16)}"
    header = json.dumps({"root_pid": prog.root_pid, "authkey": bytes(multiprocessing.current_process().authkey).hex()})
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(os.path.join(prog.directory, name), flags, 0o600), "wb") as f:
        f.write(header.encode() + b"\n")
        f.write(data)
    return prog.directory, name


def _remove_key_file(directory: str, name: str) -> None:
    try:
        os.unlink(os.path.join(directory, name))
    except OSError:
        pass  # the program directory went with its broker, and the file with it


def _accept(directory: str, name: str) -> Any:
    """On a rank that is not its host's leader: join the leader's program (read its key
    file), then load the shared bytes."""
    root_pid, authkey, data = _read_key(directory, name)
    _join(program.Program(directory, root_pid), authkey)
    return registry.loads(data)


def _read_key(directory: str, name: str) -> tuple[int, bytes, bytes]:
    """The root pid, authkey and shared bytes in the key file *name* of the program directory
    *directory*: only from a program directory of this user in this process's shm base,
    and a regular file of this user that nobody else can read."""
    if not name.startswith(KEY_PREFIX) or os.sep in name or not is_program_dir(directory, program.shm_base()):
        raise SharingError(
            f"{directory} is not a shmreduce program directory of this user (uid {os.getuid()}) in this "
            f"rank's shm base {program.shm_base()}: the ranks of one host must run as one user, with one "
            "SHMREDUCE_SHM_DIR"
        )
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SharingError(
            f"cannot read the program's key file {path} ({exc.strerror}): only ranks of the user that "
            f"runs the source rank (this rank is uid {os.getuid()}) share its memory"
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise SharingError(f"refused the key file {path}: not a private file of this user (uid {os.getuid()})")
        with open(fd, "rb", closefd=False) as f:
            header, data = f.readline(), f.read()
    finally:
        os.close(fd)
    try:
        fields = json.loads(header)
        return int(fields["root_pid"]), bytes.fromhex(fields["authkey"]), data
    except (ValueError, KeyError, TypeError) as exc:
        raise SharingError(f"refused the key file {path}: it is not one broadcast_local wrote") from exc


def _join(prog: program.Program, authkey: bytes) -> None:
    """Make this process a process of *prog* (its directory, root and authkey), unless it
    is one already. Refused if it shares through a program of its own: its connections,
    files and children are that program's, and would be refused by the new key."""
    current = program.peek()
    if current is not None and current.directory == prog.directory:
        return
    children = multiprocessing.active_children()
    if broker.existing_clients() or children:
        what = "it sent or received tensors through shmreduce" if broker.existing_clients() else f"{len(children)} child process(es)"
        raise SharingError(
            f"this rank (pid {os.getpid()}) already shares through a shmreduce program of its own "
            f"({current.directory if current else 'none'}: {what}) and cannot join its host's "
            f"program {prog.directory}: call broadcast_local before this rank shares, receives or "
            "starts workers (DataLoader, Pool), e.g. right after init_process_group"
        )
    multiprocessing.current_process().authkey = authkey
    program.adopt(prog)
