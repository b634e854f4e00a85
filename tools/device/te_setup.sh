#!/usr/bin/env bash
# Install Transformer Engine 2.20.2 on the device (no network there) from what travels in carry:
#   .te/   transformer_engine-2.20.2 (the meta package), pydantic and its needs as wheels;
#          te_cu13_sm90.tar.xz: the transformer_engine_cu13 wheel's files, its core library's cubins for
#          every architecture but sm_90 zeroed (tools/device/fatbin_keep_arch.py: 276 MB wheel -> 27 MB), and
#          transformer_engine_torch-2.20.2.tar.gz, the sdist of TE's torch extension, built here against
#          the device's torch into .te/transformer_engine_torch-*.whl (and $OUT), which later calls carry.
# Usage on the device from the repo root: source tools/device/te_setup.sh   (sets PYTHONPATH=/tmp/site:$PWD)
set -o pipefail
SITE=/tmp/site
REPO=$PWD
mkdir -p "$SITE"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  $(ls .te/*.whl | grep -v transformer_engine_torch)
tar xJf .te/te_cu13_sm90.tar.xz -C "$SITE"
export PYTHONPATH=$SITE:$PWD
# a warm machine keeps /tmp between calls, while the carried .te replaces the repo's copy: keep the built wheel there
ls .te/transformer_engine_torch-*.whl >/dev/null 2>&1 || cp /tmp/te_wheel/transformer_engine_torch-*.whl .te/ 2>/dev/null
if ! ls .te/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  # no wheel of the extension built earlier: build one (about 100 s on the device's 16 cores)
  rm -rf /tmp/tebuild && mkdir -p /tmp/tebuild && tar xzf .te/transformer_engine_torch-*.tar.gz -C /tmp/tebuild
  # cuDNN and NCCL headers come from the nvidia-* wheels beside torch, not from the CUDA toolkit
  CPATH=$(python3 -c "import nvidia, glob; print(':'.join(glob.glob(nvidia.__path__[0] + '/*/include')))")
  export CPATH
  export NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 NVTE_WITH_NCCL_EP=0 NVTE_NO_LOCAL_VERSION=1
  export MAX_JOBS=${MAX_JOBS:-16}
  (cd /tmp/tebuild/transformer_engine_torch-* &&
   python3 -m pip wheel --no-build-isolation --no-deps --no-index --no-cache-dir -w "$REPO/.te" . \
     > /tmp/te_build.log 2>&1) || { echo "TE extension build FAILED after $(( $(date +%s) - t0 )) s"; tail -40 /tmp/te_build.log; return 1 2>/dev/null || exit 1; }
  [ -n "$OUT" ] && cp .te/transformer_engine_torch-*.whl /tmp/te_build.log "$OUT"/
  mkdir -p /tmp/te_wheel && cp .te/transformer_engine_torch-*.whl /tmp/te_wheel/
fi
# its wheel puts the .so under transformer_engine/: install aside and merge, as --target --upgrade would
# replace the whole transformer_engine folder
rm -rf /tmp/te_ext && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/te_ext \
  .te/transformer_engine_torch-*.whl && cp -r /tmp/te_ext/. "$SITE"/
echo "TE installed in $(( $(date +%s) - t0 )) s"
python3 -c "import transformer_engine.pytorch as te, transformer_engine; print('transformer_engine', transformer_engine.__version__, 'imports')" 2>&1 | tail -3
