# Sourced by the py-spy scripts: PYSPY is the py-spy binary (given, or taken once from the wheel carried
# to the GPU machine in .gpu/spy: `pip download --no-deps -d .gpu/spy py-spy`).
PYSPY=${PYSPY:-/tmp/py-spy}
if [ ! -x "$PYSPY" ]; then
python3 - <<'PY'
import glob, zipfile
z = zipfile.ZipFile(glob.glob(".gpu/spy/*.whl")[0])
name = next(n for n in z.namelist() if n.endswith("/py-spy"))
open("/tmp/py-spy", "wb").write(z.read(name))
PY
chmod +x /tmp/py-spy
fi
