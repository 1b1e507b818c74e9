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
GEN = "gen-" + "00000000000000000000002a"
GEN2 = "gen-" + "abcdefabcdefabcdefabcdef"
KEY = bytes(range(P.KEY_LEN))

# Names a list must refuse: wrong prefix, too few or too many digits, not lower-case
# hex, a separator other than "\n", stray whitespace, an empty entry, path tricks.
BAD_NAMES = [
    b"seg-0123",
    b"seg-" + b"0" * 23,
    b"seg-" + b"0" * 25,
    b"gen-" + b"0" * 25,
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


def test_gen_name_is_24_hex_digits_and_not_a_segment_file_name() -> None:
    assert P.gen_name(0) == "gen-" + "0" * 24
    assert P.gen_name(42) == GEN
    assert P.gen_name((1 << 96) - 1) == "gen-" + "f" * 24
    for gen in (1, 0xFFFF << 48 | 7, (1 << 64) + 3):
        name = P.gen_name(gen)
        assert len(name) == 28 and int(name[4:], 16) == gen
        assert not P.is_segment_name(name)
        assert P.decode_names(P.encode_names([name])) == [name]


def test_is_segment_name() -> None:
    assert P.is_segment_name(SEG)
    assert P.is_segment_name(SEG2)
    for bad in [GEN, SEG.upper(), SEG[:-1], SEG + "0", SEG + "\n", "x" + SEG, "", "seg-", "../" + SEG, SEG.replace("seg", "SEG")]:
        assert not P.is_segment_name(bad), bad


def test_names_round_trip_with_segment_and_generation_names() -> None:
    for names in ([], [SEG], [GEN], [SEG, GEN, SEG2, GEN2], [P.gen_name(i) for i in range(100)]):
        blob = P.encode_names(names)
        assert P.decode_names(blob) == names
    assert P.encode_names([SEG, GEN]) == (SEG + "\n" + GEN).encode()
    assert P.decode_names(b"") == []


@pytest.mark.parametrize("blob", BAD_NAMES)
def test_malformed_name_lists_are_refused(blob: bytes) -> None:
    with pytest.raises(P.ProtocolError, match="bad segment names"):
        P.decode_names(blob)


# -- deposit bodies ------------------------------------------------------------------


@pytest.mark.parametrize(
    "holds, inflight, nbytes, last",
    [
        ([], [], 0, False),
        ([], [], 0, True),
        ([GEN], [GEN, SEG], 4096, True),
        ([GEN, GEN2], [SEG, SEG2, GEN, GEN2], 10**19, False),
        ([], [SEG], 99_999_999_999_999_999_999 // 10, True),
        ([P.gen_name(i) for i in range(50)], [f"seg-{i:024x}" for i in range(50)], 1, False),
    ],
)
def test_deposit_round_trip(holds: list[str], inflight: list[str], nbytes: int, last: bool) -> None:
    body = P.encode_deposit(holds, inflight, nbytes, last)
    assert P.decode_deposit(body) == (holds, inflight, nbytes, last)


def test_deposit_wire_format() -> None:
    assert P.encode_deposit([GEN], [SEG, GEN], 12, True) == f"{GEN}|{SEG}\n{GEN}|12|1".encode()
    assert P.encode_deposit([], [], 0, False) == b"||0|0"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"|",
        b"||0",  # three fields
        b"||0|0|",  # five
        b"||0|1|1",
        b"||0;0",  # wrong separator
        f"{SEG};{GEN}||0|0".encode(),
        b"||x|0",  # nbytes not a number
        b"||-1|0",
        b"|| 1|0",
        b"||1 |0",
        b"||+1|0",
        b"||1.0|0",
        b"||0x10|0",
        b"|||0",  # nbytes empty
        b"||" + b"9" * (P.MAX_NBYTES_DIGITS + 1) + b"|0",  # too many digits
        "||١٢|0".encode(),  # non-ASCII digits
        b"||0|2",  # bad last flag
        b"||0|",
        b"||0|01",
        b"||0|true",
        b"||0|1\n",
        f"{SEG[:-1]}||0|0".encode(),  # a bad name in holds
        f"|{SEG}\n|0|0".encode(),  # a bad list in inflight
        f"|{SEG.upper()}|0|0".encode(),
    ],
)
def test_malformed_deposit_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_deposit(body)


def test_deposit_nbytes_at_the_digit_limit_is_accepted() -> None:
    body = b"||" + b"9" * P.MAX_NBYTES_DIGITS + b"|1"
    assert P.decode_deposit(body) == ([], [], int("9" * P.MAX_NBYTES_DIGITS), True)


# -- claim bodies --------------------------------------------------------------------


@pytest.mark.parametrize("done", [True, False])
@pytest.mark.parametrize("keep", [[], [GEN], [GEN, SEG], [SEG, GEN, SEG2, GEN2]])
def test_claim_round_trip(done: bool, keep: list[str]) -> None:
    body = P.encode_claim(done, keep)
    assert body[:1] == (b"d" if done else b"p")
    assert P.decode_claim(body) == (done, keep)


@pytest.mark.parametrize(
    "body",
    [
        b"",  # no flag
        b"x",
        b"D",  # flags are lower case
        b"P",
        b"1",
        b"\x00",
        SEG.encode(),  # names without a flag
        b"d\n" + GEN.encode(),  # separator before the first name
        b"d " + GEN.encode(),
        b"d" + GEN.encode() + b"\n",
        b"p" + GEN.encode() + b"|" + SEG.encode(),
        b"d" + GEN.encode()[:-1],
        b"dgen-" + b"0" * 25,
        b"pfoo",
    ],
)
def test_malformed_claim_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_claim(body)


# -- fetched replies -----------------------------------------------------------------


@pytest.mark.parametrize("status", [P.STATUS_OK, P.STATUS_UNKNOWN, P.STATUS_LOST])
@pytest.mark.parametrize("total", [0, 1, P.MAX_FDS, P.MAX_FDS * 3 + 1, (1 << 32) - 1])
def test_fetched_round_trip(status: int, total: int) -> None:
    body = P.encode_fetched(status, total)
    assert len(body) == 5
    assert P.decode_fetched(body) == (status, total)


@pytest.mark.parametrize("body", [b"", b"\x00", b"\x00\x00\x00\x00", b"\x00" * 6, b"\x00" * 64])
def test_malformed_fetched_replies_are_refused(body: bytes) -> None:
    with pytest.raises(P.ProtocolError, match="bad fetch reply"):
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
    bodies = [b"", b"x", P.encode_deposit([GEN], [SEG], 7, True), P.encode_claim(True, [GEN]), b"z" * 100_000]
    for i, body in enumerate(bodies):
        P.send_record(a, P.DEPOSIT if i % 2 else P.CLAIM, KEY, body)
    for i, body in enumerate(bodies):
        assert P.recv_record(b) == (P.DEPOSIT if i % 2 else P.CLAIM, KEY, body, [])
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
        P.send_record(a, P.FETCHED, KEY, P.encode_fetched(P.STATUS_OK, 3), fds=mine)
        P.send_record(a, P.FETCHED, KEY, P.encode_fetched(P.STATUS_OK, 0))
    finally:
        for fd in mine:
            os.close(fd)  # the kernel holds the in-flight copies: ours can go now
    record = P.recv_record(b)
    assert record is not None
    op, key, body, got = record
    try:
        assert (op, key, P.decode_fetched(body)) == (P.FETCHED, KEY, (P.STATUS_OK, 3))
        assert len(got) == 3 and len(set(got)) == 3
        for i, fd in enumerate(got):
            # Real descriptors of the same memory: size and bytes survive the trip.
            assert os.fstat(fd).st_size == 4096 * (i + 1)
            assert os.pread(fd, 7, 0) == b"hello %d" % i
            assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:test-protocol-{i}")
        # The next record brings none.
        assert P.recv_record(b) == (P.FETCHED, KEY, P.encode_fetched(P.STATUS_OK, 0), [])
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
    P.send_record(a, P.RELEASE, KEY, GEN.encode())
    assert P.recv_record(b) == (P.RELEASE, KEY, GEN.encode(), [])


def test_oversized_record_raises(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * P.MAX_RECORD)
    P.send_record(a, P.DEPOSIT, KEY, b"x" * P.MAX_RECORD)
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
