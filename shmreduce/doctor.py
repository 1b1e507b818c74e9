"""The ``doctor`` and ``cleanup`` commands (``shmreduce ...`` or ``python -m shmreduce ...``).

Light by design: stdlib only, never imports torch. ``doctor`` checks what would bite a
program that shares tensors here (shm mount size and free space, descriptor limits,
memfd, the torch a child process imports and the path its storages take, starting and
pinging a throwaway broker, stale program directories) and exits
non-zero if something would, then lists the running programs of this user (broker
pid, root, connections, segment files and their bytes) in a table, or as JSON with
``--json``. A program can print its own state, pools included, with
``shmreduce.doctor.report()`` (``print_report()`` for the table). ``cleanup`` lists
the stale program directories (``stale_programs``) and broker processes whose
program root is gone and that no process uses any more; ``--yes`` removes them.
Nothing else is touched: not a directory shmreduce did not make, not one that may
be starting, not a broker still in use.

Stale: a program directory whose lock nobody holds (no broker, janitor or launcher
of it lives: ``programdir.lock_is_free``) and whose processes are gone is stale at once:
no live process of this user names it on its command line (every broker process,
a launcher between making the directory and locking it included, does) or has a
file in it open or mapped (``_in_use``). After every process of a program is
SIGKILLed, ``doctor`` says so and ``cleanup`` removes it at once.
Also stale, whatever it holds: a directory whose lock is free and that is
``programdir.STALE_MIN_AGE`` (10 s) old, which is what the sweep at every
``register()`` and broker launch removes (``programdir.sweep_stale``) without looking
into /proc; those 10 s protect a launcher between making a directory and taking its
lock (it would find its directory gone and fail its start), which this look sees by
its command line. A program whose broker died while its processes live and map its
files is not stale here until then; its next share starts a new broker there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import time

from shmreduce import program
from shmreduce.broker import protocol as P
from shmreduce.broker.programdir import lock_if_free, lock_is_free, remove_program_dir, stale_dirs, sweep_stale

MIN_SHM_BYTES = 1 << 30  # below 1 GiB of free shm, file_system sends of big batches fail
MIN_NOFILE = 4096


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _broker_procs() -> list[tuple[int, str, int]]:
    """(pid, directory, root_pid) of this user's broker processes."""
    procs = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if "shmreduce.broker.server" in argv:
            i = argv.index("shmreduce.broker.server")
            if len(argv) >= i + 3 and argv[i + 2].isdigit():
                procs.append((int(entry), argv[i + 1], int(argv[i + 2])))
    return procs


def _connected(socket_path: str) -> int:
    """How many connections the broker listening on *socket_path* has accepted and
    still holds (its end of each is listed under its path in /proc/net/unix, state
    03: connected); a large number if that cannot be read, so that it counts as used."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return 1 << 30
    return sum(1 for line in lines if line.split()[5:6] == ["03"] and line.split()[7:8] == [socket_path])


def orphan_brokers() -> list[tuple[int, str, int]]:
    """Brokers whose program root process is gone and that no process is connected
    to (they normally exit on their own; one still in use serves live processes). One
    whose directory is not there is not this machine's to judge from here: it is
    exiting (it removes its directory last), or runs in another mount namespace
    (another container, or ``unshare``) where that directory lies."""
    return [
        p
        for p in _broker_procs()
        if not os.path.exists(f"/proc/{p[2]}") and os.path.isdir(p[1]) and not _connected(os.path.join(p[1], P.SOCKET_NAME))
    ]


def _in_use(base: str) -> set[str]:
    """The program directories under *base* that a live process of this user names on
    its command line (a broker's launcher, janitor or server: ``... server DIR ROOT``)
    or has a file of open or mapped (this process aside)."""
    prefix = base.rstrip("/") + "/"
    used: set[str] = set()

    def note(path: str) -> None:
        if path.startswith(prefix):
            used.add(prefix + path[len(prefix) :].split("/", 1)[0].split(" ", 1)[0])

    me = str(os.getpid())  # the lock we may hold to remove it
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == me:
            continue
        proc = f"/proc/{entry}"
        try:
            if os.stat(proc).st_uid != os.getuid():
                continue
            with open(f"{proc}/cmdline", "rb") as cmdline:
                for arg in cmdline.read().split(b"\0"):
                    note(arg.decode(errors="replace"))
            with open(f"{proc}/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6:
                        note(fields[5].strip())
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    note(os.readlink(f"{proc}/fd/{fd}"))
                except OSError:
                    pass
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return used


def stale_programs(base: str) -> list[str]:
    """The stale program directories of *base* (see the module's docstring): lock free
    and STALE_MIN_AGE old (``programdir.stale_dirs``), or lock free and in no live
    process's use, at any age."""
    old = stale_dirs(base)
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return old
    used = _in_use(base)
    young = [
        path
        for path in (os.path.join(base, entry) for entry in entries)
        if path not in old and path not in used and P.is_program_dir(path, base) and lock_is_free(path)
    ]
    return sorted(old + young)


def _remove_unused(base: str, path: str) -> bool:
    """Remove *path*, holding its lock, if it is still in nobody's use under it (a
    launcher that starts meanwhile finds the lock taken, and its client tries again)."""
    lock_fd = lock_if_free(path)  # the one way to take a program directory's lock
    if lock_fd is None:
        return False
    try:
        return path not in _in_use(base) and remove_program_dir(path, lock_fd)
    finally:
        os.close(lock_fd)


# Run in a child: doctor itself never imports torch (seconds, and gigabytes mapped).
_TORCH_PROBE = "import torch; from shmreduce import _torch; print(torch.__version__, _torch.path())"


def _check_torch() -> tuple[bool, str]:
    """Which torch a program run with this Python gets, and the path a sender's storage
    takes into shared memory on it (``shmreduce._torch.path``); a torch below the floor
    is a problem, no torch is none (this machine may run brokers only)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", _TORCH_PROBE], capture_output=True, text=True, env=env, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"could not import torch in a child process ({exc})"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        if "No module named 'torch'" in last:
            return True, "not installed for this Python: shmreduce shares tensors only where torch is"
        return False, last
    version, path = out.stdout.split()
    if path == "swap":
        return True, f"{version}: storages move into shmreduce's pool in place (UntypedStorage._swap_data_ptr_)"
    return True, (
        f"{version}: no UntypedStorage._swap_data_ptr_ (torch 2.12 and up): torch moves each storage sent into a memfd of "
        "its own, which shmreduce sends from (no slab packing; docs/compatibility.md says what it costs)"
    )


def _check_broker(base: str) -> tuple[bool, str]:
    import multiprocessing

    from shmreduce.broker import client

    directory = os.path.join(base, f"{P.DIR_PREFIX}doctor-{secrets.token_hex(6)}")
    c = client.BrokerClient(directory, os.getpid())
    try:
        t0 = time.monotonic()
        counters = c.ping()
        ms = (time.monotonic() - t0) * 1000
        ok = counters.get("clients") == 1
        return ok, f"started a throwaway broker (pid {counters.get('pid')}) and pinged it in {ms:.0f} ms"
    except Exception as exc:  # noqa: BLE001  reported as a failed check
        return False, f"could not start or reach a broker in {base}: {exc}"
    finally:
        c.close()
        pid = c.broker_pid
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while os.path.exists(directory) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(directory, ignore_errors=True)
        del multiprocessing


def programs() -> list[dict]:
    """The running programs of this user, seen from outside (no authkey needed): their
    broker's pid and directory, whether their root lives, the connections the broker
    holds, the segment files in their directory and the bytes those use."""
    rows = []
    found: dict[str, list[tuple[int, int]]] = {}
    for pid, directory, root in _broker_procs():
        found.setdefault(directory, []).append((pid, root))
    for directory, procs in found.items():
        # Two processes per broker: the janitor and the server it forked (see
        # broker/server.py); the server is the one whose parent is the other.
        pids = {pid for pid, _root in procs}
        pid, root = next(((p, r) for p, r in procs if _parent(p) in pids), procs[0])
        files, used = 0, 0
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.startswith(P.SEG_PREFIX):
                        files += 1
                        used += entry.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
        rows.append(
            {
                "broker_pid": pid,
                "directory": directory,
                "root_pid": root,
                "root_alive": os.path.exists(f"/proc/{root}"),
                "connections": _connected(os.path.join(directory, P.SOCKET_NAME)),
                "segment_files": files,
                "segment_bytes": used,
            }
        )
    return rows


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def report() -> dict:
    """This process's sharing state, for a program to print about itself: its pools
    (segments, bytes mapped, descriptors; ``shmreduce.stats()``) and, if it talks to
    its broker, the broker's state (clients, messages pending, names held)."""
    import shmreduce
    from shmreduce.broker import client

    result: dict = {"process": shmreduce.stats()}
    live = client.connected_client(program.current().directory)
    if live is not None:
        try:
            result["broker"] = live.ping(full=True)
        except Exception as exc:  # noqa: BLE001  reported, not raised: a diagnostic
            result["broker"] = {"error": str(exc)}
    return result


def print_report(data: dict | None = None) -> None:
    """``report()`` as a table a person can read."""
    data = report() if data is None else data
    rows = [("process", key, value) for key, value in data["process"].items()]
    rows += [("broker", key, value) for key, value in data.get("broker", {}).items()]
    for section, key, value in rows:
        print(f"{section:8} {key:26} {_fmt(value) if key.endswith('bytes') and isinstance(value, int) else value}")


def doctor(as_json: bool = False) -> int:
    base = program.shm_base()
    problems = 0
    checks: list[dict] = []

    def report(ok: bool, what: str, detail: str) -> None:
        nonlocal problems
        problems += not ok
        checks.append({"check": what, "ok": ok, "detail": detail})
        if not as_json:
            print(f"[{'ok' if ok else 'PROBLEM'}] {what}: {detail}")

    try:
        st = os.statvfs(base)
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        report(
            free >= MIN_SHM_BYTES,
            "shm mount",
            f"{base}: {_fmt(size)} total, {_fmt(free)} free"
            + (
                ""
                if free >= MIN_SHM_BYTES
                else f" (under {_fmt(MIN_SHM_BYTES)}: 'file_system' sends will fail; use 'file_descriptor' "
                "(memfd, not limited by this mount), or set SHMREDUCE_SHM_DIR to a larger tmpfs, "
                "or give the container --shm-size)"
            ),
        )
    except OSError as exc:
        report(False, "shm mount", f"{base}: {exc}; set SHMREDUCE_SHM_DIR to a writable tmpfs")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    usable = hard if hard != resource.RLIM_INFINITY else soft
    report(
        usable >= MIN_NOFILE,
        "descriptor limit",
        f"soft {soft}, hard {hard} (register() raises soft to hard)"
        + (
            ""
            if usable >= MIN_NOFILE
            else f"; under {MIN_NOFILE}: receivers holding many tensors with 'file_descriptor' will hit "
            "'out of file descriptors'; raise ulimit -Hn or use 'file_system'"
        ),
    )
    try:
        fd = os.memfd_create("shmreduce-doctor", os.MFD_CLOEXEC)
        os.ftruncate(fd, 1 << 20)
        os.close(fd)
        report(True, "memfd", "memfd_create works ('file_descriptor' strategy available)")
    except (AttributeError, OSError) as exc:
        report(False, "memfd", f"memfd_create failed ({exc}); use the 'file_system' strategy")
    # Stale state first: starting the throwaway broker sweeps stale directories.
    stale = stale_programs(base)
    report(
        not stale,
        "stale program directories",
        "none" if not stale else f"{len(stale)} ({', '.join(stale[:5])}); run: python -m shmreduce cleanup --yes",
    )
    orphans = orphan_brokers()
    served = [row for row in programs() if not row["root_alive"] and row["broker_pid"] not in {p[0] for p in orphans}]
    report(
        not orphans,
        "orphan brokers",
        ("none" if not orphans else f"{[p[0] for p in orphans]}; run: python -m shmreduce cleanup --yes")
        + (
            f" ({len(served)} broker(s) whose program's root exited still serve the processes of it connected to them: "
            "not orphans; each exits once none is connected)"
            if served
            else ""
        ),
    )
    ok, detail = _check_torch()
    report(ok, "torch", detail)
    ok, detail = _check_broker(base)
    report(ok, "broker", detail)
    running = programs()
    if as_json:
        print(json.dumps({"ok": not problems, "checks": checks, "programs": running}, indent=2))
        return 1 if problems else 0
    if running:
        print("this user's programs on this machine (all of them, not only this shell's):")
        print(f"{'broker':>8} {'root':>8} {'alive':>5} {'conns':>5} {'files':>5} {'file bytes':>10}  directory")
        for row in running:
            print(
                f"{row['broker_pid']:>8} {row['root_pid']:>8} {'yes' if row['root_alive'] else 'no':>5} {row['connections']:>5} "
                f"{row['segment_files']:>5} {_fmt(row['segment_bytes']):>10}  {row['directory']}"
            )
        print(
            "alive: whether the program's root process lives (the process that shared first); a broker whose "
            "root exited serves the program's other processes while any is connected (conns), and exits when "
            "none is. files, file bytes: the program's segment files ('file_system') and the memory they use."
        )
    else:
        print("no shmreduce program running for this user")
    print("all good" if not problems else f"{problems} problem(s) found")
    return 1 if problems else 0


def cleanup(yes: bool) -> int:
    base = program.shm_base()
    stale = stale_programs(base)
    orphans = orphan_brokers()
    for path in stale:
        print(f"stale program directory: {path}")
    for pid, directory, root in orphans:
        print(f"broker of a dead program: pid {pid} (program {directory}, root {root} gone)")
    if not stale and not orphans:
        print("nothing to clean")
        return 0
    if not yes:
        print("run again with --yes to remove them")
        return 0
    for pid, _directory, _root in orphan_brokers():  # looked at again: what is listed may have changed
        try:
            os.kill(pid, signal.SIGTERM)
            print(f"stopped broker {pid}")
        except OSError:
            pass
    removed = sweep_stale(base)  # STALE_MIN_AGE old, and what a killed removal left
    removed += [path for path in stale if path not in removed and os.path.isdir(path) and _remove_unused(base, path)]
    for path in removed:
        print(f"removed {path}")
    return 0


def main(argv: list[str] | None = None, prog: str = "shmreduce") -> int:
    """The command line; the ``shmreduce`` console script calls it with no arguments (``sys.argv``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="check shm size, descriptor limits, memfd, the broker, stale state; list running programs")
    d.add_argument("--json", action="store_true", help="print the checks and the programs as JSON")
    c = sub.add_parser("cleanup", help="list (and with --yes remove) stale program dirs and orphan brokers")
    c.add_argument("--yes", action="store_true", help="remove what is listed")
    args = parser.parse_args(argv)
    try:
        code = doctor(as_json=args.json) if args.command == "doctor" else cleanup(args.yes)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (doctor --json | head): not a failure to report with
        # a traceback. What is left to flush at exit goes nowhere (Python's documented
        # way: "Note on SIGPIPE" in the signal module's docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code
