#!/usr/bin/env bash
# Installs what nixl-connect needs on a fresh Debian machine, idempotently:
#   - libclang (nixl-sys generates its bindings with bindgen at build time) and protoc (Debian's
#     protobuf-compiler: etcd-client, behind the etcd metadata channel, generates its gRPC code)
#   - the NIXL library from PyPI's nixl-cu13 wheel, unpacked into .nixl/ (ignored by git)
#   - with --interop: a Python venv (.venv/) holding Dynamo's dynamo.nixl_connect (ai-dynamo-runtime),
#     Dynamo's own callers and their tests (ai-dynamo, without its heavy optional dependencies), real
#     PyTorch (the PyPI wheel, CPU use only) and this project's nixl_connect wheel, built from source;
#     and Dynamo's next release (ai-dynamo + ai-dynamo-runtime 1.7.0.dev, no dependencies: it uses
#     .venv's) in .dynamo-next/, whose tests run on nixl_connect beside 1.6.1's
#   - with --nats: Debian's nats-server for the NATS channel tests
#   - with --etcd: Debian's etcd-server for the etcd channel tests (the tests start their own etcd)
#   - with --prometheus: Debian's prometheus (and promtool) for the metrics scrape tests (the tests
#     start their own server; the package's daemon is not needed)
# Usage: bash scripts/setup.sh [--interop] [--nats] [--etcd] [--prometheus]
set -euo pipefail
cd "$(dirname "$0")/.."
NIXL_VERSION=${NIXL_VERSION:-1.5.1}   # the pinned nixl-sys (=1.5.1); scripts/test-nixl-versions.sh sets others
NIXL_DIR=${NIXL_DIR:-.nixl}           # where that NIXL is unpacked
NIXL_WHEEL=${NIXL_WHEEL:-nixl-cu13}
DYNAMO_VERSION=1.6.1
DYNAMO_NEXT=1.7.0.dev20261026   # Dynamo's next release (PyPI pre-release), tested beside 1.6.1
TORCH_VERSION=2.15.0
want_interop=0; want_nats=0; want_etcd=0; want_prometheus=0
for a in "$@"; do
  case "$a" in
    --interop) want_interop=1 ;;
    --nats) want_nats=1 ;;
    --etcd) want_etcd=1 ;;
    --prometheus) want_prometheus=1 ;;
    *) echo "setup: unknown option $a" >&2; exit 2 ;;
  esac
done
say() { echo "setup: $*" >&2; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

apt_pkgs=()
# (grep reads all of ldconfig's output: `grep -q` would stop early and SIGPIPE ldconfig, a failure under pipefail)
if ! ldconfig -p 2>/dev/null | grep 'libclang\(-[0-9.]*\)\?\.so' >/dev/null; then apt_pkgs+=(libclang-dev); fi
if ! command -v protoc >/dev/null 2>&1; then apt_pkgs+=(protobuf-compiler); fi
if [ "$want_nats" = 1 ] && ! command -v nats-server >/dev/null 2>&1; then apt_pkgs+=(nats-server); fi
if [ "$want_etcd" = 1 ] && ! command -v etcd >/dev/null 2>&1; then apt_pkgs+=(etcd-server); fi
if ! command -v unzip >/dev/null 2>&1; then apt_pkgs+=(unzip); fi
# ip (network namespaces) and tc (the link tests' rate limit): iproute2.
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then apt_pkgs+=(iproute2); fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  say "installing ${apt_pkgs[*]} with apt-get"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
fi
if [ "$want_prometheus" = 1 ] && ! command -v prometheus >/dev/null 2>&1; then
  say "installing prometheus with apt-get"
  $SUDO apt-get update -qq >/dev/null
  # (no recommends: it recommends its node exporter, which nothing here needs; the package's own
  # daemon is not used, the tests start their own server)
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -f "$NIXL_DIR/lib/libnixl_capi.so" ]; then
  say "downloading ${NIXL_WHEEL}==${NIXL_VERSION} from PyPI into $NIXL_DIR/"
  rm -rf "$NIXL_DIR" && mkdir -p "$NIXL_DIR/wheel"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d "$NIXL_DIR/wheel" "${NIXL_WHEEL}==${NIXL_VERSION}"
  w=$(ls "$NIXL_DIR"/wheel/*.whl | head -n1)
  pkg=${NIXL_WHEEL//-/_}
  # Only the shared libraries: libnixl*, its plugins, UCX and their dependencies. Keep the wheel's
  # relative layout, which the libraries' RPATH ($ORIGIN/../<pkg>.libs) relies on.
  unzip -q -o "$w" ".${pkg}.mesonpy.libs/*" "${pkg}.libs/*" -d "$NIXL_DIR/"
  mv "$NIXL_DIR/.${pkg}.mesonpy.libs" "$NIXL_DIR/lib"
  # lib/ must see ../<pkg>.libs for RPATH $ORIGIN/../<pkg>.libs; it does (both under $NIXL_DIR/).
  rm -rf "$NIXL_DIR/wheel"
  echo "${NIXL_WHEEL}==${NIXL_VERSION}" > "$NIXL_DIR/VERSION"
fi

if [ "$want_interop" = 1 ] && [ ! -x .venv/bin/python ]; then
  say "creating .venv with ai-dynamo-runtime==${DYNAMO_VERSION} (dynamo.nixl_connect), nixl==${NIXL_VERSION}"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --no-deps "nixl==${NIXL_VERSION}" "${NIXL_WHEEL}==${NIXL_VERSION}" "ai-dynamo-runtime==${DYNAMO_VERSION}"
  .venv/bin/pip install -q numpy "pydantic>=2.10.6,<=2.13.5"
fi
if [ "$want_interop" = 1 ] && ! .venv/bin/python -c "import uvloop" >/dev/null 2>&1; then
  # ai-dynamo-runtime requires uvloop (installed above without its dependencies) and Dynamo runs its
  # workers on it: the Python module's tests and benchmarks run on it as well as on asyncio.
  say "installing uvloop into .venv"
  .venv/bin/pip install -q "uvloop>=0.21,<1"
fi
if [ "$want_interop" = 1 ] && ! .venv/bin/python -c "import torch, dynamo.common.multimodal" >/dev/null 2>&1; then
  # Dynamo's callers (dynamo.common.multimodal, trtllm, vllm omni) and the tests the ai-dynamo wheel
  # ships for them run against real torch. ai-dynamo is installed without its dependencies
  # (transformers, kubernetes, aisimulate, ... are not needed by these modules); the ones their
  # imports and tests need are named here. torch from PyPI pulls its CUDA libraries (~3 GB, about a
  # minute here); only its CPU side is used.
  say "installing torch==${TORCH_VERSION}, ai-dynamo==${DYNAMO_VERSION} and what its multimodal tests import into .venv"
  .venv/bin/pip install -q "torch==${TORCH_VERSION}"
  .venv/bin/pip install -q --no-deps "ai-dynamo==${DYNAMO_VERSION}"
  .venv/bin/pip install -q pillow msgspec safetensors "redis>=6.2,<9" "aiohttp>=3.14.3,<4" pyyaml "prometheus-client>=0.23.1,<1"
fi
if [ "$want_interop" = 1 ] && [ ! -f ".dynamo-next/VERSION" ]; then
  say "installing ai-dynamo==${DYNAMO_NEXT} and ai-dynamo-runtime==${DYNAMO_NEXT} into .dynamo-next/"
  rm -rf .dynamo-next
  .venv/bin/pip install -q --no-deps --pre --target .dynamo-next "ai-dynamo==${DYNAMO_NEXT}" "ai-dynamo-runtime==${DYNAMO_NEXT}"
  echo "$DYNAMO_NEXT" > .dynamo-next/VERSION
fi
if [ "$want_interop" = 1 ]; then
  # The Python module nixl_connect (crates/nixl-connect-py), built from source with maturin and
  # installed into .venv, plus what its tests run with.
  if [ ! -x .venv/bin/maturin ] || [ ! -x .venv/bin/pytest ] || ! .venv/bin/python -m ziglang version >/dev/null 2>&1; then
    say "installing maturin, ziglang, pytest and pytest-asyncio into .venv"
    .venv/bin/pip install -q "maturin>=1.8,<2" "ziglang>=0.13,<0.14" "pytest>=8" "pytest-asyncio>=0.24"
  fi
  bash scripts/build-wheel.sh target/wheels
  .venv/bin/pip install -q --force-reinstall --no-deps target/wheels/nixl_connect-*.whl
fi
say "ready (NIXL: $(cat "$NIXL_DIR/VERSION") in $(pwd)/$NIXL_DIR/lib)"
