"""The broker process: holds descriptors and segment names between processes.

stdlib only, never imports torch. Started by ``client.start_broker`` as
``python -m shmreduce.broker.server DIR ROOT_PID`` with its *status socket* on
descriptor 3 (``STATUS_FD``). The protocol and the lifetimes it guarantees are
documented in ``protocol.py``.

Launch handshake (issue 19, item 3). A fork of the starter may happen at any
moment of a launch (a DataLoader worker, a Pool) and its child inherits every
descriptor the launch has open, close-on-exec or not: so no step waits for an end
of file, and every wait has a deadline. The starter sends the authkey as one
SOCK_SEQPACKET record on the status socket; the launcher reads that one record
(bounded by START_WAIT) and answers with one record, ``ok`` once a broker listens
on DIR (its own or one that runs already), or ``error: why``. Nothing else of the
launch is a pipe.

Process layout: the launcher takes the program directory's lock (making the
directory if need be), binds and listens, then double-forks and exits (so the
caller is never left with a zombie and knows the socket is listening when it
returns). The grandchild is the *janitor*: it forks the *server*, waits for it, and
removes the program directory whatever way the server ended, SIGKILL included,
before it lets go of the lock: a lock is the directory's only while its file is the
one at the directory's path (``_lock_program_dir``), so one broker at most serves a
program directory, however launchers and a dying janitor interleave (issue 19,
item 4). The launcher's stdout is the starter's stderr: the server logs there (or
to ``$SHMREDUCE_BROKER_LOG``).

Also owns the one sweep of stale program directories (``sweep_stale``), used by
every launcher and by ``python -m shmreduce cleanup``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import time

from shmreduce._platform import peer_pid, peer_uid, raise_nofile_limit
from shmreduce.broker import protocol as P

STALE_MIN_AGE = 10.0  # seconds; a younger directory may be a broker still starting
GRACE = float(os.environ.get("SHMREDUCE_BROKER_GRACE", "1.0"))
ORPHAN_TTL = float(os.environ.get("SHMREDUCE_ORPHAN_TTL", "60"))  # see Lifetimes in protocol.py

log = logging.getLogger("shmreduce.broker")


class _Client:
    """One client process: the names it holds, the messages it received and keeps
    names of, across its connections."""

    __slots__ = ("token", "pid", "holds", "kept", "conns", "post", "notices")

    def __init__(self, token: bytes, pid: int) -> None:
        self.token = token
        self.pid = pid  # its first connection's peer, for log lines
        self.holds: set[str] = set()
        self.kept: set[bytes] = set()  # keys of delivered messages whose names it keeps
        self.conns = 0
        self.post: _Conn | None = None  # where its free notices go
        self.notices: list[str] = []  # generations of its segments freed, not yet sent


class _Conn:
    __slots__ = ("sock", "fd", "client", "post", "last_post", "pid")

    def __init__(self, sock: socket.socket, client: _Client, post: bool, pid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.client = client
        self.post = post
        self.last_post = 0.0  # when a record was last read from this post connection
        self.pid = pid  # the peer's, for log lines


class _Handshake:
    """A connection accepted but not yet authenticated (see Handshake in protocol.py)."""

    __slots__ = ("sock", "nonce", "deadline", "pid")

    def __init__(self, sock: socket.socket, nonce: bytes, deadline: float, pid: int) -> None:
        self.sock = sock
        self.nonce = nonce
        self.deadline = deadline
        self.pid = pid


class _Descriptors:
    """The descriptors the broker holds for undelivered messages: one per distinct
    file (memfd) however many messages name it, each counted by the messages that do.

    Every storage of a sender's slab travels with the slab's descriptor, so a
    sender running far ahead of its receivers deposits the same file again and
    again: one descriptor per message would hold thousands for one segment and
    run the broker out of descriptors (then it can neither take deposits nor
    accept connections). A descriptor that arrives for a file held already is
    closed at once; a message keeps the file's identity."""

    __slots__ = ("by_file",)

    def __init__(self) -> None:
        self.by_file: dict[tuple[int, int], list[int]] = {}  # (st_dev, st_ino) -> [fd, messages naming it]

    def take(self, fd: int) -> tuple[int, int]:
        """Own *fd* from now on; the identity of its file."""
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
        except OSError:
            ident = (-1, fd)  # cannot happen for a descriptor just received; held apart
        held = self.by_file.get(ident)
        if held is None:
            self.by_file[ident] = [fd, 1]
        else:
            os.close(fd)
            held[1] += 1
        return ident

    def fd(self, ident: tuple[int, int]) -> int:
        return self.by_file[ident][0]

    def drop(self, idents: list[tuple[int, int]]) -> None:
        """One message less names each of *idents*: a file nobody names is closed."""
        for ident in idents:
            held = self.by_file[ident]
            held[1] -= 1
            if not held[1]:
                del self.by_file[ident]
                os.close(held[0])

    def close_all(self) -> None:
        for fd, _count in self.by_file.values():
            os.close(fd)
        self.by_file.clear()

    def __len__(self) -> int:
        return len(self.by_file)


class _Message:
    __slots__ = ("files", "names", "sender", "sender_pid", "nbytes", "complete", "lost", "receiver", "done")

    def __init__(self, sender: bytes, sender_pid: int) -> None:
        self.files: list[tuple[int, int]] = []  # its descriptors by slot, as identities in _Descriptors
        self.names: dict[str, bool] = {}  # name -> kept by its receiver
        self.nbytes = 0  # memory behind its descriptors, as its sender declared it
        self.sender = sender  # the depositing client's token
        self.sender_pid = sender_pid  # for log lines
        self.complete = False  # its deposit's last record is in
        self.lost = False  # a deposit record came without its descriptors (EMFILE)
        self.receiver: _Client | None = None  # once delivered (claimed or fetched)
        self.done = False  # its receiver has all it needs: descriptors closed, names not kept dropped

    def keep(self, names) -> None:
        """Its receiver keeps these of its names (those it has)."""
        for name in names:
            if name in self.names:
                self.names[name] = True

    def close(self, descriptors: _Descriptors) -> None:
        """Let go of its descriptors (given away or dropped)."""
        files, self.files = self.files, []
        descriptors.drop(files)


_POST_EVENTS = select.EPOLLIN | select.EPOLLONESHOT
EARLY_CLAIM_TTL = 30.0  # seconds a claim that arrived before its deposit is remembered


class Broker:
    def __init__(self, directory: str, listener: socket.socket, authkey: bytes, root_pid: int) -> None:
        self.dir = directory
        self.listener = listener
        self.authkey = authkey
        self.uid = os.getuid()
        self.conns: dict[int, _Conn] = {}
        self.handshakes: dict[int, _Handshake] = {}
        self.clients: dict[bytes, _Client] = {}
        self.messages: dict[bytes, _Message] = {}
        self.descriptors = _Descriptors()
        # Per sender token: its undelivered messages in deposit order.
        self.pending: dict[bytes, dict[bytes, None]] = {}
        self.refs: dict[str, int] = {}
        self.owners: dict[str, _Client] = {}  # generation name -> the client told when it is free
        self.notify: set[_Client] = set()  # clients with notices to send
        self.parked: list[tuple[float, _Conn, bytes]] = []
        self.early_claims: dict[bytes, tuple[float, _Client, bool, set[str]]] = {}
        # Sender tokens whose connections all closed -> when their undelivered
        # messages expire (ORPHAN_TTL).
        self.orphans: dict[bytes, float] = {}
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
        listener.setblocking(False)
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
        if name.startswith(P.GEN_PREFIX):
            # Nobody holds this generation any more: its owner may reuse the segment.
            owner = self.owners.pop(name, None)
            if owner is not None and owner.post is not None:
                owner.notices.append(name)
                self.notify.add(owner)
            return
        try:
            os.unlink(os.path.join(self.dir, name))
        except FileNotFoundError:
            pass

    def _hold(self, client: _Client, names) -> None:
        for name in names:
            if name not in client.holds:
                if name.startswith(P.GEN_PREFIX) and name not in self.refs:
                    self.owners[name] = client  # its first holder made it (see HOLD in protocol.py)
                client.holds.add(name)
                self._incref(name)

    def _release(self, client: _Client, names) -> None:
        for name in names:
            if name in client.holds:
                client.holds.discard(name)
                self._decref(name)

    def _deliver(self, client: _Client, key: bytes, msg: _Message) -> None:
        """*msg* reached *client*: it is no longer its sender's to expire (an orphan's
        undelivered messages), and goes with its receiver's connections instead."""
        if msg.receiver is not None:
            return
        msg.receiver = client
        self._unpend(key, msg)
        if client.conns:
            client.kept.add(key)
        else:
            self._finish(key, msg, ())

    def _finish(self, key: bytes, msg: _Message, keep) -> None:
        """Its receiver is done with *msg*: close its descriptors, drop the names it
        does not *keep*; the message goes once no name is left."""
        msg.done = True
        msg.close(self.descriptors)
        msg.keep(keep)
        for name in [n for n, kept in msg.names.items() if not kept]:
            del msg.names[name]
            self._decref(name)
        if not msg.names:
            self._forget(key, msg)

    def _forget(self, key: bytes, msg: _Message) -> None:
        self.messages.pop(key, None)
        if msg.receiver is not None:
            msg.receiver.kept.discard(key)

    def _let_go(self, client: _Client, key: bytes, names) -> None:
        """*client* lets go of *names* it kept through message *key*."""
        msg = self.messages.get(key)
        if msg is None or msg.receiver is not client:
            return
        for name in names:
            if msg.names.pop(name, None) is not None:
                self._decref(name)
        if msg.done and not msg.names:
            self._forget(key, msg)

    def _flush_notices(self) -> None:
        """Tell owners which generations of their segments nobody holds any more."""
        for client in self.notify:
            conn = client.post
            names, client.notices = client.notices, []
            if conn is None or not names:
                continue
            for i in range(0, len(names), P.NAMES_PER_RECORD):
                try:
                    P.send_record(conn.sock, P.NOTICE, P.NO_KEY, P.encode_names(names[i : i + P.NAMES_PER_RECORD]))
                except BlockingIOError:
                    client.notices.extend(names[i:])  # its socket is full: next time
                    break
                except OSError:
                    break  # it is going; its segments with it
        self.notify = {c for c in self.notify if c.notices}

    def counters(self) -> dict:
        return {
            "pid": os.getpid(),
            "clients": len(self.clients),
            "connections": len(self.conns),
            "messages": sum(1 for m in self.messages.values() if m.receiver is None),
            "kept_messages": sum(1 for m in self.messages.values() if m.receiver is not None),
            "generations": sum(1 for name in self.refs if name.startswith(P.GEN_PREFIX)),
            "message_fds": len(self.descriptors),
            "message_bytes": sum(m.nbytes for m in self.messages.values() if m.files),
            "handshakes": len(self.handshakes),
            "segment_files": sum(1 for name in self.refs if not name.startswith(P.GEN_PREFIX)),
            "root_alive": self.root_alive,
        }

    # -- connections -----------------------------------------------------------

    def _accept(self) -> None:
        """Start a connection's handshake; its answer is read by the loop (_answer).

        Two records, each small enough to fit a fresh socket's buffer: the broker
        never blocks on a client, so a connection that says nothing stalls no one.
        """
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            log.warning("cannot accept a connection: %s", exc)
            return
        try:
            # Non-blocking always: the loop drains whatever a client has queued, and
            # a client that stops reading its replies is dropped, never waited on.
            sock.setblocking(False)
            pid = peer_pid(sock)
            if peer_uid(sock) != self.uid:
                raise P.ProtocolError("peer runs as another user")
            nonce, hello = P.handshake_hello()
            sock.send(hello)
        except (OSError, P.ProtocolError) as exc:
            log.log(_level(exc), "refused a connection: %s", exc)
            sock.close()
            return
        fd = sock.fileno()
        self.handshakes[fd] = _Handshake(sock, nonce, time.monotonic() + P.HANDSHAKE_TIMEOUT, pid)
        self.poller.register(fd, select.EPOLLIN)

    def _answer(self, shake: _Handshake) -> None:
        """The client's answer to the hello: authenticate it and make it a connection."""
        fd = shake.sock.fileno()
        try:
            answer = shake.sock.recv(P.HANDSHAKE_ANSWER_LEN + 1)
        except BlockingIOError:
            return
        except OSError as exc:
            answer = b""
            log.debug("handshake with pid %d failed: %s", shake.pid, exc)  # it went away
        del self.handshakes[fd]
        try:
            role, token, reply = P.handshake_reply(self.authkey, shake.nonce, answer)
            shake.sock.send(reply)
        except (OSError, P.ProtocolError) as exc:
            if answer:
                log.log(_level(exc), "handshake with pid %d failed: %s", shake.pid, exc)
            self.poller.unregister(fd)
            shake.sock.close()
            return
        client = self.clients.get(token)
        if client is None:
            client = self.clients[token] = _Client(token, shake.pid)
            self.orphans.pop(token, None)
        client.conns += 1
        conn = _Conn(shake.sock, client, role == P.ROLE_POST, shake.pid)
        self.conns[fd] = conn
        if conn.post:
            client.post = conn
        self.poller.modify(fd, _POST_EVENTS if conn.post else select.EPOLLIN)
        self.idle_since = None

    def _drop(self, conn: _Conn, reason: str = "", level: int = logging.WARNING) -> None:
        """Close *conn*; with a *reason* (it broke the protocol, or its I/O failed), log
        it at *level*: DEBUG where its process merely went away (see ``_level``)."""
        if self.conns.pop(conn.fd, None) is None:
            return
        if reason:
            log.log(level, "dropped the connection of pid %d: %s", conn.pid, reason)
        self.poller.unregister(conn.fd)
        self.cooling.discard(conn.fd)
        self.parked = [p for p in self.parked if p[1] is not conn]
        conn.sock.close()
        client = conn.client
        client.conns -= 1
        if client.post is conn:
            client.post = None
        if not client.conns:
            log.debug("pid %d disconnected", client.pid)
            self.clients.pop(client.token, None)
            self._release(client, list(client.holds))
            for key in list(client.kept):
                msg = self.messages.get(key)
                if msg is not None:
                    self._let_go(client, key, list(msg.names))
                    self._finish(key, msg, ())
            client.kept.clear()
            self._orphan(client.token, conn.pid)
        if not self.conns:
            self.idle_since = time.monotonic()
            if self.messages and self.root_alive and log.isEnabledFor(logging.DEBUG):
                # Normal: a sender that exited before its receiver read what it put
                # (the receiver may not even have connected yet), or messages nobody
                # will read (a DataLoader stopped early). They go with the program's
                # root, or after ORPHAN_TTL.
                log.debug("no client left, staying for what is still held: %s", self.holdings())

    def holdings(self, limit: int = 20) -> str:
        """What keeps this broker alive without clients, for its log: each message
        (key, sender, state, names) and each name still counted, with its holders."""
        holders: dict[str, list[str]] = {}
        for client in self.clients.values():
            for name in client.holds:
                holders.setdefault(name, []).append(f"pid {client.pid}")
        parts: list[str] = []
        for key, msg in self.messages.items():
            if msg.receiver is not None:
                state = f"{'done' if msg.done else 'delivered'} to pid {msg.receiver.pid}"
            else:
                state = "undelivered" if msg.complete else "incomplete"
            kept = [f"{name}{' (kept)' if is_kept else ''}" for name, is_kept in msg.names.items()]
            for name in msg.names:
                holders.setdefault(name, []).append(f"message {key.hex()}")
            if len(parts) < limit:
                parts.append(f"message {key.hex()} of pid {msg.sender_pid}, {state}, names [{', '.join(kept)}]")
        if len(self.messages) > limit:
            parts.append(f"... {len(self.messages) - limit} more message(s)")
        names = sorted(self.refs)
        for name in names[:limit]:
            held = holders.get(name, ["nobody known"])
            more = f" and {len(held) - 5} more" if len(held) > 5 else ""
            parts.append(f"{name} x{self.refs[name]} held by {', '.join(held[:5])}{more}")
        if len(names) > limit:
            parts.append(f"... {len(names) - limit} more name(s)")
        if self.early_claims:
            parts.append(f"early claims of {', '.join(key.hex() for key in list(self.early_claims)[:limit])}")
        return "; ".join(parts) or "nothing"

    def _orphan(self, token: bytes, pid: int) -> None:
        """A sender is gone: its incomplete deposits can never complete (dropped now);
        its undelivered messages stay for ORPHAN_TTL."""
        keys = self.pending.get(token)
        if not keys:
            return
        broken = [key for key in keys if not self.messages[key].complete]
        for key in broken:
            self._discard(key)
        if broken:
            log.debug("dropped %d incomplete deposit(s) of pid %d, which disconnected mid-deposit", len(broken), pid)
        if token in self.pending:
            self.orphans[token] = time.monotonic() + ORPHAN_TTL

    def _discard(self, key: bytes) -> None:
        """Drop an undelivered message: its descriptors and its names."""
        msg = self._remove(key)
        for name in msg.names:
            self._decref(name)
        msg.names = {}
        msg.close(self.descriptors)

    def _serve(self, conn: _Conn) -> int:
        """Handle every record *conn* has queued; return how many (-1: conn dropped).

        A request connection has at most one record queued (its client waits for each
        reply), so it is read once: level-triggered epoll reports anything more.
        """
        count = 0
        reset = False
        while not count or conn.post:
            lost = False
            try:
                record = P.recv_record(conn.sock)
            except BlockingIOError:
                return count
            except P.DescriptorsDropped as exc:
                # At the descriptor limit: the record is whole, its descriptors are
                # not. Keep the connection (the stream is in step); the message is lost.
                record, lost = exc.record, True
                log.warning("out of descriptors: a %r record of pid %d came without its descriptors", record[0], conn.pid)
            except ConnectionResetError:
                # Its process closed the connection with records of ours unread (free
                # notices on a post connection): Linux reports ECONNRESET once, *before*
                # the records that process sent us and that are still queued. They
                # count (a claim among them is the only word that its message was
                # received): read on to the end of stream. A request connection's
                # records want replies nobody will read.
                if reset or not conn.post:
                    self._drop(conn)
                    return -1
                reset = True
                continue
            except (OSError, P.ProtocolError) as exc:
                self._drop(conn, str(exc) or type(exc).__name__, _level(exc))
                return -1
            if record is None:
                self._drop(conn)
                return -1
            if not self._handle(conn, *record, lost=lost):
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

    def _handle(self, conn: _Conn, op: bytes, key: bytes, body: bytes, fds: list[int], lost: bool = False) -> bool:
        """One record; False if the connection was dropped.

        Whatever goes wrong with one record drops its connection only: the broker
        holds every other process's messages. Descriptors a record brought and the
        message did not take are closed.
        """
        client = conn.client
        try:
            if op == P.DEPOSIT:
                holds, inflight, nbytes, last = P.decode_deposit(body)
                self._hold(client, holds)
                self._deposit(client, key, fds, inflight, nbytes, last, lost)  # takes fds out of the list
            elif op == P.CLAIM:
                done, keep = P.decode_claim(body)
                msg = self.messages.get(key)
                if msg is not None and msg.complete:
                    self._claim(client, key, done, keep)
                else:
                    self._claim_early(client, key, done, keep)
            elif op == P.FETCH:
                msg = self.messages.get(key)
                if msg is None or not msg.complete:
                    # Its deposit (or its last records) may still be queued on a
                    # post connection.
                    self._drain_posts()
                    msg = self.messages.get(key)
                if msg is not None and msg.complete:
                    self._reply_fetch(conn, key)
                else:
                    self.parked.append((time.monotonic() + P.FETCH_WAIT, conn, key))
            elif op == P.HOLD:
                self._hold(client, P.decode_names(body))
            elif op == P.RELEASE:
                names = P.decode_names(body)
                if key == P.NO_KEY:
                    self._release(client, names)
                elif key in self.early_claims:  # its claim waits for the deposit's last record
                    early = self.early_claims[key]
                    if early[1] is client:
                        early[3].difference_update(names)
                elif key in self.messages:
                    self._let_go(client, key, names)
            elif op == P.PING:
                self._drain_posts()
                if self.notify:
                    self._flush_notices()  # a barrier for notices too
                P.send_record(conn.sock, P.PONG, P.NO_KEY, json.dumps(self.counters()).encode())
            else:
                raise P.ProtocolError(f"unknown op {op!r}")
            return True
        except (OSError, P.ProtocolError) as exc:
            self._drop(conn, f"{op!r} record: {exc}", _level(exc))
            return False
        except Exception:  # noqa: BLE001  a bug one record hit must not end the broker
            log.exception("unexpected error on a %r record of pid %d", op, conn.pid)
            self._drop(conn, "unexpected error (above)")
            return False
        finally:
            for fd in fds:
                os.close(fd)

    def _deposit(self, client: _Client, key: bytes, fds: list[int], inflight: list[str], nbytes: int, last: bool, lost: bool) -> None:
        """One deposit record; the message is delivered once its *last* record is in.
        *fds* (the caller's list) are taken out of it once the record is known good:
        what is still in it when this raises is the caller's to close."""
        msg = self.messages.get(key)
        if msg is None:
            if not (fds or inflight or lost):
                return  # holds only: no message
            msg = self.messages[key] = _Message(client.token, client.pid)
            self.pending.setdefault(client.token, {})[key] = None
        elif msg.complete:
            raise P.ProtocolError("deposit record after the last one of its message")
        taken = fds[:]
        fds.clear()  # the caller's list: from here on the table owns them, not _handle's cleanup
        msg.files.extend([self.descriptors.take(fd) for fd in taken])
        msg.nbytes += nbytes
        for name in inflight:
            if name not in msg.names:
                msg.names[name] = False
                self._incref(name)
        if lost and not msg.lost:
            msg.lost = True
        if msg.lost:
            msg.close(self.descriptors)  # a message without all its descriptors is of no use
        if not last:
            return
        msg.complete = True
        early = self.early_claims.pop(key, None) if self.early_claims else None
        if early is not None:
            self._claim(early[1], key, early[2], early[3])
        if self.parked and key in self.messages:
            self._answer_parked(key)

    def _claim_early(self, client: _Client, key: bytes, done: bool, keep) -> None:
        """A claim read before its deposit's last record: applied when that comes
        (``_deposit``). What one receiver claims adds up, as claims applied in turn
        would (one claim per storage of a load outside a receiving() scope); a claim
        from another client than the first changes nothing, as in ``_claim``."""
        early = self.early_claims.get(key)
        if early is None:
            self.early_claims[key] = (time.monotonic() + EARLY_CLAIM_TTL, client, done, set(keep))
        elif early[1] is client:
            early[3].update(keep)
            if done and not early[2]:
                self.early_claims[key] = (early[0], client, True, early[3])

    def _claim(self, client: _Client, key: bytes, done: bool, keep) -> None:
        """*client* received the message and *keep*s these of its names (until it lets
        go of them, or its connections close). *done*: it is done with the message:
        descriptors closed unused, names it does not keep dropped; else it may still
        fetch the descriptors and claim more names. A claim by another process than
        the first receiver (bytes loaded twice) changes nothing."""
        msg = self.messages[key]
        self._deliver(client, key, msg)
        if msg.receiver is not client:
            return
        if done:
            self._finish(key, msg, keep)
        else:
            msg.keep(keep)

    def _remove(self, key: bytes) -> _Message:
        msg = self.messages.pop(key)
        self._unpend(key, msg)
        return msg

    def _unpend(self, key: bytes, msg: _Message) -> None:
        """*msg* is no longer among its sender's undelivered messages."""
        keys = self.pending.get(msg.sender)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self.pending[msg.sender]

    def _reply_fetch(self, conn: _Conn, key: bytes) -> None:
        if self.messages[key].lost:
            self._discard(key)
            P.send_record(conn.sock, P.FETCHED, key, P.encode_fetched(P.STATUS_LOST, 0))
            return
        msg = self.messages[key]
        if msg.receiver is not None and (msg.receiver is not conn.client or msg.done):
            self._reply_unknown(conn, key)  # another process's, or its descriptors are gone
            return
        # Delivered before anything can fail, so that a client dying mid-reply lets
        # go of it through _drop. Its names stay until the receiver's claim says
        # which it keeps.
        self._deliver(conn.client, key, msg)
        files, msg.files = msg.files, []
        try:
            fds = [self.descriptors.fd(ident) for ident in files]
            head = P.encode_fetched(P.STATUS_OK, len(fds))
            chunks = [fds[i : i + P.MAX_FDS] for i in range(0, len(fds), P.MAX_FDS)] or [[]]
            for chunk in chunks:
                P.send_record(conn.sock, P.FETCHED, key, head, chunk)
        finally:
            self.descriptors.drop(files)

    def _reply_unknown(self, conn: _Conn, key: bytes) -> None:
        P.send_record(conn.sock, P.FETCHED, key, P.encode_fetched(P.STATUS_UNKNOWN, 0))

    def _answer_parked(self, key: bytes) -> None:
        for entry in self.parked:
            if entry[2] == key:
                self.parked.remove(entry)
                try:
                    self._reply_fetch(entry[1], key)
                except OSError as exc:
                    self._drop(entry[1], f"fetch reply: {exc}", _level(exc))
                return

    def _expire(self, now: float) -> None:
        if self.early_claims:
            for key in [k for k, (until, *_rest) in self.early_claims.items() if until <= now]:
                del self.early_claims[key]
        for fd in [fd for fd, shake in self.handshakes.items() if shake.deadline <= now]:
            shake = self.handshakes.pop(fd)
            log.warning("closed a connection of pid %d: no handshake within %.0f s", shake.pid, P.HANDSHAKE_TIMEOUT)
            self.poller.unregister(fd)
            shake.sock.close()
        for token in [t for t, until in self.orphans.items() if until <= now]:
            del self.orphans[token]
            keys = list(self.pending.get(token, ()))
            for key in keys:
                self._discard(key)
            if keys:
                log.debug(
                    "dropped %d undelivered message(s) of a sender that exited %.0f s ago (SHMREDUCE_ORPHAN_TTL)",
                    len(keys),
                    ORPHAN_TTL,
                )
        due = [p for p in self.parked if p[0] <= now]
        if not due:
            return
        self.parked = [p for p in self.parked if p[0] > now]
        for _deadline, conn, key in due:
            try:
                self._reply_unknown(conn, key)
            except OSError as exc:
                self._drop(conn, f"fetch reply: {exc}", _level(exc))

    # -- main loop -------------------------------------------------------------

    def _should_exit(self, now: float) -> bool:
        if self.stopping:
            return True
        if self.conns or self.handshakes or self.idle_since is None:
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
            if self.handshakes:
                timeout = min(timeout, max(0.0, min(h.deadline for h in self.handshakes.values()) - now))
            if self.cool_until is not None:
                timeout = min(timeout, max(0.0, self.cool_until - now))
            for fd, _events in self.poller.poll(timeout):
                conn = conns.get(fd)
                if conn is not None:
                    if self._serve(conn) >= 0 and conn.post:
                        self._cool(conn, now)
                elif fd in self.handshakes:
                    self._answer(self.handshakes[fd])
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
            if self.parked or self.early_claims or self.handshakes or self.orphans:
                self._expire(now)
            if self.notify:
                self._flush_notices()

    def shutdown(self) -> None:
        self.messages.clear()
        self.descriptors.close_all()
        for conn in list(self.conns.values()):
            conn.sock.close()
        for shake in self.handshakes.values():
            shake.sock.close()
        self.listener.close()
        self.poller.close()
        remove_program_dir(self.dir)


def _level(exc: BaseException) -> int:
    """The level of a line about a connection dropped for *exc*: DEBUG where its
    process merely went away (exited or killed with a request unanswered: the normal
    end of a DataLoader worker it shut down), WARNING for the rest (a protocol error,
    another I/O failure), which a user must look into."""
    return logging.DEBUG if isinstance(exc, (BrokenPipeError, ConnectionResetError)) else logging.WARNING


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


def stale_dirs(base: str) -> list[str]:
    """This user's program directories under *base* whose broker is dead.

    Only directories shmreduce made (``protocol.is_program_dir``), at least
    STALE_MIN_AGE old (a younger one may be a launcher's between its making and its
    flock), whose lock no live broker holds.
    """
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    stale = []
    for entry in entries:
        path = os.path.join(base, entry)
        if not P.is_program_dir(path, base):
            continue
        try:
            young = time.time() - os.lstat(path).st_mtime < STALE_MIN_AGE
        except OSError:
            continue
        if not young and lock_is_free(path):
            stale.append(path)
    return stale


def sweep_stale(base: str, keep: str | None = None) -> list[str]:
    """Remove the ``stale_dirs`` of *base* (but *keep*); return those removed."""
    removed = [path for path in stale_dirs(base) if path != keep]
    for path in removed:
        remove_program_dir(path)
    return removed


def _make_program_dir(directory: str) -> None:
    """Make *directory* with its marker unless it exists; refuse one shmreduce did not make.

    Made as a temporary sibling and renamed into place, so that the directory never
    exists without its marker (two launchers may race: the second rename fails).
    """
    if not os.path.lexists(directory):
        made = f"{directory}.new-{os.getpid()}"
        os.mkdir(made, 0o700)
        os.chmod(made, 0o700)  # whatever the umask
        os.close(os.open(os.path.join(made, P.MARKER_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        try:
            os.rename(made, directory)
        except OSError:
            shutil.rmtree(made, ignore_errors=True)  # another launcher's came first
    if not P.is_program_dir(directory):
        raise SystemExit(f"shmreduce broker: {directory} is not a program directory shmreduce made for this user")


def _lock_program_dir(directory: str) -> int | None:
    """Take *directory*'s lock, making the directory if need be: the lock's
    descriptor, or None if a live broker holds it.

    A lock taken on a file that is no longer at the lock's path is not the
    directory's: the janitor of a broker that died removed the directory (and then
    let go of its lock) between our open and our flock, and another launcher may
    have made it anew since. Before this check such a launcher went on to bind in
    the new directory beside its rightful broker, or later had its own janitor
    remove a directory another broker served: two brokers for one program, senders
    on one, receivers finding no socket (issue 19, item 4). Then: make and lock it
    again.
    """
    path = os.path.join(directory, P.LOCK_NAME)
    for _attempt in range(20):
        _make_program_dir(directory)
        try:
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # removed since we made sure of it
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None  # a live broker serves this program (or is removing its directory)
            raise
        held = os.fstat(lock_fd)
        try:
            here = os.stat(path)
            if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
                return lock_fd
        except FileNotFoundError:
            pass
        os.close(lock_fd)
    raise SystemExit(f"shmreduce broker: could not lock {directory}: it was removed and made again 20 times over")


def launch(directory: str, root_pid: int, authkey: bytes, status: socket.socket | None = None) -> int:
    """Start a broker for *directory* unless one runs; return the exit status.

    *status*: the starter's status socket, closed in the broker's processes (it is
    the launcher's alone, and a launcher answers only once it has returned)."""
    base = os.path.dirname(directory)
    lock_fd = _lock_program_dir(directory)
    if lock_fd is None:
        return 0  # a live broker already serves this program
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
    if status is not None:
        status.close()
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    _janitor(directory, listener, authkey, root_pid, lock_fd)
    os._exit(0)


def _log_to_stderr(directory: str) -> None:
    """The server's log: one line per event on its stderr (see Failures in protocol.py),
    at ``$SHMREDUCE_LOG_LEVEL`` (default WARNING: only what a user must act on)."""
    handler = logging.StreamHandler(sys.stderr)
    name = os.path.basename(directory)
    handler.setFormatter(logging.Formatter(f"%(asctime)s shmreduce broker %(process)d ({name}) %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(log_level(os.environ.get("SHMREDUCE_LOG_LEVEL", "")))


def log_level(value: str) -> int:
    """The level ``$SHMREDUCE_LOG_LEVEL`` names: a name (``DEBUG``, ``warning``) or a
    number; WARNING if unset or not a level."""
    value = value.strip()
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    return level if isinstance(level, int) else logging.WARNING


def _janitor(directory: str, listener: socket.socket, authkey: bytes, root_pid: int, lock_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    path = os.environ.get("SHMREDUCE_BROKER_LOG")
    # stdout is the starter's stderr (client.start_broker), unless a log file is named.
    errfd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if path else os.dup(1)
    for fd, target in ((0, devnull), (1, devnull), (2, errfd)):
        os.dup2(target, fd)
    for fd in {devnull, errfd}:
        os.close(fd)
    server = os.fork()
    if server == 0:
        signal.signal(signal.SIGTERM, lambda *_: setattr(broker, "stopping", True))
        _log_to_stderr(directory)
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


STATUS_FD = 3  # the launcher's end of the starter's status socket (see the module docstring)
START_WAIT = 30.0  # seconds the launcher waits for the authkey: it is sent before the launcher starts


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m shmreduce.broker.server DIR ROOT_PID  (status socket on descriptor 3)", file=sys.stderr)
        return 2
    # posix_spawn closes nothing: descriptors the starter had open without
    # close-on-exec (descriptors received over sockets, a user's) are not ours to keep
    # alive for the broker's whole life.
    os.closerange(STATUS_FD + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        status = socket.socket(fileno=STATUS_FD)
    except OSError:
        print("shmreduce broker: no status socket on descriptor 3", file=sys.stderr)
        return 2
    status.settimeout(START_WAIT)
    try:
        authkey = status.recv(P.MAX_RECORD)
        if not authkey:
            raise SystemExit("shmreduce broker: no authkey on the status socket")
        code = launch(os.path.abspath(argv[0]), int(argv[1]), authkey, status)
        status.send(b"ok")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - told to the starter, which raises SharingError
        try:
            status.send(f"error: {type(exc).__name__}: {exc}".encode(errors="replace")[: P.MAX_RECORD])
        except OSError:
            pass
        return 1
    finally:
        status.close()
    return code


if __name__ == "__main__":
    _code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)  # no interpreter teardown: the starter waits for this exit
