#!/usr/bin/env bash
# A cached virtual environment with a current PyTorch from PyPI, for the tests that run gradsync
# under the real torchrun and against torch's own TCPStore (tests/examples/torchrun.sh). Never a
# dependency of the library. Installs only what `import torch` and torchrun need on a machine
# without a GPU driver: the torch wheel without its ~3.5 GB of CUDA libraries, then the four
# libraries libtorch links against that Debian's CUDA does not provide (cuSPARSELt, NVSHMEM,
# cuFile, a recent NCCL), at the versions torch pins: about 2 GB, 1-3 minutes on a fast link.
#
#   scripts/torch_env.sh            install if missing; print the venv's python on stdout
#   GRADSYNC_TORCH_VENV=DIR         where (default ~/.cache/gradsync/torch-venv)
# Exit status 1, with the reason on stderr, when it cannot be installed (no network, no pip).
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -uo pipefail
venv=${GRADSYNC_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradsync/torch-venv}
python=$venv/bin/python
if [[ -f $venv/.ready ]] && "$python" -c 'import torch.distributed' 2>/dev/null; then
  echo "$python"
  exit 0
fi
fail() { echo "torch_env.sh: $*" >&2; exit 1; }
start=$(date +%s)
echo "torch_env.sh: installing PyTorch into $venv (once; about 2 GB)" >&2
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv" >&2 || fail "python3 -m venv failed (apt-get install python3-venv)"
pip=("$python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --no-deps torch >&2 || fail "pip could not install torch from PyPI (no network?)"
"${pip[@]}" filelock typing-extensions sympy networkx jinja2 fsspec numpy >&2 || fail "pip could not install torch's Python dependencies"
# The pins of the CUDA libraries libtorch is linked against, from torch's own metadata.
pins=$("$python" - <<'PY'
import importlib.metadata as m, re
wanted = ("nvidia-cusparselt", "nvidia-nvshmem", "nvidia-nccl", "cuda-toolkit")
for requirement in m.requires("torch") or []:
    spec = requirement.split(";")[0].strip()
    name = re.split(r"[\[<>=~! ]", spec, 1)[0]
    if name.startswith(wanted):
        if name == "cuda-toolkit":  # only its cuFile: libtorch_cuda links libcufile
            version = re.search(r"==\s*([^\s,;]+)", spec)
            spec = "cuda-toolkit[cufile]" + ("==" + version.group(1) if version else "")
        print(spec.replace(" ", ""))
PY
)
[[ -n $pins ]] && { "${pip[@]}" $pins >&2 || fail "pip could not install $pins"; }
"$python" -c 'import torch.distributed; torch.distributed.TCPStore' 2>/dev/null ||
  fail "torch does not import in $venv: $("$python" -c 'import torch' 2>&1 | tail -1)"
touch "$venv/.ready"
echo "torch_env.sh: torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null) ready in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)" >&2
echo "$python"
