"""The broker's wire protocol (shmreduce/broker/protocol.py), unit by unit: record
bodies round-trip and refuse what is malformed, records travel whole over a real
SOCK_SEQPACKET pair with their descriptors, and the handshake authenticates both ways.
No broker, no child process."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from shmreduce.broker import protocol as P

SEG = "seg-" + "0123456789abcdef01234567"
SEG2 = "seg-" + "ffffffffffffffffffffffff"
KEY = bytes(range(P.KEY_LEN))

# Names a list must refuse: wrong prefix, too few or too many digits, not lower-case
# hex, a separator other than "\n", stray whitespace, an empty entry, path tricks.
BAD_NAMES = [
    b"seg-0123",
    b"seg-" + b"0" * 23,
    b"seg-" + b"0" * 25,
    b"gen-" + b"0" * 24,  # generations are not names any more
    b"seg-" + b"ABCDEF0123456789ABCDEF01",
    b"seg-" + b"g" * 24,
    b"foo-" + b"0" * 24,
    b"seg_" + b"0" * 24,
    b"-" + b"0" * 24,
    SEG.encode() + b"," + SEG2.encode(),
    SEG.encode() + b" " + SEG2.encode(),
    SEG.encode() + b"\r\n" + SEG2.encode(),
    SEG.encode() + b"\n",
    b"\n" + SEG.encode(),
    SEG.encode() + b"\n\n" + SEG2.encode(),
    b"../" + SEG.encode(),
    SEG.encode() + b"\x00",
    "seg-٠١٢٣٤٥٦٧٨٩٠١٢٣٤٥٦٧٨٩٠١٢٣".encode(),  # Arabic-Indic digits
]


# -- names -------------------------------------------------------------------------


def test_is_segment_name() -> None:
    assert P.is_segment_name(SEG)
    assert P.is_segment_name(SEG2)
    for bad in [
        "gen-" + SEG[4:],
        SEG.upper(),
        SEG[:-1],
        SEG + "0",
        SEG + "\n",
        "x" + SEG,
        "",
        "seg-",
        "../" + SEG,
        SEG.replace("seg", "SEG"),
    ]:
        assert not P.is_segment_name(bad), bad


def test_names_round_trip() -> None:
    for names in ([], [SEG], [SEG, SEG2], [f"seg-{i:024x}" for i in range(100)]):
        blob = P.encode_names(names)
        assert P.decode_names(blob) == names
    assert P.encode_names([SEG, SEG2]) == (SEG + "\n" + SEG2).encode()
    assert P.decode_names(b"") == []


@pytest.mark.parametrize("blob", BAD_NAMES)
def test_malformed_name_lists_are_refused(blob: bytes) -> None:
    with pytest.raises(P.ProtocolError, match="bad segment names"):
        P.decode_names(blob)


# -- memfd inodes ----------------------------------------------------------------------


@pytest.mark.parametrize("inos", [[0], [1, 2, 3], [(1 << 64) - 1], [(1 << 128) - 1], list(range(1000, 1000 + P.INOS_PER_RECORD))])
def test_inos_round_trip(inos: list[int]) -> None:
    assert P.decode_inos(P.encode_inos(inos)) == inos


@pytest.mark.parametrize("blob", [b"", b"-1", b"1 2", b"1\n", b"\n1", b"1\n\n2", b"0x10", b"1.0", b"+1", b"9" * 40, "١٢".encode(), b"seg"])
def test_malformed_inos_are_refused(blob: bytes) -> None:
    with pytest.raises(P.ProtocolError, match="bad inodes"):
        P.decode_inos(blob)


# -- generations held ------------------------------------------------------------------


@pytest.mark.parametrize(
    "held",
    [
        [(12345, 1, P.HELD)],
        [(SEG, (1 << 64) - 1, P.TAKING)],
        [(1, 7, P.HELD), (SEG, 8, P.DROPPING), (SEG2, 0xABCDEF << 40, P.HELD), ((1 << 64) - 1, 1, P.TAKING), ((7 << 64) | 5, 2, P.HELD)],
    ],
)
def test_ledger_entries_round_trip(held: list[tuple[int | str, int, int]]) -> None:
    blob = b"".join(P.LEDGER_ENTRY.pack(*P.ledger_entry(key, gen, state)) for key, gen, state in held)
    assert P.ledger_holds(blob) == held


def test_a_ledger_keeps_the_64_bits_a_header_holds_and_skips_free_entries() -> None:
    # A generation number may be wider (the pickle's); the header holds its low 64 bits.
    free = P.LEDGER_ENTRY.pack(*P.ledger_entry(4, 4, P.FREE))
    blob = P.LEDGER_ENTRY.pack(*P.ledger_entry(SEG, (1 << 70) + 5)) + free + P.LEDGER_ENTRY.pack(*P.ledger_entry(3, 255))
    assert P.ledger_holds(blob + b"partial entry") == [(SEG, 5, P.HELD), (3, 255, P.HELD)]


def test_a_ledger_entry_state_is_one_aligned_word() -> None:
    # The state changes alone (TAKING -> HELD -> DROPPING -> FREE), one 4-byte store.
    entry = bytearray(P.LEDGER_ENTRY.pack(*P.ledger_entry(SEG, 9, P.FREE)))
    assert P.LEDGER_STATE_AT % 4 == 0 and P.LEDGER_STATE_AT + 4 == P.LEDGER_ENTRY.size
    for state in (P.TAKING, P.HELD, P.DROPPING):
        P.LEDGER_STATE.pack_into(entry, P.LEDGER_STATE_AT, state)
        assert P.ledger_holds(bytes(entry)) == [(SEG, 9, state)]
    P.LEDGER_STATE.pack_into(entry, P.LEDGER_STATE_AT, P.FREE)
    assert P.ledger_holds(bytes(entry)) == []


def test_any_ledger_bytes_name_only_well_formed_segments() -> None:
    # A ledger is the client's memory: whatever it holds, the broker reads memfd
    # identities and file names of the right form (looked up among its own segments),
    # nothing else.
    size = P.LEDGER_ENTRY.size
    blob = os.urandom(size * 500)
    tail = P.LEDGER_ENTRY.pack(*P.ledger_entry(1, 0))[P.LEDGER_STATE_AT :]
    blob = b"".join(blob[i : i + P.LEDGER_STATE_AT] + tail for i in range(0, len(blob), size))
    held = P.ledger_holds(blob)
    assert len(held) == 500
    for key, gen, state in held:
        assert 0 <= gen < 1 << 64 and state == P.HELD
        assert (isinstance(key, int) and 0 < key < 1 << 128) or (isinstance(key, str) and P.is_segment_name(key))


# -- fetched replies -----------------------------------------------------------------


@pytest.mark.parametrize("others", [[], [5], list(range(1, P.MAX_FDS)), [(1 << 128) - 1]])
def test_fetched_round_trip(others: list[int]) -> None:
    body = P.encode_fetched(P.STATUS_OK, others)
    assert P.decode_fetched(body) == (P.STATUS_OK, 1 + len(others), others)


def test_an_unknown_fetch_brings_no_descriptor() -> None:
    body = P.encode_fetched(P.STATUS_UNKNOWN, [])
    assert len(body) == 5
    assert P.decode_fetched(body) == (P.STATUS_UNKNOWN, 0, [])


@pytest.mark.parametrize(
    "body", [b"", b"\x00", b"\x00\x00\x00\x00", b"\x00" * 6, b"\x00" * 64, b"\x00\x00\x00\x00\x03" + b"5", b"\x00\x00\x00\x00\x02" + b"x"]
)
def test_malformed_fetched_replies_are_refused(body: bytes) -> None:
    with pytest.raises(P.ProtocolError, match="bad fetch reply|names|bad inodes"):
        P.decode_fetched(body)


# -- records over a socket -------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.settimeout(5.0)
    b.settimeout(5.0)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _fd_names() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_records_travel_whole_and_in_order(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    bodies = [b"", b"x", P.encode_names([SEG]), P.encode_inos([5, 6]), b"z" * 100_000]
    for i, body in enumerate(bodies):
        P.send_record(a, P.HOLD if i % 2 else P.DROP, KEY, body)
    for i, body in enumerate(bodies):
        assert P.recv_record(b) == (P.HOLD if i % 2 else P.DROP, KEY, body, [])
    P.send_record(b, P.PING, P.NO_KEY)
    assert P.recv_record(a) == (P.PING, P.NO_KEY, b"", [])


def test_descriptors_ride_on_their_record(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    before = _fd_names()
    mine = [os.memfd_create(f"test-protocol-{i}", os.MFD_CLOEXEC) for i in range(3)]
    try:
        for i, fd in enumerate(mine):
            os.ftruncate(fd, 4096 * (i + 1))
            os.pwrite(fd, b"hello %d" % i, 0)
        P.send_record(a, P.FETCHED, KEY, P.encode_fetched(P.STATUS_OK, [7, 8]), fds=mine)
        P.send_record(a, P.FETCHED, KEY, P.encode_fetched(P.STATUS_UNKNOWN, []))
    finally:
        for fd in mine:
            os.close(fd)  # the kernel holds the in-flight copies: ours can go now
    record = P.recv_record(b)
    assert record is not None
    op, key, body, got = record
    try:
        assert (op, key, P.decode_fetched(body)) == (P.FETCHED, KEY, (P.STATUS_OK, 3, [7, 8]))
        assert len(got) == 3 and len(set(got)) == 3
        for i, fd in enumerate(got):
            # Real descriptors of the same memory: size and bytes survive the trip.
            assert os.fstat(fd).st_size == 4096 * (i + 1)
            assert os.pread(fd, 7, 0) == b"hello %d" % i
            assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:test-protocol-{i}")
        # The next record brings none.
        assert P.recv_record(b) == (P.FETCHED, KEY, P.encode_fetched(P.STATUS_UNKNOWN, []), [])
    finally:
        for fd in got:
            os.close(fd)
    assert _fd_names() == before


def test_end_of_stream_is_none(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    P.send_record(a, P.HOLD, P.NO_KEY, P.encode_names([SEG]))
    a.shutdown(socket.SHUT_WR)
    assert P.recv_record(b) == (P.HOLD, P.NO_KEY, SEG.encode(), [])
    assert P.recv_record(b) is None


@pytest.mark.parametrize("size", [1, P.HEADER_LEN - 1])
def test_truncated_record_raises_and_closes_its_descriptors(pair: tuple[socket.socket, socket.socket], size: int) -> None:
    a, b = pair
    before = _fd_names()
    fd = os.memfd_create("test-protocol-truncated", os.MFD_CLOEXEC)
    try:
        a.sendmsg([b"D" * size], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))])
    finally:
        os.close(fd)
    with pytest.raises(P.ProtocolError, match=f"truncated record of {size} bytes"):
        P.recv_record(b)
    assert _fd_names() == before  # the descriptor that came with it was closed
    # The connection goes on: the next record is read whole.
    P.send_record(a, P.RELEASE, KEY, SEG.encode())
    assert P.recv_record(b) == (P.RELEASE, KEY, SEG.encode(), [])


def test_oversized_record_raises(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * P.MAX_RECORD)
    P.send_record(a, P.SEGMENT, KEY, b"x" * P.MAX_RECORD)
    with pytest.raises(P.ProtocolError, match="larger than"):
        P.recv_record(b)


# -- handshake -----------------------------------------------------------------------

AUTHKEY = b"the program's authkey"


class _Broker(threading.Thread):
    """The broker's side of one handshake, driven by hand with handshake_hello and
    handshake_reply; what it got (or the error it raised) is kept."""

    def __init__(self, sock: socket.socket, authkey: bytes) -> None:
        super().__init__(daemon=True)
        self.sock, self.authkey = sock, authkey
        self.result: tuple[bytes, bytes] | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            nonce_b, hello = P.handshake_hello()
            assert hello == P.MAGIC + nonce_b and len(nonce_b) == P.NONCE_LEN
            self.sock.sendall(hello)
            answer = self.sock.recv(1024)
            role, token, reply = P.handshake_reply(self.authkey, nonce_b, answer)
            self.sock.sendall(reply)
            self.result = (role, token)
        except Exception as exc:  # noqa: BLE001  handed to the test
            self.error = exc
            self.sock.shutdown(socket.SHUT_RDWR)  # the broker closes the connection


def _handshake(
    pair: tuple[socket.socket, socket.socket], broker_key: bytes, client_key: bytes, role: bytes, token: bytes
) -> tuple[_Broker, int | Exception]:
    client, server = pair
    broker = _Broker(server, broker_key)
    broker.start()
    outcome: int | Exception
    try:
        outcome = P.client_handshake(client, client_key, role, token)
    except P.ProtocolError as exc:
        outcome = exc
    broker.join(5.0)
    assert not broker.is_alive()
    return broker, outcome


@pytest.mark.parametrize("role", [P.ROLE_REQUEST, P.ROLE_POST])
def test_handshake_with_the_right_key(pair: tuple[socket.socket, socket.socket], role: bytes) -> None:
    token = os.urandom(P.TOKEN_LEN)
    broker, outcome = _handshake(pair, AUTHKEY, AUTHKEY, role, token)
    assert broker.error is None
    assert broker.result == (role, token)
    assert outcome == os.getpid()  # the broker's pid, as handshake_reply packed it


def test_handshake_with_a_wrong_key_fails_on_both_sides(pair: tuple[socket.socket, socket.socket]) -> None:
    broker, outcome = _handshake(pair, AUTHKEY, b"another program's key", P.ROLE_REQUEST, bytes(P.TOKEN_LEN))
    assert isinstance(broker.error, P.ProtocolError) and "client failed authentication" in str(broker.error)
    assert broker.result is None
    assert isinstance(outcome, P.ProtocolError) and "refused the authkey" in str(outcome)


def test_client_refuses_a_broker_that_does_not_know_the_key(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    nonce_b, hello = P.handshake_hello()
    server.sendall(hello)
    # A peer that reads the answer but cannot compute HMAC(authkey, nonce_c).
    server.sendall(os.urandom(32) + (1234).to_bytes(4, "big"))
    with pytest.raises(P.ProtocolError, match="broker failed authentication"):
        P.client_handshake(client, AUTHKEY)
    answer = server.recv(1024)
    assert len(answer) == P.HANDSHAKE_ANSWER_LEN


def test_client_refuses_a_peer_that_is_not_a_broker(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    server.sendall(b"NOTSHMREDU" + os.urandom(P.NONCE_LEN))
    with pytest.raises(P.ProtocolError, match="not a shmreduce broker"):
        P.client_handshake(client, AUTHKEY)
    server.sendall(b"short")
    with pytest.raises(P.ProtocolError, match="cut short"):
        P.client_handshake(client, AUTHKEY)


def test_broker_refuses_bad_answers() -> None:
    nonce_b, _ = P.handshake_hello()
    good = P._digest(AUTHKEY, nonce_b) + os.urandom(P.NONCE_LEN)
    role, token, reply = P.handshake_reply(AUTHKEY, nonce_b, good + P.ROLE_POST + b"t" * P.TOKEN_LEN)
    assert (role, token, len(reply)) == (P.ROLE_POST, b"t" * P.TOKEN_LEN, 36)
    with pytest.raises(P.ProtocolError, match="unknown connection role"):
        P.handshake_reply(AUTHKEY, nonce_b, good + b"x" + bytes(P.TOKEN_LEN))
    with pytest.raises(P.ProtocolError, match="cut short"):
        P.handshake_reply(AUTHKEY, nonce_b, good + P.ROLE_POST + bytes(P.TOKEN_LEN - 1))
    with pytest.raises(P.ProtocolError, match="cut short"):
        P.handshake_reply(AUTHKEY, nonce_b, b"")
    # A digest over another nonce (a replayed answer) fails.
    other, _ = P.handshake_hello()
    with pytest.raises(P.ProtocolError, match="failed authentication"):
        P.handshake_reply(AUTHKEY, other, good + P.ROLE_POST + bytes(P.TOKEN_LEN))
