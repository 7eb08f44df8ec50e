"""Checkpoints written by the compressed-tensors library itself (the oracle of
graphexec/model/compressed.py): a small random HF model, its Linear layers quantized by the
library's own qparams and compressor, saved as llm-compressor saves them; and the weights the
library decompresses them to."""
import os

import torch

from conftest import make_hf_model

# preset scheme -> the compressed-tensors format it is saved in
SCHEMES = {"FP8_DYNAMIC": "float-quantized", "FP8": "float-quantized",
           "W4A16": "pack-quantized", "W4A16_ASYM": "pack-quantized"}


def _observe(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of the weight over each of the scheme's scale's elements."""
    w = weight.detach().float()
    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        return g.amin(2), g.amax(2)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    return w.min().reshape(1), w.max().reshape(1)


def write_ct_checkpoint(path: str, scheme: str, seed: int = 0, group_size: int | None = None,
                        ignore: tuple[str, ...] = ("lm_head",)
                        ) -> tuple[object, dict[str, torch.Tensor]]:
    """(the dense HF model before quantization, module name -> the weight the library
    decompresses the saved checkpoint's module to). ignore: the modules left dense."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig,
                                                  apply_quantization_config,
                                                  preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    dense = make_hf_model(path, "llama", seed=seed)
    import copy

    hf = copy.deepcopy(dense)
    sch = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None:
        sch.weights.group_size = group_size
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": sch},
                                                     ignore=list(ignore)), show_progress=False)
    with torch.no_grad():
        for _, m in hf.named_modules():
            s = getattr(m, "quantization_scheme", None)
            if s is None:
                continue
            scale, zero = calculate_qparams(*_observe(m.weight, s.weights), s.weights)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(zero.reshape(m.weight_zero_point.shape))
            if hasattr(m, "input_scale"):  # static fp8 activations: any calibrated value
                m.input_scale.fill_(0.05)
    comp = ModelCompressor.from_pretrained_model(hf, SCHEMES[scheme])
    comp.compress_model(hf)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              os.path.join(path, "model.safetensors"))
    comp.update_config(path)
    comp.decompress_model(hf)
    return dense, {name: m.weight.detach().float().clone() for name, m in hf.named_modules()
                   if getattr(m, "quantization_scheme", None) is not None}
