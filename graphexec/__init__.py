"""graphexec: decode Llama-family models from a paged KV cache, one CUDA graph per iteration."""
import importlib.util
import os
import sys


def _map_source_folders() -> None:
    # capture/ and kernels/ install as graphexec.capture and graphexec.kernels (pyproject's
    # package-dir). When the package runs from a source tree that was not installed that way,
    # map them by hand so imports work the same.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("kernels", "capture"):
        full = f"{__name__}.{name}"
        if full in sys.modules or importlib.util.find_spec(full) is not None:
            continue
        folder = os.path.join(root, name)
        spec = importlib.util.spec_from_file_location(
            full, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])
        if spec is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)


_map_source_folders()

from .engine import Engine  # noqa: E402
from .llm import LLM  # noqa: E402
from .outputs import RequestOutput, TokenLogprob  # noqa: E402
from .parallel import TensorParallelError  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402
from .spec import SpeculativeConfig  # noqa: E402
from .structured import StructuredOutputsParams  # noqa: E402

__all__ = ["Engine", "LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig",
           "StructuredOutputsParams", "TensorParallelError", "TokenLogprob"]
