"""The embedded target (models/embedded.py): its conversion draws no third-party progress bar, and a cache
it cannot write to is said before the conversion starts."""

from __future__ import annotations

import io

import pytest


def test_the_gguf_reader_draws_no_bar_while_we_convert(monkeypatch):
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as reader

    from dsparkctl.models import embedded

    stream = io.StringIO()
    monkeypatch.setattr(reader, "tqdm", lambda it, **kw: tqdm(it, file=stream, **kw))
    real = reader.tqdm
    with embedded._no_converter_bar():
        assert list(reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")) == [0, 1, 2]
    assert stream.getvalue() == "" and reader.tqdm is real  # put back afterwards
    with pytest.raises(KeyError), embedded._no_converter_bar():
        raise KeyError("a failed conversion")
    assert reader.tqdm is real


def test_an_unwritable_dsparkctl_cache_is_said_before_the_conversion(tmp_path, monkeypatch):
    from dsparkctl.errors import InputError
    from dsparkctl.models import embedded

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DSPARKCTL_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(embedded, "gguf_path", lambda: tmp_path / "model.gguf")
    with pytest.raises(InputError, match=f"cannot be converted into {tmp_path}/file/cache/.*is not a folder"):
        embedded.embedded_target_dir(log=lambda m: pytest.fail("started converting"))
