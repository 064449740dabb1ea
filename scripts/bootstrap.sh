#!/usr/bin/env bash
# Creates (or reuses) the virtual environment that `make demo` and `make test` run in.
#   - torch already importable there (a GPU machine's own build, visible through
#     --system-site-packages): it is kept as it is.
#   - else, with an NVIDIA GPU: the normal (CUDA) build from the package index.
#   - else: the CPU build `torch==$LGH_CPU_TORCH` (2.13.0). On the project's development and CI
#     machines that version's CPU wheel lies on disk; elsewhere pass an index that serves CPU wheels,
#     e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
# Then the package itself, editable, with the extras in $LGH_EXTRAS (dev,nvtx,ao by default: the tests exercise torchao's module conversion on the CPU).
set -euo pipefail
venv=${1:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
if "$py" -c "import torch" 2>/dev/null; then
  echo "bootstrap: using the installed torch $("$py" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "bootstrap: NVIDIA GPU found, installing the CUDA build of torch"
  "${pip[@]}" "torch>=2.5" ${TORCH_PIP_ARGS:-}
else
  echo "bootstrap: no GPU, installing the CPU build torch==${LGH_CPU_TORCH:-2.13.0}"
  "${pip[@]}" "torch==${LGH_CPU_TORCH:-2.13.0}" ${TORCH_PIP_ARGS:-}
fi
"${pip[@]}" -e ".[${LGH_EXTRAS:-dev,nvtx,ao}]"
"$py" -c "import lightning_gh, lightning, torch; print('bootstrap: lightning_gh', lightning_gh.__version__, '| lightning', lightning.__version__, '| torch', torch.__version__)"
