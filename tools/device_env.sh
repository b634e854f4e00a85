# Sourced by the one-call device scripts here: makes $OUT, installs the wheels carried in WHEEL_DIR (the
# jsonschema wheels for the device's Python, which has no network) into /tmp/site (once per folder, under a
# lock: scripts run side by side in one call share it), and puts this checkout on PYTHONPATH (nothing is
# pip-installed there). Exits the calling script if the wheels do not install.
# Usage, from a script in tools/:  source "$(dirname "$0")/device_env.sh" WHEEL_DIR
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls "${1:-.whl}"/*.whl >/dev/null 2>&1; then
  # once per wheel folder, under a lock: scripts started side by side in one call share /tmp/site
  _done=/tmp/site/.installed-$(basename "${1:-.whl}")
  mkdir -p /tmp/site && exec 9>/tmp/site.lock && { command -v flock >/dev/null && flock 9; }
  [ -e "$_done" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${1:-.whl}"/*.whl >/dev/null 2>&1 && touch "$_done"; } \
    || { echo "could not install the wheels in ${1:-.whl}"; exit 1; }
  exec 9>&-
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
