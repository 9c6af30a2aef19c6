from raytrain_lm.tokenizer import ByteTokenizer, tokenizer_from_spec


def test_byte_round_trip_of_any_text():
    tok = ByteTokenizer()
    for text in ["", "hello", "naïve café — 東京 🙂\n\ttabs", "def f(x):\n    return x ** 2\n"]:
        ids = tok.encode(text)
        assert ids.max(initial=0) < tok.vocab_size
        assert tok.decode(ids) == text


def test_spec_round_trip():
    tok = ByteTokenizer()
    again = tokenizer_from_spec(tok.spec())
    assert again.vocab_size == 256 and again.decode(tok.encode("abc")) == "abc"
