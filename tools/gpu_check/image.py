"""What the lent GPU machine's image holds, against what the project needs: which packages must travel.

IMAGE is the Python package list of the `nvidia-h200` image (the device tool's KINDS.md, "Python packages
already there", read 2026-11-17; python3 is Python 3.12, torch 2.11 CUDA 13.0). `needed()` reads
pyproject.toml: the runtime dependencies and the test extra. `missing()` says which of them the image lacks:
required ones travel as wheels (tools/gpu-wheels downloads them, tools/gpu-check installs them there), optional
ones (the test extra) stay behind and the tests that need them skip (`pytest.importorskip`). In a dry run the
check hides exactly those (`hide/`), so this machine collects and runs what the image would.

Does not know: pip, the registry, the device tool.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
IMPORT_NAMES = {"pyyaml": "yaml", "huggingface-hub": "huggingface_hub", "pexpect": "pexpect"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(lines: list[str]) -> list[str]:
    return [canonical(re.split(r"[<>=!~;\[ ]", d.strip(), maxsplit=1)[0]) for d in lines if d.strip()]


def needed() -> tuple[list[str], list[str]]:
    """(the runtime dependencies, the test extra's) named in pyproject.toml, canonical names."""
    text = (ROOT / "pyproject.toml").read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads(text)["project"]
        return _requirements(project["dependencies"]), _requirements(project["optional-dependencies"]["test"])
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    test = re.search(r"^test = \[(.*?)^\]", text, re.S | re.M).group(1)
    quoted = lambda block: re.findall(r'"([^"]+)"', block)          # noqa: E731
    return _requirements(quoted(deps)), _requirements(quoted(test))


def missing() -> tuple[list[str], list[str]]:
    """(required packages the image lacks: they travel as wheels, optional test packages it lacks: skipped)."""
    required, test = needed()
    return [p for p in required if p not in IMAGE], [p for p in test if p not in IMAGE and p not in required]


def import_name(package: str) -> str:
    """The top-level module a distribution installs (pyyaml -> yaml)."""
    return IMPORT_NAMES.get(package, package.replace("-", "_"))
