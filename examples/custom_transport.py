"""A custom transport: shmreduce.dumps / loads over a raw socket pair and an os.pipe.

``dumps`` is cloudpickle-based (lambdas and closures work) and shares every tensor
inside instead of copying it: the bytes written to the socket stay tiny however big
the tensors are, and the child writes straight into the parent's memory. No
``register()`` is needed for dumps/loads. The bytes load in any process of this
program on this host, as many times as you like, while their tensors live somewhere
in the program (a load after that is a ``SharingError``, never other bytes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct

import torch

import shmreduce


def send_msg(write, obj) -> int:
    data = shmreduce.dumps(obj)
    write(struct.pack("!Q", len(data)) + data)
    return len(data)


def recv_exact(read, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = read(n - len(buf))
        if not chunk:
            raise EOFError("peer closed the transport")
        buf += chunk
    return buf


def recv_msg(read):
    (n,) = struct.unpack("!Q", recv_exact(read, 8))
    return shmreduce.loads(recv_exact(read, n))


def child(sock: socket.socket, pipe_w: int) -> None:
    torch.set_num_threads(1)  # forked: never touch the parent's OpenMP pool (it can hang)
    msg = recv_msg(sock.recv)
    frame, transform = msg["frame"], msg["transform"]
    frame.copy_(transform(frame))  # writes into the parent's memory
    reply = {"checksum": frame.sum(), "made_here": torch.arange(1_000_000, dtype=torch.float32)}
    send_msg(lambda b: os.write(pipe_w, b), reply)  # the other direction, over an os.pipe
    sock.sendall(b"done")


def main() -> None:
    ctx = mp.get_context("fork")
    parent_sock, child_sock = socket.socketpair()
    pipe_r, pipe_w = os.pipe()
    proc = ctx.Process(target=child, args=(child_sock, pipe_w))
    proc.start()
    child_sock.close()
    os.close(pipe_w)
    try:
        frame = torch.ones(1024, 1024)  # 4 MiB
        scale = 3.0
        nbytes = send_msg(parent_sock.sendall, {"frame": frame, "transform": lambda t: t * scale + 1})
        print(f"sent a 4 MiB tensor and a lambda in {nbytes} bytes over a socketpair")
        reply = recv_msg(lambda n: os.read(pipe_r, n))
        assert recv_exact(parent_sock.recv, 4) == b"done"
        assert torch.equal(frame, torch.full((1024, 1024), 4.0)), "child's in-place write not seen"
        assert reply["checksum"].item() == 4.0 * 1024 * 1024
        # Unregistered, torch's own is_shared() cannot tell shmreduce's shared memory
        # from private memory (register() teaches it): check the bytes instead.
        assert reply["made_here"][-1].item() == 999_999
        print("child wrote into the parent's tensor; reply with a 4 MB tensor received over os.pipe")
        del reply
    finally:
        proc.join(30)
        parent_sock.close()
        os.close(pipe_r)
    assert proc.exitcode == 0, proc.exitcode
    print("custom_transport: OK")


if __name__ == "__main__":
    main()
