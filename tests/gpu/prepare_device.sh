#!/usr/bin/env bash
# Prepares the hardware check's device call (../shared/GPU.md) on a networked machine, and proves it here.
#
#   tests/gpu/prepare_device.sh [--dry-run]
#
# 1. Downloads the wheels the reference GPU image lacks (Python 3.12, x86-64): pyzmq, wasmtime 50.0.1 and
#    nvmath-python 1.0.0 into .whl/; cuda-core 1.2.2 and cuda-pathfinder 1.9.1 into .whl-extra/ (check.sh
#    adds those only when nvmath does not import with the device's own cuda-core). Both directories are
#    excluded from git (.git/info/exclude) and travel through the device call's `carry`.
# 2. Proves they install for CPython 3.12 on manylinux x86-64 (pip --target, no index, no deps).
# 3. Adds up what the device call sends - tracked files, untracked files git does not ignore, and the two
#    carried directories - against the call's 64 MiB limit; exit 1 when over.
# 4. With --dry-run: clones this repository's committed HEAD into a fresh directory and runs
#    tests/gpu/check.sh there on the fake driver (--dry-run-fake --quick) with $PYTHON (default: this
#    checkout's .venv): every phase of the check, from a fresh clone, as the device would start it. The
#    wheels are not installed in that run (they are for Python 3.12; step 2 proved them); the venv's
#    packages stand in.
#
# Then the one device call (GPU.md): run(carry=[".whl", ".whl-extra"], timeout_s=450, command=...).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
LIMIT=$((64 * 1024 * 1024))
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PIP_TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in /.whl/ /.whl-extra/; do
    grep -qxF "$d" "$exclude" 2> /dev/null || echo "$d" >> "$exclude"
done

fetch() {  # fetch DIR SPEC...: the wheels, unless DIR already holds one per spec
    local dir=$1; shift
    mkdir -p "$dir"
    python3 -m pip download -q --no-deps "${PIP_TARGET[@]}" -d "$dir" "$@"
}
fetch .whl pyzmq wasmtime==50.0.1 nvmath-python==1.0.0
fetch .whl-extra cuda-core==1.2.2 cuda-pathfinder==1.9.1
ls -l .whl .whl-extra

probe=$(mktemp -d /tmp/twt-wheel-probe.XXXXXX)
trap 'rm -rf "$probe"' EXIT
python3 -m pip install -q --no-index --no-deps "${PIP_TARGET[@]}" --target "$probe/site" .whl/*.whl
python3 -m pip install -q --no-index --no-deps "${PIP_TARGET[@]}" --target "$probe/extra" .whl-extra/*.whl
echo "prepare_device: the wheels install for CPython 3.12 manylinux x86-64"

# what travels: tracked + untracked-not-ignored files, and the carried directories
sent=$( (git ls-files -z --cached --others --exclude-standard; find .whl .whl-extra -type f -print0) \
        | xargs -0 -r stat -c %s -- 2> /dev/null | awk '{s += $1} END {print s + 0}')
printf 'prepare_device: the device call sends %.1f MiB of %d MiB\n' "$(echo "$sent / 1048576" | bc -l)" $((LIMIT >> 20))
if (( sent > LIMIT )); then
    echo "prepare_device: over the device call's 64 MiB limit" >&2
    exit 1
fi

if [[ "${1:-}" == "--dry-run" ]]; then
    clone="$probe/clone"
    git clone -q --no-hardlinks "$ROOT" "$clone"
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    echo "prepare_device: tests/gpu/check.sh on the fake driver from a fresh clone of $(git rev-parse --short HEAD), $PY"
    (cd "$clone" && PYTHON=$PY GPU_CHECK_SITE="$probe/check-site" bash tests/gpu/check.sh --dry-run-fake --quick \
        --json-out "$probe/gpu-check.json")
    "$PY" - "$probe/gpu-check.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
print(f"prepare_device: dry run ok={doc['ok']}, phases: {', '.join(doc['phases'])}")
sys.exit(0 if doc["ok"] else 1)
EOF
fi
