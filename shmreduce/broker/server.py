"""The broker process: holds descriptors and segment names between processes.

stdlib only, never imports torch. Started by ``client.start_broker`` as
``python -m shmreduce.broker.server DIR ROOT_PID`` with the authkey on stdin. The
protocol and the lifetimes it guarantees are documented in ``protocol.py``.

Process layout: the launcher creates the program directory, takes its lock, binds
and listens, then double-forks and exits (so the caller is never left with a
zombie and knows the socket is listening when it returns). The grandchild is the
*janitor*: it forks the *server*, waits for it, and removes the program directory
whatever way the server ended, SIGKILL included.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import shutil
import signal
import socket
import sys
import time

from shmreduce.broker import protocol as P

STALE_MIN_AGE = 10.0  # seconds; a younger directory may be a broker still starting
GRACE = float(os.environ.get("SHMREDUCE_BROKER_GRACE", "1.0"))


class _Client:
    """One client process: the names it holds, across its connections."""

    __slots__ = ("token", "holds", "conns")

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.holds: set[str] = set()
        self.conns = 0


class _Conn:
    __slots__ = ("sock", "fd", "client", "post", "last_post")

    def __init__(self, sock: socket.socket, client: _Client, post: bool) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.client = client
        self.post = post
        self.last_post = 0.0  # when a record was last read from this post connection


class _Message:
    __slots__ = ("fds", "names", "sender", "offered", "nbytes")

    def __init__(self, sender: bytes) -> None:
        self.fds: list[int] = []
        self.names: list[str] = []
        self.nbytes = 0  # memory behind its fds, as its sender declared it
        self.sender = sender  # the depositing client's token
        self.offered = False  # a copy of its fds went to a client as an offer

    def close(self) -> None:
        """Close the broker's copies of its descriptors (given away or dropped)."""
        for fd in self.fds:
            os.close(fd)


_POST_EVENTS = select.EPOLLIN | select.EPOLLONESHOT
EARLY_CLAIM_TTL = 30.0  # seconds a claim that arrived before its deposit is remembered


class Broker:
    def __init__(self, directory: str, listener: socket.socket, authkey: bytes, root_pid: int) -> None:
        self.dir = directory
        self.listener = listener
        self.authkey = authkey
        self.uid = os.getuid()
        self.conns: dict[int, _Conn] = {}
        self.clients: dict[bytes, _Client] = {}
        self.messages: dict[bytes, _Message] = {}
        # Per sender token: its undelivered messages in deposit order, and which
        # client fetched its last messages (token, how many in a row): see offers
        # in protocol.py.
        self.pending: dict[bytes, dict[bytes, None]] = {}
        self.streaks: dict[bytes, tuple[bytes, int]] = {}
        self.refs: dict[str, int] = {}
        self.parked: list[tuple[float, _Conn, bytes]] = []
        self.early_claims: dict[bytes, tuple[float, _Client]] = {}
        # Post connections are armed one-shot: the first record after a quiet spell
        # wakes the broker; then the connection "cools": it is read in one batch at
        # the end of every POST_WINDOW, and armed again only once it has stayed
        # quiet for POST_QUIET. A busy sender's records then never wake the broker,
        # which matters because such a wake puts the broker on the sender's CPU
        # (a sync wakeup): behind a sender that computes, it would answer the next
        # fetch only at the sender's next preemption, milliseconds later.
        self.cooling: set[int] = set()
        self.cool_until: float | None = None
        self.draining = False
        self.poller = select.epoll()
        self.poller.register(listener.fileno(), select.EPOLLIN)
        self.root_alive = True
        self.root_fd = -1
        try:
            self.root_fd = os.pidfd_open(root_pid)
            self.poller.register(self.root_fd, select.EPOLLIN)
        except (OSError, AttributeError):
            self.root_alive = _pid_alive(root_pid)
        self.idle_since: float | None = time.monotonic()
        self.stopping = False

    # -- bookkeeping -----------------------------------------------------------

    def _incref(self, name: str) -> None:
        self.refs[name] = self.refs.get(name, 0) + 1

    def _decref(self, name: str) -> None:
        count = self.refs.get(name, 0) - 1
        if count > 0:
            self.refs[name] = count
            return
        self.refs.pop(name, None)
        try:
            os.unlink(os.path.join(self.dir, name))
        except FileNotFoundError:
            pass

    def _hold(self, client: _Client, names) -> None:
        for name in names:
            if name not in client.holds:
                client.holds.add(name)
                self._incref(name)

    def _release(self, client: _Client, names) -> None:
        for name in names:
            if name in client.holds:
                client.holds.discard(name)
                self._decref(name)

    def _give_names(self, client: _Client, msg: _Message) -> None:
        """The message's in-flight names become *client*'s (dropped if it is gone)."""
        if client.conns:
            self._hold(client, msg.names)
        for name in msg.names:
            self._decref(name)
        msg.names = []

    def counters(self) -> dict:
        return {
            "pid": os.getpid(),
            "clients": len(self.clients),
            "connections": len(self.conns),
            "messages": len(self.messages),
            "message_fds": sum(len(m.fds) for m in self.messages.values()),
            "segment_files": len(self.refs),
            "root_alive": self.root_alive,
        }

    # -- connections -----------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        try:
            sock.settimeout(P.HANDSHAKE_TIMEOUT)
            from shmreduce._platform import peer_uid

            if peer_uid(sock) != self.uid:
                raise P.ProtocolError("peer runs as another user")
            role, token = P.serve_handshake(sock, self.authkey)
            # Non-blocking from now on: the loop drains whatever a client has queued,
            # and a client that stops reading its replies is dropped, never waited on.
            sock.setblocking(False)
        except (OSError, P.ProtocolError):
            sock.close()
            return
        client = self.clients.get(token)
        if client is None:
            client = self.clients[token] = _Client(token)
        client.conns += 1
        conn = _Conn(sock, client, role == P.ROLE_POST)
        self.conns[conn.fd] = conn
        self.poller.register(conn.fd, _POST_EVENTS if conn.post else select.EPOLLIN)
        self.idle_since = None

    def _drop(self, conn: _Conn) -> None:
        if self.conns.pop(conn.fd, None) is None:
            return
        self.poller.unregister(conn.fd)
        self.cooling.discard(conn.fd)
        self.parked = [p for p in self.parked if p[1] is not conn]
        conn.sock.close()
        client = conn.client
        client.conns -= 1
        if not client.conns:
            self.clients.pop(client.token, None)
            self.streaks.pop(client.token, None)
            self._release(client, list(client.holds))
        if not self.conns:
            self.idle_since = time.monotonic()

    def _serve(self, conn: _Conn) -> int:
        """Handle every record *conn* has queued; return how many (-1: conn dropped).

        A request connection has at most one record queued (its client waits for each
        reply), so it is read once: level-triggered epoll reports anything more.
        """
        count = 0
        while not count or conn.post:
            try:
                record = P.recv_record(conn.sock)
            except BlockingIOError:
                return count
            except (OSError, P.ProtocolError):
                record = None
            if record is None:
                self._drop(conn)
                return -1
            if not self._handle(conn, *record):
                return -1
            count += 1
        return count

    def _drain_posts(self) -> None:
        """Read every post connection now: a barrier for what clients sent before."""
        if self.draining:
            return
        self.draining = True
        try:
            now = time.monotonic()
            for conn in [c for c in self.conns.values() if c.post]:
                if self._serve(conn) > 0:
                    # An active sender: its connection cools (disarmed) like one that
                    # woke the broker, so that its next records do not wake it.
                    if conn.fd not in self.cooling:
                        self.poller.modify(conn.fd, 0)
                    self._cool(conn, now)
        finally:
            self.draining = False

    def _cool(self, conn: _Conn, now: float) -> None:
        conn.last_post = now
        self.cooling.add(conn.fd)
        if self.cool_until is None:
            self.cool_until = now + P.POST_WINDOW

    def _end_window(self, now: float) -> None:
        """Read the cooling connections; re-arm those quiet for POST_QUIET."""
        self.cool_until = None
        for fd in list(self.cooling):
            conn = self.conns.get(fd)
            if conn is None:
                self.cooling.discard(fd)
                continue
            got = self._serve(conn)
            if got > 0:
                conn.last_post = now
            elif got == 0 and now - conn.last_post >= P.POST_QUIET:
                self.cooling.discard(fd)
                self.poller.modify(fd, _POST_EVENTS)
        if self.cooling:
            self.cool_until = now + P.POST_WINDOW

    def _handle(self, conn: _Conn, op: bytes, key: bytes, body: bytes, fds: list[int]) -> bool:
        """One record; False if the connection was dropped."""
        client = conn.client
        try:
            if op == P.DEPOSIT:
                holds, inflight, nbytes = P.decode_deposit(body)
                self._hold(client, holds)
                if fds or inflight:
                    self._deposit(client, key, fds, inflight, nbytes)
                    fds = []
            elif op == P.CLAIM:
                if key in self.messages:
                    self._claim(client, key)
                else:
                    self.early_claims[key] = (time.monotonic() + EARLY_CLAIM_TTL, client)
            elif op == P.TAKE:
                msg = self.messages.get(key)
                if msg is not None and msg.offered:
                    self._remove(key)
                    self._give_names(client, msg)
                    msg.close()
            elif op == P.FETCH:
                msg = self.messages.get(key)
                if msg is None or msg.offered:
                    # Its deposit (or the take of an offered copy) may still be
                    # queued on a post connection.
                    self._drain_posts()
                if key in self.messages:
                    self._reply_fetch(conn, key)
                else:
                    self.parked.append((time.monotonic() + P.FETCH_WAIT, conn, key))
            elif op == P.HOLD:
                self._hold(client, P.decode_names(body))
            elif op == P.RELEASE:
                self._release(client, P.decode_names(body))
            elif op == P.PING:
                self._drain_posts()
                P.send_record(conn.sock, P.PONG, P.NO_KEY, json.dumps(self.counters()).encode())
            else:
                raise P.ProtocolError(f"unknown op {op!r}")
            return True
        except (OSError, P.ProtocolError):
            for fd in fds:
                os.close(fd)
            self._drop(conn)
            return False

    def _deposit(self, client: _Client, key: bytes, fds: list[int], inflight: list[str], nbytes: int) -> None:
        msg = self.messages.get(key)
        if msg is None:
            msg = self.messages[key] = _Message(client.token)
            self.pending.setdefault(client.token, {})[key] = None
        msg.fds.extend(fds)
        msg.nbytes += nbytes
        for name in inflight:
            self._incref(name)
        msg.names.extend(inflight)
        early = self.early_claims.pop(key, None) if self.early_claims else None
        if early is not None:
            self._claim(early[1], key)
        if self.parked and key in self.messages:
            self._answer_parked(key)

    def _claim(self, client: _Client, key: bytes) -> None:
        """The message's names become *client*'s; a message left without fds is done."""
        msg = self.messages[key]
        self._give_names(client, msg)
        if not msg.fds:
            self._remove(key)

    def _remove(self, key: bytes) -> _Message:
        msg = self.messages.pop(key)
        keys = self.pending.get(msg.sender)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self.pending[msg.sender]
        return msg

    def _offers(self, client: _Client, msg: _Message) -> list[tuple[bytes, _Message]]:
        """Other messages of *msg*'s sender to offer *client* with its reply (this
        fetch also counts toward the client's streak for that sender)."""
        fetcher, streak = self.streaks.get(msg.sender, (b"", 0))
        streak = streak + 1 if fetcher == client.token else 1
        self.streaks[msg.sender] = (client.token, streak)
        room = P.MAX_FDS - len(msg.fds)
        if streak < P.OFFER_STREAK or room <= 0:
            return []
        offers = []
        for key in self.pending.get(msg.sender, ()):
            other = self.messages[key]
            # Whole, small, descriptor-only messages (a single record: < MAX_FDS), once each.
            if other.offered or other.names or not other.fds:
                continue
            if len(other.fds) > room or other.nbytes > P.OFFER_BYTES:
                continue
            other.offered = True
            offers.append((key, other))
            room -= len(other.fds)
            if len(offers) == P.OFFER_MAX:
                break
        return offers

    def _reply_fetch(self, conn: _Conn, key: bytes) -> None:
        msg = self._remove(key)
        try:
            # The names become this client's before anything can fail, so that a
            # client dying mid-reply releases them through _drop.
            self._give_names(conn.client, msg)
            offers = self._offers(conn.client, msg)
            fds = msg.fds + [fd for _key, other in offers for fd in other.fds]
            head = P.encode_fetched(P.STATUS_OK, len(fds), [(k, len(other.fds)) for k, other in offers])
            chunks = [fds[i : i + P.MAX_FDS] for i in range(0, len(fds), P.MAX_FDS)] or [[]]
            for chunk in chunks:
                P.send_record(conn.sock, P.FETCHED, key, head, chunk)
        finally:
            msg.close()

    def _reply_unknown(self, conn: _Conn, key: bytes) -> None:
        P.send_record(conn.sock, P.FETCHED, key, P.encode_fetched(P.STATUS_UNKNOWN, 0))

    def _answer_parked(self, key: bytes) -> None:
        for entry in self.parked:
            if entry[2] == key:
                self.parked.remove(entry)
                try:
                    self._reply_fetch(entry[1], key)
                except OSError:
                    self._drop(entry[1])
                return

    def _expire(self, now: float) -> None:
        if self.early_claims:
            for key in [k for k, (until, _) in self.early_claims.items() if until <= now]:
                del self.early_claims[key]
        due = [p for p in self.parked if p[0] <= now]
        if not due:
            return
        self.parked = [p for p in self.parked if p[0] > now]
        for _deadline, conn, key in due:
            try:
                self._reply_unknown(conn, key)
            except OSError:
                self._drop(conn)

    # -- main loop -------------------------------------------------------------

    def _should_exit(self, now: float) -> bool:
        if self.stopping:
            return True
        if self.conns or self.idle_since is None:
            return False
        if self.messages and self.root_alive:
            return False
        return now - self.idle_since >= GRACE

    def run(self) -> None:
        listener, conns = self.listener.fileno(), self.conns
        while True:
            now = time.monotonic()
            if self._should_exit(now):
                break
            timeout = 0.25
            if self.parked:
                timeout = min(timeout, max(0.0, min(p[0] for p in self.parked) - now))
            if self.cool_until is not None:
                timeout = min(timeout, max(0.0, self.cool_until - now))
            for fd, _events in self.poller.poll(timeout):
                conn = conns.get(fd)
                if conn is not None:
                    if self._serve(conn) >= 0 and conn.post:
                        self._cool(conn, now)
                elif fd == listener:
                    self._accept()
                elif fd == self.root_fd:
                    self.root_alive = False
                    self.poller.unregister(self.root_fd)
                    os.close(self.root_fd)
                    self.root_fd = -1
                    if not conns:
                        self.idle_since = time.monotonic()
            now = time.monotonic()
            if self.cool_until is not None and now >= self.cool_until:
                self._end_window(now)
            if self.parked or self.early_claims:
                self._expire(now)

    def shutdown(self) -> None:
        for msg in self.messages.values():
            msg.close()
        self.messages.clear()
        for conn in list(self.conns.values()):
            conn.sock.close()
        self.listener.close()
        self.poller.close()
        remove_program_dir(self.dir)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_program_dir(directory: str) -> None:
    """Remove a program directory: segment files, socket, lock, the directory.

    It is first renamed away, atomically, so that a broker starting meanwhile for the
    same program makes a fresh directory and never loses files to this removal.
    """
    tomb = f"{directory}.gone-{os.getpid()}"
    try:
        os.rename(directory, tomb)
    except OSError:
        tomb = directory
    shutil.rmtree(tomb, ignore_errors=True)


def lock_is_free(directory: str) -> bool:
    """True if no live broker holds this program directory's lock."""
    try:
        fd = os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def sweep_stale(base: str, keep: str | None = None) -> list[str]:
    """Remove this user's program directories under *base* whose broker is dead."""
    removed: list[str] = []
    uid = os.getuid()
    try:
        entries = os.listdir(base)
    except OSError:
        return removed
    for entry in entries:
        path = os.path.join(base, entry)
        if not entry.startswith(P.DIR_PREFIX) or path == keep:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not os.path.isdir(path) or os.path.islink(path):
            continue
        if time.time() - st.st_mtime < STALE_MIN_AGE:
            continue  # maybe a launcher between its mkdir and its flock: not stale yet
        if lock_is_free(path):
            remove_program_dir(path)
            removed.append(path)
    return removed


def _make_private_dir(directory: str) -> None:
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if st.st_uid != os.getuid() or (st.st_mode & 0o077) or not os.path.isdir(directory) or os.path.islink(directory):
        raise SystemExit(f"shmreduce broker: {directory} is not a private directory of this user")


def launch(directory: str, root_pid: int, authkey: bytes) -> int:
    """Start a broker for *directory* unless one runs; return the exit status."""
    base = os.path.dirname(directory)
    _make_private_dir(directory)
    lock_fd = os.open(os.path.join(directory, P.LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return 0  # a live broker already serves this program
        raise
    sweep_stale(base, keep=directory)
    path = os.path.join(directory, P.SOCKET_NAME)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(128)

    if os.fork() != 0:
        return 0  # launcher: the socket listens; the caller may connect now
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    _janitor(directory, listener, authkey, root_pid, lock_fd)
    os._exit(0)


def _janitor(directory: str, listener: socket.socket, authkey: bytes, root_pid: int, lock_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.environ.get("SHMREDUCE_BROKER_LOG")
    errfd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if log else devnull
    for fd, target in ((0, devnull), (1, devnull), (2, errfd)):
        os.dup2(target, fd)
    for fd in {devnull, errfd}:
        os.close(fd)
    server = os.fork()
    if server == 0:
        signal.signal(signal.SIGTERM, lambda *_: setattr(broker, "stopping", True))
        from shmreduce._platform import raise_nofile_limit

        raise_nofile_limit()
        broker = Broker(directory, listener, authkey, root_pid)
        try:
            broker.run()
        finally:
            broker.shutdown()
        os._exit(0)
    listener.close()
    signal.signal(signal.SIGTERM, lambda *_: os.kill(server, signal.SIGTERM))
    while True:
        try:
            os.waitpid(server, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    remove_program_dir(directory)
    os.close(lock_fd)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m shmreduce.broker.server DIR ROOT_PID < authkey", file=sys.stderr)
        return 2
    authkey = sys.stdin.buffer.read()
    if not authkey:
        print("shmreduce broker: no authkey on stdin", file=sys.stderr)
        return 2
    return launch(os.path.abspath(argv[0]), int(argv[1]), authkey)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
