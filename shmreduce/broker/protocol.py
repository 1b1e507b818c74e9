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

Pools (``shmreduce/pool.py``)
    A sender keeps its segments (memfds, or files here) and fills them anew, in
    *generations*: a generation is a number unique in the program, its name here
    ``gen-<24 hex>`` (``gen_name``). The broker counts holds on generation names as
    on file names: its owner holds one from the first deposit that carries it (the
    deposit's *holds*) until its own last storage of it dies; every undelivered
    message holds the names of its storages; a receiver keeps, through the message
    that brought it, each generation (and file) whose storages it made anew, until
    its last storage of it dies (a release under that message's key; a receiver
    keeps its token of a generation that came in more than one message alive 0.25
    to 0.75 s after the last message in it, so that the next message finds it: see
    ``pool.LINGER``). When a generation's count reaches zero the broker posts a
    NOTICE to its owner (the first client that held the name), which reads it
    without waiting when it next needs a segment and reuses the segment. A file's
    count reaching zero unlinks it.

Transport
    AF_UNIX, SOCK_SEQPACKET: every ``sendmsg`` is one record, delivered whole and in
    order, with its descriptors (SCM_RIGHTS) attached to it. Each client process has
    two connections, one identity (a random token sent in the handshake):
    *post* (role ``o``) for the fire-and-forget records D, C, H, R, and *request*
    (role ``q``) for F and P, which get replies. The broker answers requests at once
    but reads post connections in batches: a post connection is armed one-shot, and
    after it fires the broker reads it every POST_WINDOW, arming it again only after
    POST_QUIET without records. Waking a process costs the waker ~20 us of CPU here,
    as much as sharing a small storage, so a deposit or claim must not cost one; and
    a wake from a sender that computes next would queue the broker behind it on the
    sender's CPU. A fetch or ping first reads every post connection if it needs to
    (a barrier: what any client posted before is seen). Every record posted before a
    close counts: a client that closes with records unread (free notices) makes Linux
    report ECONNRESET to the broker ahead of the records still queued, which the
    broker reads on. A forked child opens its own connections.

Handshake (once per connection; the broker also checks SO_PEERCRED uid == its own)
    The broker runs it inside its event loop, a step per record, never blocking: a
    connection that has not completed it within HANDSHAKE_TIMEOUT is closed.
    broker -> client   MAGIC + nonce_b (32 bytes)
    client -> broker   HMAC-SHA256(authkey, nonce_b) + nonce_c (32 bytes)
                       + role (1 byte) + process token (16 bytes)
    broker -> client   HMAC-SHA256(authkey, nonce_c) + broker pid (u32)
    The authkey is the program's ``multiprocessing`` authkey; either side closes the
    connection on a wrong digest.

Records after the handshake: ``op (1 byte) + key (16 bytes) + body``, at most
MAX_RECORD bytes
    D  deposit   key = message key. body = holds "|" inflight "|" nbytes "|" last:
                 two "\\n"-joined lists of names (files, generations), the bytes of the
                 descriptors attached (ASCII decimal, at most 20 digits) and "1" on
                 the deposit's last record, else "0". A deposit is as many records
                 as it takes for each to carry at most MAX_FDS descriptors and
                 NAMES_PER_RECORD names of each list, all with the same key; the
                 broker delivers the message (fetch, claim) only once its last
                 record is in, and drops it if its sender's connections close
                 before. Descriptors attached are the message's, by slot: one per
                 file_descriptor segment its storages lie in. The broker
                 holds one descriptor per file (memfd) however many undelivered
                 messages name it, counted by those messages: a sender far ahead
                 of its receivers, its messages in a few slabs, costs the broker a
                 few descriptors, not one per message. Names in
                 *inflight* get one reference owned by the message; names in
                 *holds* get one reference owned by this client. No reply. A record
                 whose descriptors the kernel dropped (the broker at its descriptor
                 limit) makes the message *lost*: a fetch of it gets status 2.
    C  claim     key = message key. The message reached this client, which keeps
                 the names listed. body = flag + names: flag "d" (done): its
                 descriptors are closed (fetched, or not needed: the receiver maps
                 every segment already) and the names not kept go; flag "p": it may
                 still fetch them and claim more (a load with no end in sight, e.g.
                 spawn's process object). Kept names stay with the message, bound to
                 this client, until released under its key or until the client's
                 connections all close. A claim from another client than the first
                 receiver (bytes loaded twice) changes nothing. A claim read before
                 its deposit is complete is remembered for EARLY_CLAIM_TTL; one
                 client's claims read before then add up, and its releases under
                 the key undo them, as if read after. No reply.
    F  fetch     key = message key. The broker removes the message and replies with
                 one or more ``f`` records: body = status (u8) + total fds (u32);
                 the descriptors ride on them, at most MAX_FDS a record. The message
                 is delivered to the fetching client; its names wait for its claim.
                 status 0 = ok, 1 = unknown key, 2 = lost (the broker could not take
                 its descriptors). A fetch first reads every queued post record;
                 one for a key not yet (wholly) deposited waits up to FETCH_WAIT
                 seconds. A receiver fetches only for a segment it does not map yet:
                 a sender fills and reuses its segments, so a steady receiver fetches
                 once per segment, not once per message.
    H  hold      key = NO_KEY, body = names; this client holds each name once. The
                 first holder of a generation name is its owner. No reply.
    R  release   body = names. key = NO_KEY: this client no longer holds them;
                 key = a message key: it lets go of names it kept through that
                 message (a message no name is left in is forgotten). No reply.
    P  ping      reply ``p`` with body = JSON of the broker's counters (notices
                 due are posted first: a barrier for them too).
    N  notice    broker -> owner, on its post connection: body = generation names
                 nobody holds any more. The owner reads them without waiting.

Lifetimes
    A segment file is unlinked, and a generation's owner notified, when no client
    holds it and no message holds it. A client whose connections have all closed
    (its process exited or was killed) drops its holds and what it kept through
    messages; its undelivered messages stay for
    ``$SHMREDUCE_ORPHAN_TTL`` seconds (default 60), so a receiver can read what an
    exited sender put, and are then dropped (with a DEBUG line): a program whose
    workers come and go does not keep their unread messages for its whole life. The
    broker exits once it has had no client for GRACE seconds and either holds no
    undelivered message or the program's root process is gone; on exit it closes
    every descriptor and removes the program directory. One that stays when its
    last client leaves logs (DEBUG) what it still holds: each message (key, sender, state,
    names) and each name with its holders.

Failures
    Any bad record, failed handshake or I/O error costs only the connection it came
    on, never the broker, and leaves a line in the broker's log: the stderr of the
    process that started the broker (as ``multiprocessing``'s resource tracker warns
    on its parent's), or the file ``$SHMREDUCE_BROKER_LOG`` names, at
    ``$SHMREDUCE_LOG_LEVEL`` (default WARNING). WARNING only for what a user must act
    on (a refused connection, a protocol error, out of descriptors, a crash); a peer
    that went away mid-request, a client leaving and the lines above are DEBUG: a
    program stopped early writes nothing on its user's stderr (SPEC 13). Clients log to
    ``logging.getLogger("shmreduce")``: a lost connection, a protocol error, a
    broker that restarted.
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
GEN_PREFIX = "gen-"

MAGIC = b"SHMREDUCE1"
NONCE_LEN = 32
KEY_LEN = 16
HEADER_LEN = 1 + KEY_LEN
MAX_RECORD = 1 << 17
MAX_FDS = 250
# Names of each list per record: a deposit of two full lists (29 bytes a name) is
# ~116 KB, under MAX_RECORD.
NAMES_PER_RECORD = 2000
MAX_NBYTES_DIGITS = 20
FETCH_WAIT = 2.0
HANDSHAKE_TIMEOUT = 5.0
TOKEN_LEN = 16
ROLE_REQUEST = b"q"
ROLE_POST = b"o"
POST_WINDOW = 0.002  # seconds the broker lets post records queue up before reading them
POST_QUIET = 0.05  # seconds a post connection must stay quiet before a record wakes the broker again

SEGMENT = b"S"
DROP = b"X"
FETCH = b"F"
FETCHED = b"f"
HOLD = b"H"
RELEASE = b"R"
GENS = b"G"
UNGENS = b"U"
PING = b"P"
PONG = b"p"

HEADER_BYTES = 64  # a pooled segment's header: generation, sent, loaded, holders (u64 each)
INOS_PER_RECORD = 4000
GENS_PER_RECORD = 2000

STATUS_OK = 0
STATUS_UNKNOWN = 1
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
_INO_LIST = re.compile(rb"[0-9]{1,20}(?:\n[0-9]{1,20})*")
_GEN_LIST = re.compile(rb"(?:(?:[0-9]{1,20}|seg-[0-9a-f]{24}) [0-9a-f]{1,24})(?:\n(?:[0-9]{1,20}|seg-[0-9a-f]{24}) [0-9a-f]{1,24})*")


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


def encode_inos(inos) -> bytes:
    return b"\n".join(b"%d" % ino for ino in inos)


def decode_inos(blob: bytes) -> list[int]:
    """Inodes of memfds; raises ProtocolError if malformed."""
    if _INO_LIST.fullmatch(blob) is None:
        raise ProtocolError(f"bad inodes {blob[:80]!r}")
    return [int(i) for i in blob.split(b"\n")]


def encode_gens(gens) -> bytes:
    """(segment, generation) pairs: a memfd's inode or a file's name, and a generation."""
    return "\n".join(f"{key} {gen & 0xFFFFFFFFFFFFFFFF:x}" for key, gen in gens).encode("ascii")


def decode_gens(blob: bytes) -> list[tuple[int | str, int]]:
    """(segment, generation) pairs; raises ProtocolError if malformed."""
    if _GEN_LIST.fullmatch(blob) is None:
        raise ProtocolError(f"bad generations {blob[:80]!r}")
    pairs: list[tuple[int | str, int]] = []
    for line in blob.decode("ascii").split("\n"):
        key, gen = line.split(" ")
        pairs.append((key if key.startswith(SEG_PREFIX) else int(key), int(gen, 16)))
    return pairs


def encode_fetched(status: int, total: int) -> bytes:
    return _FETCH_HEAD.pack(status, total)


def decode_fetched(body: bytes) -> tuple[int, int]:
    """(status, total fds); raises ProtocolError if malformed."""
    try:
        status, total = _FETCH_HEAD.unpack(body)
    except struct.error as exc:
        raise ProtocolError(f"bad fetch reply: {exc}") from None
    return status, total


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


def recv_record(sock: socket.socket, flags: int = 0) -> tuple[bytes, bytes, bytes, list[int]] | None:
    """One record as (op, key, body, fds), or None at end of stream.

    Every descriptor received is returned (or closed before raising): the caller owns
    them. Raises DescriptorsDropped (an OSError(EMFILE)) if the kernel had to drop
    descriptors because this process is at its descriptor limit.
    """
    data, anc, msg_flags, _addr = sock.recvmsg(MAX_RECORD, _ANC_SPACE, flags)
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
