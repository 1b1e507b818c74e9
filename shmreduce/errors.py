"""SharingError: the one exception class for every shmreduce sharing failure."""

from __future__ import annotations

import sys


class SharingError(RuntimeError):
    """A tensor or storage could not be shared or received.

    The message says what happened and what to do about it.
    """


def broker_gone(detail: str) -> SharingError:
    return SharingError(
        f"the shmreduce broker for this program is not reachable ({detail}); "
        "messages pickled before it went away cannot be received, "
        "send them again"
    )


def stale_message(what: str) -> SharingError:
    return SharingError(
        f"{what}: the memory it names was let go of and reused since it was sent "
        "(every process dropped its tensors), the message was forged, or it was sent "
        "through a broker that has since exited, or (file_descriptor) it lies in a memfd "
        "that only processes keeping its tensors map now, the broker keeping no descriptor "
        "of it (file_system loads such bytes again); a pickled shmreduce message loads "
        "while its tensors live somewhere in the program, so send it again"
    )


def too_many_files(detail: str) -> SharingError:
    """Out of descriptors, with the advice of the strategy in use."""
    if _strategy() == "file_system":
        return SharingError(
            f"out of file descriptors ({detail}): under the 'file_system' strategy a process keeps "
            "one descriptor open per shared-memory segment it made to send from (a slab of small "
            "tensors, or one large tensor; receivers keep none), besides its own files and sockets. "
            "Drop the tensors you sent and no longer need, or raise the limit (ulimit -n / "
            "resource.RLIMIT_NOFILE)"
        )
    return SharingError(
        f"out of file descriptors ({detail}): the 'file_descriptor' strategy keeps "
        "one descriptor open per shared-memory segment a process maps (a slab of small "
        "tensors, or one large tensor). Drop tensors you no longer "
        f"need, {_or_file_system('raise the limit (ulimit -n / resource.RLIMIT_NOFILE)')}"
    )


def _or_file_system(advice: str) -> str:
    """*advice*, and switching to 'file_system' where that spares descriptors: not on a
    torch without the swap (``shmreduce._torch.path()``), where torch moves a sender's
    storages into memfds under either strategy."""
    torch_api = sys.modules.get("shmreduce._torch")
    if torch_api is not None and getattr(torch_api, "swap_memory", True) is None:
        return advice
    return f"{advice}, or call shmreduce.set_sharing_strategy('file_system')"


def _strategy() -> str | None:
    """The strategy in use, if torch is loaded here (this module never imports it: the
    broker, which imports the package, never does)."""
    tmp = sys.modules.get("torch.multiprocessing")
    return None if tmp is None else tmp.get_sharing_strategy()


def deposit_lost() -> SharingError:
    return SharingError(
        "the shmreduce broker could not keep the shared memory of this message: it is at "
        "its limit of open file descriptors (it keeps one per segment a process sends "
        "from). Nothing was sent and the tensors keep their data: send again once "
        "processes have let go of segments, "
        + (
            "or start the program with a higher limit (ulimit -n / resource.RLIMIT_NOFILE; the broker inherits it "
            "from the process that shares first)"
            if _strategy() == "file_system"
            else _or_file_system(
                "start the program with a higher limit (ulimit -n / resource.RLIMIT_NOFILE; the broker inherits it "
                "from the process that shares first)"
            )
        )
    )


class OutOfSharedMemory(SharingError):
    """The shared-memory mount of the program directory has no room for a new file."""


def out_of_shm(path: str, nbytes: int, detail: str) -> OutOfSharedMemory:
    return OutOfSharedMemory(
        f"cannot reserve {nbytes} bytes of shared memory in {path} ({detail}); "
        "the shared-memory mount is too small or full. Free space there, set "
        "SHMREDUCE_SHM_DIR to a larger tmpfs, or use the 'file_descriptor' strategy, "
        "which does not use that mount"
    )


# -- a failure sent in place of a message ----------------------------------------------


def failed_send(cause: BaseException, pid: int) -> SharingError:
    """What the receiver of a message whose sharing failed in a queue's feeder thread
    gets instead of the message (``registry._forking_dumps``): the sender's error,
    its pid and its message, as the sender's own advice."""
    return SharingError(
        f"process {pid} could not share the message it put here, so its queue sent this error in its place: {type(cause).__name__}: {cause}"
    )


def raise_failed_send(message: str) -> None:
    """Unpickling a message whose sharing failed at its sender raises its error."""
    raise SharingError(message)
