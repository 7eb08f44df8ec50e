import pytest

from graphexec.capture.manifest import BucketEntry, Manifest, current_versions


def _manifest():
    return Manifest(model="tiny", dtype="bfloat16", gpu="test", versions=current_versions(),
                    max_batch=8, max_model_len=256, block_size=16,
                    buckets=[BucketEntry(b, 10.0, float(b), 0.0) for b in (1, 2, 4, 8)])


def test_roundtrip_and_budget(tmp_path):
    path = str(tmp_path / "m.json")
    _manifest().save(path)
    m = Manifest.load(path)
    assert [b.bucket for b in m.buckets] == [1, 2, 4, 8]
    assert m.buckets_within(None) == [1, 2, 4, 8]
    assert m.buckets_within(7.5) == [1, 2, 4]
    with pytest.raises(ValueError, match="graph_memory_mib"):
        m.buckets_within(0.5)


def test_bad_manifest(tmp_path):
    with pytest.raises(ValueError, match="manifest"):
        Manifest.load(str(tmp_path / "missing.json"))
    p = tmp_path / "bad.json"
    p.write_text('{"model": "x"}')
    with pytest.raises(ValueError, match="not a graphexec manifest"):
        Manifest.load(str(p))


def test_manifest_of_another_kernel_set_is_refused(tmp_path):
    from graphexec import Engine

    path = str(tmp_path / "m.json")
    _manifest().save(path)  # no kernels field given: the cuBLAS set (what manifests before it held)
    with pytest.raises(ValueError, match="captured with the 'cublas' kernels"):
        Engine("tiny", device="cpu", manifest=path, projections="auto")
    assert Manifest.load(path).kernels == "cublas"
