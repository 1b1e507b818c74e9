#!/usr/bin/env bash
# `pip install .` into a venv that already holds a torch within the declared range (an
# older one: PyPI's 2.9 or 2.11, as a GPU image carries) changes no installed package:
# the freeze before and after are the same, shmreduce aside. Needs a package index (pip
# builds in an isolated environment with setuptools), so `make test` does not run it.
# Usage: .ci/install_keeps_torch.sh VENV   (e.g. .venv-torch-2.11.0, from `make suite-torch`)
set -euo pipefail
venv=${1:?usage: $0 VENV}
pip=("$venv/bin/python" -m pip)
before=$(mktemp) after=$(mktemp)
trap 'rm -f "$before" "$after"' EXIT
"${pip[@]}" freeze --exclude shmreduce | sort >"$before"
"${pip[@]}" install -q .
"${pip[@]}" freeze --exclude shmreduce | sort >"$after"
"$venv/bin/python" -c "import shmreduce, torch; print('installed', shmreduce.__version__, 'beside torch', torch.__version__)"
"${pip[@]}" uninstall -y -q shmreduce
if ! diff -u "$before" "$after"; then
    echo "pip install . changed the packages above" >&2
    exit 1
fi
echo "pip install . changed no installed package ($(wc -l <"$before") in the freeze)"
