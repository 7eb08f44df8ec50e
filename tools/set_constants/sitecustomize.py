"""Sets module constants in every Python process that has this folder on PYTHONPATH, the
tensor-parallel workers included, from GRAPHEXEC_SET="package.module.NAME=value; ...". Values
are Python literals. For comparing a constant's settings in tools/bench.py at
tensor_parallel_size > 1, whose workers are new processes that a flag of the bench would not
reach (tools/decode_variants.py does the same on one GPU, in its own process). Only constants a
module reads at call time take effect; each must already exist. Example:

    GRAPHEXEC_SET="graphexec.kernels.attention_triton.SPLIT_WAVES=3" \\
        PYTHONPATH=tools/set_constants python tools/bench.py decode --models llama-8b --tp 2
"""
import ast
import importlib
import os
import sys


def _apply(spec: str) -> None:
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        target, eq, value = item.partition("=")
        module_name, _, name = target.strip().rpartition(".")
        if not eq or not module_name:
            raise SystemExit(f"GRAPHEXEC_SET: {item!r} is not package.module.NAME=value")
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"GRAPHEXEC_SET: {module_name} has no {name}")
        setattr(module, name, ast.literal_eval(value.strip()))
        print(f"GRAPHEXEC_SET: {module_name}.{name} = {value.strip()}", file=sys.stderr)


_apply(os.environ.get("GRAPHEXEC_SET", ""))
