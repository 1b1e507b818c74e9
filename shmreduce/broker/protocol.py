"""The wire protocol between shmreduce clients and their program's broker.

stdlib only: the broker imports this module and must never import torch.

Where
    One directory per program, ``<base>/shmreduce-<token>/`` (mode 0700), where
    ``<base>`` is ``$SHMREDUCE_SHM_DIR`` or ``/dev/shm``. It holds the marker
    ``shmreduce.program`` (made with the directory, atomically: only a directory with
    it, owned by this user, mode 0700 and no symlink, is ever used, swept or removed;
    see ``is_program_dir``: any other ``shmreduce-*`` entry is someone else's), the
    broker's socket ``broker.sock``, its lock ``broker.lock`` (flock'ed for the
    broker's whole life: a directory whose lock can be taken belongs to a dead
    program) and the ``file_system`` strategy's segment files ``seg-<24 hex>`` (mode
    0600).

Segments and generations (``shmreduce/pool.py``, ``shmreduce/transfer.py``)
    A sender keeps its segments (memfds, or files here) and fills them anew, in
    *generations* (a number unique in the program). A pooled segment's first
    HEADER_BYTES (``_native.HEADER_BYTES``, a page) are shared by every process that
    maps it: the generation, refs *sent*, refs *loaded*, *holders*, tickets *issued*,
    *flags* (RETIRED, UNCOUNTED), then one bit per ticket (``_native``, atomics).

    The invariant: **a generation's memory is reused only when no process holds a
    storage of it and no message naming it waits to be loaded for the first time.**
    Where that cannot be counted exactly, the generation is *retired*: never reused,
    its pages go back to the system when the last mapping and descriptor go, as
    torch's do. What each event does:

    send        a ref is pickled: it draws a ticket (issued + 1; a ticket past the
                bitmap sets RETIRED | UNCOUNTED). Once the whole message is pickled,
                sent + 1 per ref (a pickle that fails counts nothing sent).
    first load  (the first storage of the generation in this process) the ledger
                entry is written TAKING; holders + 1 (waits while FREEING); the
                generation checked (stale: holders - 1, entry cleared, SharingError);
                the entry becomes HELD; the storage is made; its ticket's bit set:
                loaded + 1 if the bit was clear.
    load again  (the same bytes, here or anywhere) the ticket's bit is set already:
                nothing is counted. A load in a process holding the generation takes
                no hold.
    drop        the last storage of the generation here dies: the entry becomes
                DROPPING, holders - 1, the entry is cleared (FREE).
    owner's end the owner's own storages of it all dead: ``hdr_end`` sets FREEING
                on holders == 0 and ends the generation if sent == loaded and it is
                not RETIRED (generation 0, counters, tickets, flags cleared); a
                RETIRED one leaves the pool (closed); else it waits and is looked at
                again (``Pool.reap_waiting``).
    fork        before any fork (``os.register_at_fork``), every generation with a
                storage or a hold alive in the forking process, owner or receiver, is
                retired: the child keeps what it inherits without holding it, and
                nobody can count when it lets go. A failed fork retired them too.
    death       (exit or SIGKILL at any point) the broker reads the process's ledger:
                a HELD entry is counted out (holders - 1); a DROPPING one's generation
                is retired (whether the header counted it out is unknown); for a TAKING
                one, whatever the header holds now is retired (a stale load's hold may
                have counted itself into the next generation, or a free segment's). A message the
                process never loaded keeps its generation from being reused while
                its owner lives (as torch's file_descriptor strategy keeps it through
                its sender's resource sharer), and at most ORPHAN_TTL after.
    broker death the headers live in the segments, not in the broker, and the ledgers
                in memfds their processes own: clients reconnect and post their
                ledgers again, and every owner brings the new broker the segments it
                keeps (``transfer._bring_back``): the new broker counts a process out
                of whatever its ledger holds, taken before the restart or after, as
                the old one would have (an entry of a segment nobody brought yet waits
                for it: ``Broker.unreached``). A process that dies while no broker
                runs, or before it posted its ledger to the new one, is never counted
                out: its holds pin their generations (not reused) for their owners'
                lifetimes.

    So in a steady stream, where every segment a message uses is known to the broker
    and mapped by its receiver, a message costs no record to the broker from either
    side (the Ledger, below, holds what a receiver holds).

    The broker is there for what a header cannot do: pass a memfd's descriptor (it
    keeps one per segment, deposited by the first ref a process sends to it, and a
    receiver fetches it once per segment it maps), name and unlink files, and clean
    up after a process that dies (holders it counted, segments it used).

Transport
    AF_UNIX, SOCK_SEQPACKET: every ``sendmsg`` is one record, delivered whole and in
    order, with its descriptors (SCM_RIGHTS) attached to it. Each client process has
    two connections, one identity (a random token sent in the handshake): *post*
    (role ``o``) for the fire-and-forget records X, H, R, L, K, and *request*
    (role ``q``) for S, F and P, which get replies. A ping first reads every post
    connection (a barrier: what any client posted before is seen). A deposit (S)
    is answered: a sender knows the broker keeps a memfd before any ref to it is
    sent, so a fetch never waits for a deposit still queued. Every record posted
    before a close counts: Linux may report ECONNRESET to the broker ahead of
    records still queued, which the broker reads on. A forked child opens its own
    connections (and its own token).

    A closed connection is not a death: the broker drops one for a bad
    record or an I/O error, and the process lives on. A client whose post or request
    connection the broker closed opens a new one, once per operation, with the same
    token (its ledger posted again on a new post connection); only a broker that
    cannot be reached then (it died: a sender starts a new one) is a SharingError.
    The token changes only after a K: a new token with the same ledger would be
    counted out twice.

Ledger
    The generations a process holds as a receiver in one program, in a memfd of
    LEDGER_ENTRY records it writes with plain stores (``client.Ledger``; one per
    program directory: a memfd forwarded into another program is known to both
    brokers, and each counts out only the holds taken through it). An entry's state
    says where the process is in taking or letting go of a hold (TAKING, HELD,
    DROPPING: see "the invariant" above), each change one aligned store. The broker
    keeps the descriptor and reads the ledger only once the process is gone (not once
    it said K): so holding and letting go cost no record, and a steady stream none at
    all. A process freezes its ledger before its connections close at exit (what it
    holds then, the brokers count out); a forked child makes its own.

Handshake (once per connection; the broker also checks SO_PEERCRED uid == its own,
and that every connection of a token comes from the pid of its first)
    The broker runs it inside its event loop, a step per record, never blocking: a
    connection that has not completed it within HANDSHAKE_TIMEOUT is closed.
    broker -> client   MAGIC + nonce_b (32 bytes)
    client -> broker   HMAC-SHA256(authkey, nonce_b) + nonce_c (32 bytes)
                       + role (1 byte) + process token (16 bytes)
    broker -> client   HMAC-SHA256(authkey, nonce_c) + broker pid (u32)
    The authkey is the program's ``multiprocessing`` authkey; either side closes the
    connection on a wrong digest.

Records after the handshake: ``op (1 byte) + key (16 bytes, unused: zeros) + body``,
at most MAX_RECORD bytes. None has a reply but S, F and P.
    S  segment   memfd descriptors attached (up to MAX_FDS), a body byte each (its
                 kind, SEG_KINDS): ``h`` (a pooled segment this
                 process made: it has a header), ``f`` (a pooled segment it received
                 and sends on: it forwards what another process made), ``t`` (a
                 storage torch moved for shmreduce: its header trails it), ``-`` (a
                 storage torch shared itself) or ``g`` (one of those it received and
                 sends on: kept ORPHAN_TTL from then, see Lifetimes). This client sends refs to them: the broker
                 keeps one descriptor per memfd (by inode), used by every client that
                 deposited it; a forwarder's deposit is no use of it (see Lifetimes:
                 the segment is kept while anything reaches it). Memfds deposited in
                 one record (the storages torch moved for one message) are fetched
                 together (F). Body ``n`` and a file
                 name: a file this process made and holds whose directory went with a
                 broker that died: its descriptor, through which the broker reads its
                 header (as H otherwise, and nothing to unlink at its release). Reply
                 ``s``: body = status
                 (u8): 0 = kept; 2 = lost: the kernel dropped the descriptors, the
                 broker being at its descriptor limit (MSG_CTRUNC), and it keeps none
                 of the record's. The sender then
                 fails with a SharingError before any ref to them is sent (a deposit
                 lost on a fire-and-forget record would make every later
                 fetch of it look stale, and lose the message silently).
    X  drop      body = inodes (ASCII decimal, "\n"-joined): this client no longer
                 uses these memfds (out of its pool).
    F  fetch     body = one inode and the descriptors the client takes at most
                 (1 to FETCHED_FDS), as X's body. Reply ``f``: body = status (u8) + descriptors
                 attached (u32) + the inodes of all but the first (as X's body);
                 status 0 = ok, the memfd's descriptor attached first, then those of
                 the memfds deposited after it in the same S record that the broker
                 keeps (the next storages of its message, as many as it takes); 1 =
                 no such memfd here (never deposited, or let go of: stale).
    H  hold      body = segment file names: this client made them and holds them.
    R  release   body = file names it no longer holds.
    L  ledger    one memfd descriptor attached, no body: this process's *ledger*
                 (see below), posted on every new post connection; it replaces the
                 one the broker kept for this client. A ledger is known to one
                 identity of its process at a time: another identity of the same pid
                 that has it lets go of it (its K was lost, below).
    K  keep      no body: this client closes its connections and lives on (e.g.
                 ``close_all()``); it counts itself out of what it holds when its
                 storages die, so the broker must not count it out at the close. A K
                 not posted within IO_TIMEOUT (the broker stopped, the buffer full)
                 leaves the identity known while its process lives; its ledger goes
                 to the next identity that posts it, so nothing is counted out twice;
                 its memfds and files are let go of at its death.
    P  ping      body empty, or ``full``. Reply ``p`` with body = JSON of the broker's
                 counters, ``records`` among them (how many of each op it has read).
                 A plain ping reads no ledger: its cost does not grow with what
                 clients hold (``ledger_bytes_read`` counts what the broker read of
                 ledgers). ``full`` (a diagnostic) adds ``generations_held`` (every
                 ledger read), the broker's ``descriptors`` and
                 ``lowest_free_descriptor`` (from ``/proc/self``: the broker is not
                 dumpable, so no other process of the user can list them) and
                 ``libtorch_mapped``.

Lifetimes
    A client's death is learnt from the kernel, never from a socket: the broker opens
    a pidfd per client process (its pid from SO_PEERCRED at accept) and watches it in
    its epoll. A client is counted out once its process is dead (the pidfd readable)
    and its connections are all closed and read: out of the holders of every
    generation its ledger says it holds, once every post connection has been read (a
    segment may be known only from a record still queued there); and it lets go of
    its memfds and files. A client whose connections all closed while its process
    lives (the broker dropped them) stays known, ledger and holds kept, until it
    reconnects (same token: it is the same client again) or dies. One that said K is
    done with at its last close (it counts itself out; its memfds and files are let
    go of). Where a pidfd cannot be had (a kernel before 5.3), a client is counted out
    at its last close.

    What a broker killed keeps, and what it loses. Kept: every
    header (in the segments), every ledger (its process's memfd, posted again on
    its next connection), every memfd and file a live owner keeps (it brings them
    to the new broker when it connects: ``transfer._bring_back``), so every hold is
    counted out exactly at its holder's death. Lost: the messages in flight at that
    moment whose bytes only it kept: under ``file_system`` refs to files its
    directory took with it (unless the receiver maps them already: the new broker
    gets their owner's descriptor, for the headers only); under
    ``file_descriptor`` refs to a memfd the receiver does not map yet whose owner
    died, or has not connected to the new broker yet (its fetch is refused,
    stale); a memfd torch shared itself, until its depositor sends it again. A
    sender sees its post connection's hang-up at its next message
    (``tests/test_broker_kills.py``).

    What keeps a segment (the rule every timer follows: a timer frees only
    what no message or holder can reach any more). A memfd or file is kept while its
    maker uses it (deposited with ``h``, or held: in its pool); then, nobody using
    it (``Broker._reach``), while a process holds its generation (the header's
    holders, each counted out at its death from its ledger: a receiver may forward
    what an exited maker made), or while refs sent in its
    generation are not all loaded and one of their senders lives (its maker, a
    forwarder that deposited it with ``f``: a generation retired by a fork keeps
    its queued messages however long they wait), or ``$SHMREDUCE_ORPHAN_TTL``
    seconds (default 60) after the last such sender died: a receiver can read what
    an exited sender put, and a program whose workers come and go does not keep
    their unread messages for its whole life. Else it is closed or unlinked at once:
    a relay's deposits of what exited producers made go once loaded and dropped
    as any other. A storage torch moved for shmreduce (a torch without
    ``_swap_data_ptr_``: torch's own memfd, which shmreduce cannot lay out) gets its
    header past its last page (deposited with ``t``): refs to it
    draw tickets and count sent and loaded there, and receivers hold it there, as in
    a pooled generation (generation 0, never reused). Every process that sends refs
    in it uses it while its storages of it live (its maker, and a receiver that sends
    it on, whose descriptor the broker then keeps), lets go of it (X) when they died,
    and it then follows the rule above. A memfd without any header (a storage torch shared for
    the user) is the one exception to that rule: nothing counts its refs in flight,
    so it is kept while its depositor lives (as a pooled segment's messages wait for
    their sender) and ORPHAN_TTL after its death; a ref to it that waits longer is
    stale. A process that received one and sends it on (``g``) is no user of it:
    each such deposit keeps it at least ORPHAN_TTL from then, not for the
    forwarder's life.
    A hold that is never counted out (its process died while no broker ran) keeps its
    segment at the broker until the program's root exits. The broker exits once it
    has had no client for GRACE seconds and either keeps nothing draining or the
    program's root process is gone; on exit it closes every descriptor and removes
    the program directory. One that stays when its last client leaves logs (DEBUG)
    the segments it stays for, with their headers.

Failures
    Any bad record, failed handshake or I/O error costs only the connection it came
    on, never the broker, and leaves a line in the broker's log: the stderr of the
    process that started the broker (as ``multiprocessing``'s resource tracker warns
    on its parent's), or the file ``$SHMREDUCE_BROKER_LOG`` names, at
    ``$SHMREDUCE_LOG_LEVEL`` (default WARNING). WARNING only for what a user must act
    on (a refused connection, a protocol error, out of descriptors, a crash); a peer
    that went away mid-request, a client leaving and the lines above are DEBUG: a
    program stopped early writes nothing on its user's stderr. Clients log to
    ``logging.getLogger("shmreduce")``: a lost connection, a protocol error, a
    broker that restarted.

    What other processes of the user can do to the program's memory costs the broker
    nothing: a pooled memfd is sealed at its size (``F_SEAL_SHRINK | F_SEAL_GROW``),
    and a segment file truncated under its header (any process of the user can) makes
    the broker's header functions raise instead of a SIGBUS (``_native.guard_faults``):
    it logs a WARNING and treats the file as headerless; what was sent in it is lost.
    A connection that never completes its handshake keeps the broker only while the
    program's root process lives.
"""

from __future__ import annotations

import array
import errno
import hashlib
import hmac
import os
import re
import socket
import stat
import struct

SOCKET_NAME = "broker.sock"
LOCK_NAME = "broker.lock"
MARKER_NAME = "shmreduce.program"
DIR_PREFIX = "shmreduce-"
SEG_PREFIX = "seg-"
STATUS_FD = 3  # the launcher's end of the starter's status socket (server.py, "Launch handshake")

MAGIC = b"SHMREDUCE1"
NONCE_LEN = 32
KEY_LEN = 16
HEADER_LEN = 1 + KEY_LEN
MAX_RECORD = 1 << 17
MAX_FDS = 250
# Descriptors a fetch reply brings at most (the one asked for and those deposited after
# it with it): what a receiver holds at once, before it maps and closes them, is bounded
# well below any descriptor limit.
FETCHED_FDS = 64
# File names per record: 2000 of 29 bytes is ~58 KB, under MAX_RECORD.
NAMES_PER_RECORD = 2000
HANDSHAKE_TIMEOUT = 5.0
TOKEN_LEN = 16
ROLE_REQUEST = b"q"
ROLE_POST = b"o"

SEGMENT = b"S"
SEG_MADE = b"h"  # a segment record's body: a pooled segment this process made
SEG_TORCH = b"-"  # a storage torch shared itself (no header)
SEG_FORWARDED = b"f"  # a pooled segment this process received and sends on
SEG_TORCH_FORWARDED = b"g"  # a storage torch shared that this process received and sends on (no header)
SEG_TRAILED = b"t"  # a storage torch moved for shmreduce: its header in the memfd's last HEADER_BYTES
# A memfd's segment record by (where its header lies, forwarded): "lead" (a pooled
# segment's first HEADER_BYTES), "trail" (past a storage torch moved: whoever sends
# refs in one uses it, a receiver too), "" (none).
SEG_KINDS = {
    ("lead", False): SEG_MADE,
    ("lead", True): SEG_FORWARDED,
    ("trail", False): SEG_TRAILED,
    ("", False): SEG_TORCH,
    ("", True): SEG_TORCH_FORWARDED,
}
SEG_KIND_OF = {kind: place for place, kind in SEG_KINDS.items()}
SEG_FILE = b"n"  # then a file's name: a file of this process's pool gone with a dead broker
DEPOSITED = b"s"
DROP = b"X"
FETCH = b"F"
FETCHED = b"f"
HOLD = b"H"
RELEASE = b"R"
LEDGER = b"L"
KEEP = b"K"
PING = b"P"
PING_FULL = b"full"  # a ping's body: the costly counters too
PONG = b"p"

INOS_PER_RECORD = 4000

STATUS_OK = 0
STATUS_UNKNOWN = 1
STATUS_LOST = 2
_FETCH_HEAD = struct.Struct("!BI")
_PID = struct.Struct("!I")
NO_KEY = bytes(KEY_LEN)


class ProtocolError(Exception):
    """The peer broke the protocol or failed authentication."""


class DescriptorsDropped(OSError):
    """A record arrived without its descriptors: this process is at its descriptor
    limit (MSG_CTRUNC). ``record`` is the record, its descriptor list empty."""

    def __init__(self, record: tuple[bytes, bytes, bytes, list[int]]) -> None:
        super().__init__(errno.EMFILE, "descriptors dropped by the kernel (MSG_CTRUNC)")
        self.record = record


_SEGMENT_NAME = re.compile(SEG_PREFIX + "[0-9a-f]{24}")
_NAME_LIST = re.compile(rb"(?:seg-[0-9a-f]{24})(?:\nseg-[0-9a-f]{24})*")
_INO_LIST = re.compile(rb"[0-9]{1,39}(?:\n[0-9]{1,39})*")


def is_segment_name(name: str) -> bool:
    return _SEGMENT_NAME.fullmatch(name) is not None


def is_program_dir(path: str, base: str | None = None) -> bool:
    """True if *path* is a program directory shmreduce made for this user.

    Named ``shmreduce-*`` (directly in *base*, if given), a real directory (not a
    symlink) owned by this uid with mode 0700, holding the marker file. Nothing
    else is ever used by a broker, swept or removed, whatever its name.
    """
    if not os.path.basename(path).startswith(DIR_PREFIX):
        return False
    if base is not None and os.path.dirname(path) != base:
        return False
    try:
        st = os.lstat(path)
        marker = os.lstat(os.path.join(path, MARKER_NAME))
    except OSError:
        return False
    uid = os.getuid()
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == uid
        and stat.S_IMODE(st.st_mode) == 0o700
        and stat.S_ISREG(marker.st_mode)
        and marker.st_uid == uid
    )


def encode_names(names) -> bytes:
    return "\n".join(names).encode("ascii")


def decode_names(blob: bytes) -> list[str]:
    if not blob:
        return []
    if _NAME_LIST.fullmatch(blob) is None:
        raise ProtocolError(f"bad segment names {blob[:80]!r}")
    return blob.decode("ascii").split("\n")


def identity(st: os.stat_result) -> int:
    """A memfd's identity, as refs, deposits, fetches and ledgers name it: its device
    and inode (``st_dev << 64 | st_ino``): a memfd and a ``/dev/shm`` file torch shared
    may have the same inode number on two devices."""
    return st.st_dev << 64 | st.st_ino


def encode_inos(inos) -> bytes:
    return b"\n".join(b"%d" % ino for ino in inos)


def decode_inos(blob: bytes) -> list[int]:
    """Inodes of memfds; raises ProtocolError if malformed."""
    if _INO_LIST.fullmatch(blob) is None:
        raise ProtocolError(f"bad inodes {blob[:80]!r}")
    return [int(i) for i in blob.split(b"\n")]


# A ledger entry: the generation (its low 64 bits, as a header holds it), the memfd's
# identity (``segments.identity``: device << 64 | inode, as two u64, low first; 0 for a
# file), the file's name (``seg-`` and 24 hex digits, as 12 bytes; zeros for a memfd),
# and its state (u32, written alone: a 4-byte aligned store): FREE, TAKING (written
# before the header counts the hold), HELD (after), DROPPING (before the header
# counts the let-go; FREE after). See Lifetimes for what the broker does with each.
LEDGER_ENTRY = struct.Struct("<QQQ12sI")
LEDGER_STATE_AT = 36  # the state's offset in an entry
LEDGER_STATE = struct.Struct("<I")
FREE, HELD, TAKING, DROPPING = 0, 1, 2, 3
LEDGER_MIN = 1024 * LEDGER_ENTRY.size  # a new ledger's size; it doubles when full
LEDGER_MAX = 64 << 20  # what a broker reads of one: 1.6 M entries
_U64 = 0xFFFFFFFFFFFFFFFF


def ledger_entry(key: int | str, gen: int, state: int = HELD) -> tuple[int, int, int, bytes, int]:
    """The fields of an entry in *state* for generation *gen* of the memfd (identity)
    or file (name) *key*."""
    if isinstance(key, str):
        return gen & _U64, 0, 0, bytes.fromhex(key[len(SEG_PREFIX) :]), state
    return gen & _U64, key & _U64, key >> 64, bytes(12), state


def ledger_holds(blob: bytes) -> list[tuple[int | str, int, int]]:
    """(segment, generation, state) of every entry of a ledger's bytes that is not
    FREE; whatever the bytes, a memfd's identity or a well-formed file name (others'
    are simply unknown)."""
    end = min(len(blob), LEDGER_MAX)
    end -= end % LEDGER_ENTRY.size
    held: list[tuple[int | str, int, int]] = []
    for gen, lo, hi, name, state in LEDGER_ENTRY.iter_unpack(memoryview(blob)[:end]):
        if state in (HELD, TAKING, DROPPING):
            held.append((lo | hi << 64 if lo or hi else SEG_PREFIX + name.hex(), gen, state))
    return held


def encode_fetched(status: int, others: list[int]) -> bytes:
    """A fetch's reply: its status and, when found, the inodes of the memfds whose
    descriptors follow the one asked for (deposited with it)."""
    total = 1 + len(others) if status == STATUS_OK else 0
    return _FETCH_HEAD.pack(status, total) + (encode_inos(others) if others else b"")


def decode_fetched(body: bytes) -> tuple[int, int, list[int]]:
    """(status, total fds, the inodes of all but the first); raises ProtocolError if
    malformed."""
    try:
        status, total = _FETCH_HEAD.unpack_from(body)
    except struct.error as exc:
        raise ProtocolError(f"bad fetch reply: {exc}") from None
    rest = body[_FETCH_HEAD.size :]
    others = decode_inos(rest) if rest else []
    if total and len(others) != total - 1:
        raise ProtocolError(f"a fetch reply of {total} descriptors names {len(others)} others")
    return status, total, others


# -- records -----------------------------------------------------------------------

_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # plain ints: the enum's __and__ is Python code
_MSG_TRUNC = int(socket.MSG_TRUNC)


def send_record(sock: socket.socket, op: bytes, key: bytes, body: bytes = b"", fds=()) -> None:
    data = op + key + body
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sock.sendmsg([data], anc)
    else:
        sock.sendall(data)


def recv_record(sock: socket.socket, flags: int = 0, buf: bytearray | None = None) -> tuple[bytes, bytes, bytes, list[int]] | None:
    """One record as (op, key, body, fds), or None at end of stream.

    *buf*: MAX_RECORD bytes to receive into, reused from call to call (the broker's:
    a fresh MAX_RECORD-byte buffer is an mmap and munmap per call, the EAGAIN that
    ends a read included). Every descriptor received is returned (or closed before
    raising): the caller owns them. Raises DescriptorsDropped (an OSError(EMFILE))
    if the kernel had to drop descriptors because this process is at its descriptor
    limit.
    """
    if buf is None:
        data, anc, msg_flags, _addr = sock.recvmsg(MAX_RECORD, _ANC_SPACE, flags)
    else:
        size, anc, msg_flags, _addr = sock.recvmsg_into([buf], _ANC_SPACE, flags)
        data = bytes(memoryview(buf)[:size])
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - (len(payload) % arr.itemsize)])
            fds.extend(arr)
    if msg_flags & (_MSG_CTRUNC | _MSG_TRUNC) or len(data) < HEADER_LEN:
        for fd in fds:
            os.close(fd)
        if not data:
            return None
        if msg_flags & _MSG_TRUNC:
            raise ProtocolError(f"record larger than {MAX_RECORD} bytes")
        if len(data) < HEADER_LEN:
            raise ProtocolError(f"truncated record of {len(data)} bytes")
        raise DescriptorsDropped((data[:1], data[1:HEADER_LEN], data[HEADER_LEN:], []))
    return data[:1], data[1:HEADER_LEN], data[HEADER_LEN:], fds


# -- handshake ---------------------------------------------------------------------


def _digest(authkey: bytes, nonce: bytes) -> bytes:
    return hmac.new(authkey, nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size)
    if len(data) != size:
        raise ProtocolError("handshake cut short")
    return data


HANDSHAKE_ANSWER_LEN = 32 + NONCE_LEN + 1 + TOKEN_LEN


def handshake_hello() -> tuple[bytes, bytes]:
    """The broker's first step: (nonce_b, the record to send)."""
    nonce_b = os.urandom(NONCE_LEN)
    return nonce_b, MAGIC + nonce_b


def handshake_reply(authkey: bytes, nonce_b: bytes, answer: bytes) -> tuple[bytes, bytes, bytes]:
    """The broker's second step, on the client's answer record: (role, process token,
    the record to send back); raises ProtocolError if the client failed."""
    if len(answer) != HANDSHAKE_ANSWER_LEN:
        raise ProtocolError("handshake cut short")
    if not hmac.compare_digest(answer[:32], _digest(authkey, nonce_b)):
        raise ProtocolError("client failed authentication")
    nonce_c = answer[32 : 32 + NONCE_LEN]
    role, token = answer[32 + NONCE_LEN : 33 + NONCE_LEN], answer[33 + NONCE_LEN :]
    if role not in (ROLE_REQUEST, ROLE_POST):
        raise ProtocolError(f"unknown connection role {role!r}")
    return role, token, _digest(authkey, nonce_c) + _PID.pack(os.getpid())


def client_handshake(sock: socket.socket, authkey: bytes, role: bytes = ROLE_REQUEST, token: bytes = bytes(TOKEN_LEN)) -> int:
    """Authenticate both ways, as *role* of the process identified by *token*; return
    the broker's pid."""
    hello = _recv_exact(sock, len(MAGIC) + NONCE_LEN)
    if not hello.startswith(MAGIC):
        raise ProtocolError("not a shmreduce broker")
    nonce_c = os.urandom(NONCE_LEN)
    sock.sendall(_digest(authkey, hello[len(MAGIC) :]) + nonce_c + role + token)
    reply = sock.recv(32 + _PID.size)
    if len(reply) != 32 + _PID.size:
        raise ProtocolError("broker refused the authkey")
    if not hmac.compare_digest(reply[:32], _digest(authkey, nonce_c)):
        raise ProtocolError("broker failed authentication")
    return _PID.unpack(reply[32:])[0]
