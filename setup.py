"""Builds shmreduce's one C extension, ``shmreduce._native``, from ``shmreduce/_native/*.c``; everything else is in
pyproject.toml.

Plain C against the CPython API and DLPack's C ABI (no torch headers): a C compiler and
Python's headers are all it needs. ``SHMREDUCE_STRICT_BUILD=1`` (``make``) adds -Werror;
``SHMREDUCE_ASAN=1`` (``make asan``) builds it with AddressSanitizer, ``SHMREDUCE_TSAN=1``
(``make tsan``) with ThreadSanitizer, ``SHMREDUCE_DEBUG_BUILD=1`` without -DNDEBUG, so that its
``assert()``s of internal invariants are checked.
"""

import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

compile_args = ["-std=c11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"]
link_args: list[str] = []
if os.environ.get("SHMREDUCE_STRICT_BUILD") == "1":
    compile_args.append("-Werror")
if os.environ.get("SHMREDUCE_DEBUG_BUILD") == "1":
    compile_args += ["-UNDEBUG", "-g"]
if os.environ.get("SHMREDUCE_ASAN") == "1":
    compile_args += ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"]
    link_args += ["-fsanitize=address"]
if os.environ.get("SHMREDUCE_TSAN") == "1":
    compile_args += ["-fsanitize=thread", "-fno-omit-frame-pointer", "-O1", "-g"]
    link_args += ["-fsanitize=thread"]


class BuildNative(build_ext):
    """A build failure says what is missing, not only the compiler's exit status."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            raise SystemExit(
                f"shmreduce: building its C extension (shmreduce/_native/) failed: {exc}. "
                "shmreduce needs a C compiler (gcc or clang) and the Python development headers "
                "(Debian/Ubuntu: apt-get install gcc python3-dev)."
            ) from exc


setup(
    ext_modules=[
        Extension(
            "shmreduce._native",
            sorted(glob.glob("shmreduce/_native/*.c")),
            depends=["shmreduce/_native/native.h"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
