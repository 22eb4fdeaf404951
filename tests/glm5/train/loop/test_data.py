import pytest
import torch

from glm5.train.loop.data import EOS_ID, ByteCorpus, decode


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    for i in range(40):
        (root / f"m{i:02d}.py").write_text(f"# module {i}\n" + "x = 1\n" * (i + 20))
    (root / "empty.py").write_text("")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "skip.py").write_text("not stdlib\n")
    return root


def test_bytes_eos_and_heldout_split_by_file(tree):
    c = ByteCorpus(tree, heldout_every=4)
    assert set(c.files[True]).isdisjoint(c.files[False])
    assert len(c.files[True]) + len(c.files[False]) == 41  # site-packages skipped
    for split, toks in ((False, c.train), (True, c.heldout)):
        assert int((toks == EOS_ID).sum()) == len(c.files[split])
        assert int(toks.min()) >= 0 and int(toks.max()) <= EOS_ID
    first = c.files[False][0]
    assert decode(c.train[: (tree / first).stat().st_size].tolist()) == (tree / first).read_text()


def test_batches_are_a_function_of_seed_and_step(tree):
    c = ByteCorpus(tree, heldout_every=4)
    a = c.batch(3, 16, seed=1, step=5)
    assert a.shape == (3, 16) and a.dtype == torch.int64
    assert torch.equal(a, c.batch(3, 16, seed=1, step=5))
    assert not torch.equal(a, c.batch(3, 16, seed=1, step=6))
    h1, h2 = c.heldout_batches(2, 16, 2), c.heldout_batches(2, 16, 2)
    assert len(h1) == 2 and all(torch.equal(x, y) for x, y in zip(h1, h2))


def test_stdlib_is_the_default_source():
    c = ByteCorpus(max_bytes=64 << 10)
    assert c.train.numel() >= 64 << 10 and c.heldout.numel() > 0
    assert any(f.endswith(".py") for f in c.files[False])


def test_bad_arguments(tree, tmp_path):
    with pytest.raises(ValueError, match="heldout_every"):
        ByteCorpus(tree, heldout_every=1)
    with pytest.raises(FileNotFoundError, match="root"):
        ByteCorpus(tmp_path)
    with pytest.raises(ValueError, match="n_batches"):
        ByteCorpus(tree, heldout_every=4).heldout_batches(1, 1 << 20, 1)
