"""A class's shared model cache (README, "A hosted class"): root prepares SmolLM2 once into
DECODELAB_CACHE and every student's kernel reads it there, read-only. Once prepared, finding the
model must write nothing: no lock file, no conversion, nothing in the student's own home."""

from __future__ import annotations

from pathlib import Path

import pytest

from decodelab.model import registry
from decodelab.paths import cache_dir


def _prepared(folder: Path) -> Path:
    target = folder / registry.SMOLLM2_DIR_NAME
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"")  # its presence is what "prepared" means
    return target


def test_decodelab_cache_moves_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path / "shared"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    assert cache_dir() == tmp_path / "shared"
    monkeypatch.delenv("DECODELAB_CACHE")
    assert cache_dir() == tmp_path / "home-cache" / "decodelab"


def test_a_prepared_shared_cache_is_only_read(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    target = _prepared(shared)
    before = sorted(p.relative_to(shared) for p in shared.rglob("*"))
    monkeypatch.setenv("DECODELAB_CACHE", str(shared))
    monkeypatch.setenv("HOME", str(tmp_path / "student"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_write(*args, **kwargs):
        raise AssertionError("a prepared cache was written to (lock or conversion)")

    monkeypatch.setattr(registry, "_exclusive", no_write)
    import decodelab.model.gguf_import as gguf_import

    monkeypatch.setattr(gguf_import, "convert_gguf", no_write)
    assert registry.prepare_smollm2(progress=False) == target
    assert registry.resolve_model("smollm2") == target
    assert sorted(p.relative_to(shared) for p in shared.rglob("*")) == before
    assert not (tmp_path / "student").exists()


def test_an_unprepared_cache_would_be_written(tmp_path, monkeypatch):
    """The other side of the test above: without the prepared folder, the lock is taken (so a
    read-only shared cache must be prepared by root before the class starts)."""
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path / "empty"))

    class Taken(Exception):
        pass

    def taken(*args, **kwargs):
        raise Taken

    monkeypatch.setattr(registry, "_exclusive", taken)
    with pytest.raises(Taken):
        registry.prepare_smollm2(progress=False)
