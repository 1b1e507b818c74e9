#!/usr/bin/env bash
# `pip install .` beside a torch within the declared range (an older one: PyPI's 2.9 or 2.11,
# as a GPU image carries) changes no installed package: the freeze before and after are the
# same, shmreduce aside. Needs a package index (pip builds in an isolated environment with
# setuptools), so `make test` does not run it: `make install-check TORCH=2.11.0` does.
# Usage: .ci/install_keeps_torch.sh VENV   (e.g. .venv-torch-2.11.0, from `make suite-torch`)
# VENV itself is left as it is: pip installs into a throwaway venv that sees VENV's packages
# (a .pth file), so it meets VENV's torch as installed, exactly as in VENV.
set -euo pipefail
venv=${1:?usage: $0 VENV}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m venv "$work/venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$work/venv/bin/python" -c 'import sysconfig, sys; open(sysconfig.get_path("purelib") + "/beside.pth", "w").write(sys.argv[1] + "\n")' "$site"
pip=("$work/venv/bin/python" -m pip)
"${pip[@]}" freeze --exclude shmreduce | sort >"$work/before"
"${pip[@]}" install -q .
"${pip[@]}" freeze --exclude shmreduce | sort >"$work/after"
(cd "$work" && "$work/venv/bin/python" -c "import shmreduce, torch; print('installed', shmreduce.__version__, 'beside torch', torch.__version__)")
if ! diff -u "$work/before" "$work/after"; then
    echo "pip install . changed the packages above" >&2
    exit 1
fi
echo "pip install . changed no installed package ($(wc -l <"$work/before") in the freeze)"
