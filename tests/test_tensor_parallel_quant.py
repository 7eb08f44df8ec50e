"""Quantized weights under tensor parallelism (CPU, gloo): a compressed-tensors checkpoint's
scales and groups sliced with their channels give a size-2 engine the outputs of one process;
weights quantized at load and an fp8 KV cache run at size 2, async equal to sync."""
import pytest

pytest.importorskip("compressed_tensors")

from ct_helpers import write_ct_checkpoint  # noqa: E402
from test_tensor_parallel import assert_same_outputs, mixed_requests, run  # noqa: E402


@pytest.mark.parametrize("scheme, ignore", [("FP8_DYNAMIC", ("lm_head",)),
                                            ("W4A16_ASYM", ("lm_head",)),
                                            ("FP8_DYNAMIC", ())])  # the LM head split too
def test_a_checkpoint_split_over_two_ranks_decodes_as_one(tmp_path, scheme, ignore):
    path = str(tmp_path)
    # groups of 32: o's 128 input columns split 64 a rank, whole groups each
    write_ct_checkpoint(path, scheme, group_size=32 if scheme.startswith("W4") else None,
                        ignore=ignore)
    want, _ = run(1, mixed_requests, model=path)
    got, _ = run(2, mixed_requests, model=path)
    assert_same_outputs(got, want)


def test_fp8_weights_and_kv_cache_at_size_2_async_equal_sync():
    opts = dict(quantization="fp8", kv_cache_dtype="fp8")
    sync, _ = run(2, mixed_requests, async_scheduling=False, **opts)
    got, _ = run(2, mixed_requests, async_scheduling=True, **opts)
    assert_same_outputs(got, sync)
