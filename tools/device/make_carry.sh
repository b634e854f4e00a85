#!/usr/bin/env bash
# Rebuild the git-ignored folders the device scripts carry (the device has no network; a fresh checkout has none
# of them), on this machine, from PyPI, for the device's Python 3.12 on x86_64:
#   .whl/        megatron-core 0.19.2 and jsonschema with its needs (every GPU script)
#   .whl-peers/  deepspeed (a wheel built here from its sdist, no ops compiled: its CPU Adam builds on the device),
#                torchao, hjson, pydantic and its needs (tools/peers_gpu.sh)
#   .te/         Transformer Engine 2.20.2 as tools/device/te_setup.sh installs it: the meta package and pydantic
#                wheels, te_cu13_sm90.tar.xz (the cu13 wheel's files, its core library cut to sm_90 by
#                fatbin_keep_arch.py) and the sdist of TE's torch extension, which te_setup.sh builds on the device
# Usage from the repo root, in a venv with torch (deepspeed's setup imports it):  bash tools/device/make_carry.sh [whl|peers|te ...]
set -euo pipefail
PARTS=${*:-"whl peers te"}
PY=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
get() { dir=$1; shift; mkdir -p "$dir"; pip download -q --no-deps "${PY[@]}" -d "$dir" "$@"; }
# an sdist as PyPI serves it, unbuilt (pip download would run its setup, which needs CUDA for TE's extension)
sdist() { python3 - "$@" <<'PY'
import re, sys, urllib.request
name, version, dest = sys.argv[1:]
page = urllib.request.urlopen(f"https://pypi.org/simple/{name}/").read().decode()
stem = name.replace("-", "_")
found = {}  # release -> its sdist's address
for u in re.findall(r'href="([^"#]+)', page):
    hit = re.search(rf"/{stem}-([0-9]+(?:\.[0-9]+)*)\.tar\.gz$", u, re.I)
    if hit:
        found[tuple(map(int, hit.group(1).split(".")))] = u
url = found[tuple(map(int, version.split(".")))] if version else found[max(found)]  # newest final release
urllib.request.urlretrieve(url, f"{dest}/{url.rsplit('/', 1)[1]}")
PY
}
for part in $PARTS; do
  case $part in
    whl)
      get .whl megatron-core==0.19.2 jsonschema jsonschema-specifications referencing rpds-py attrs typing-extensions ;;
    peers)
      get .whl-peers torchao hjson pydantic pydantic-core annotated-types typing-inspection
      rm -rf /tmp/ds_sdist && mkdir -p /tmp/ds_sdist
      sdist deepspeed "" /tmp/ds_sdist
      DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation -w .whl-peers /tmp/ds_sdist/deepspeed-*.tar.gz ;;
    te)
      get .te transformer-engine==2.20.2 pydantic pydantic-core annotated-types typing-inspection
      rm -f .te/transformer_engine_cu13-*.whl
      sdist transformer-engine-torch 2.20.2 .te
      rm -rf /tmp/te_cu13 && mkdir -p /tmp/te_cu13/dl /tmp/te_cu13/site
      get /tmp/te_cu13/dl transformer-engine-cu13==2.20.2
      (cd /tmp/te_cu13/site && python3 -m zipfile -e ../dl/transformer_engine_cu13-*.whl .)
      lib=$(find /tmp/te_cu13/site -name 'libtransformer_engine.so' | head -1)
      python3 tools/device/fatbin_keep_arch.py "$lib" "$lib.sm90" --keep 90 && mv "$lib.sm90" "$lib"
      tar cJf .te/te_cu13_sm90.tar.xz -C /tmp/te_cu13/site . ;;
    *) echo "unknown part $part (whl, peers, te)"; exit 2 ;;
  esac
done
du -sh .whl .whl-peers .te 2>/dev/null || true
