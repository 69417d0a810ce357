#!/usr/bin/env bash
# Here, after ../shared/gpu/prepare: a third part, .gpu/p3, with the proofs'
# solvers (z3-solver, crosshair-tool and their dependencies, for the GPU
# machine's Python 3.12), so that `kvspec verify --device gpu` runs the Z3
# obligations, the equivalent-mutant checks and CrossHair there too (without
# them those jobs fail with "Z3 is not installed"). About 39 MiB: one transfer.
#
# There, after .gpu/p2's stage (same machine, the next call):
#   bash .gpu/p3/stage && . /tmp/kvgpu/env && ...
# The stage installs the wheels into /tmp/kvgpu/extras and adds that folder
# to the end of the PYTHONPATH that /tmp/kvgpu/env sets (the GPU machine's own
# packages and MLX's wheels come first).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -d .gpu/p2 ] || { echo "gpu_extras: run ../shared/gpu/prepare first (no .gpu/p2)" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
versions=$("$PY" -c 'import importlib.metadata as m; print(m.version("crosshair-tool"), m.version("z3-solver"))')
read -r crosshair z3 <<< "$versions"
plat="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in 35 34 31 28 27 17; do plat="$plat --platform manylinux_2_${p}_x86_64"; done
plat="$plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
rm -rf .gpu/p3 && mkdir -p .gpu/p3
"$PY" -m pip download --quiet $plat -d .gpu/p3 "crosshair-tool==$crosshair" "z3-solver==$z3" 2>&1 \
  | grep -v '^WARNING: Location' || true
ls .gpu/p3/z3_solver-*.whl .gpu/p3/crosshair_tool-*.whl > /dev/null
cat > .gpu/p3/stage <<'STAGE'
#!/usr/bin/env bash
# Runs on the GPU machine after .gpu/p2's stage: the solvers into /tmp/kvgpu/extras.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=/tmp/kvgpu
[ -f $K/env ] || { echo "stage 3: run .gpu/p1's and .gpu/p2's stages on this machine first"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $K/extras "$here"/*.whl
grep -q "$K/extras" $K/env || sed -i "1s|\$|:$K/extras|" $K/env
PYTHONPATH=$K/extras python3 -c "import z3, crosshair; print('stage 3 done: z3', z3.get_version_string(), 'and crosshair on PYTHONPATH')"
STAGE
du -sh .gpu/p3
echo "ready: .gpu/p3 (z3-solver $z3, crosshair-tool $crosshair): send it after .gpu/p2 and run bash .gpu/p3/stage"
