# Sourced by the one-call device scripts here: makes $OUT, installs the wheels carried in WHEEL_DIR (the
# jsonschema wheels for the device's Python, which has no network) into /tmp/site, and puts this checkout on
# PYTHONPATH (nothing is pip-installed there). Exits the calling script if the wheels do not install.
# Usage, from a script in tools/:  source "$(dirname "$0")/device_env.sh" WHEEL_DIR
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls "${1:-.whl}"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${1:-.whl}"/*.whl \
    >/dev/null 2>&1 || { echo "could not install the wheels in ${1:-.whl}"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
