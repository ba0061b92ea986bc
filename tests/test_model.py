"""The tiny offline model: byte-identical builds, small, and a tokenizer that round-trips any text."""

from tokenizers import Tokenizer

from kvscope.deploy.model import build, model_hash


def test_two_builds_are_byte_identical(tmp_path):
    first = build(tmp_path / "a")
    second = build(tmp_path / "b")
    assert first == second
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name
    assert model_hash(tmp_path / "a") == first


def test_another_seed_gives_another_model(tmp_path):
    assert build(tmp_path / "a", seed=0) != build(tmp_path / "b", seed=1)


def test_model_is_small_and_tokenizer_round_trips_bilingual_text(tmp_path):
    build(tmp_path / "m")
    total = sum(f.stat().st_size for f in (tmp_path / "m").iterdir())
    assert total <= 20 * 2**20
    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    text = "你好Passage 1: 人工智能是计算机科学的一个分支。 def f(x): return x"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.token_to_id("<|im_end|>") is not None
