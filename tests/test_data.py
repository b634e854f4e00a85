"""The embedded default data and the micro-batch stream."""

import numpy as np
import pytest

from engine.data import TokenBatches, load_tokens, stdlib_bytes


def test_stdlib_corpus_is_real_python_source():
    data = stdlib_bytes(200_000)
    assert len(data) == 200_000
    text = bytes(data[:200_000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_batches_are_deterministic_shifted_windows():
    tokens = np.arange(1000, dtype=np.int64) % 256
    a, b = TokenBatches(tokens, 16, 4, seed=7), TokenBatches(tokens, 16, 4, seed=7)
    for _ in range(3):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert (xa == xb).all() and (ya == yb).all()
        assert xa.shape == (4, 16) and (xa[:, 1:] == ya[:, :-1]).all()


def test_resume_state_and_rank_shards():
    tokens = np.arange(5000, dtype=np.int64) % 256
    a = TokenBatches(tokens, 8, 2, seed=1)
    next(a), next(a)
    b = TokenBatches(tokens, 8, 2, seed=1)
    b.load_state_dict(a.state_dict())
    assert (next(a)[0] == next(b)[0]).all()
    # rank r of N reads the micro-batch a single process reads at index i*N + r
    single = TokenBatches(tokens, 8, 2, seed=1)
    rank0, rank1 = TokenBatches(tokens, 8, 2, 1, rank=0, world_size=2), TokenBatches(tokens, 8, 2, 1, 1, 2)
    s = [next(single)[0] for _ in range(4)]
    assert (next(rank0)[0] == s[0]).all() and (next(rank1)[0] == s[1]).all()
    assert (next(rank0)[0] == s[2]).all() and (next(rank1)[0] == s[3]).all()


def test_text_and_token_files(tmp_path):
    (tmp_path / "t.txt").write_text("hello world " * 100)
    assert load_tokens("text", str(tmp_path / "t.txt"), "uint16", 1 << 20, 256)[0] == ord("h")
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "tok.bin")
    assert load_tokens("tokens", str(tmp_path / "tok.bin"), "uint16", 1 << 20, 512)[299] == 299
    with pytest.raises(ValueError, match="model.vocab_size=256"):
        load_tokens("tokens", str(tmp_path / "tok.bin"), "uint16", 1 << 20, 256)
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_tokens("text", str(tmp_path / "missing.txt"), "uint16", 1 << 20, 256)
