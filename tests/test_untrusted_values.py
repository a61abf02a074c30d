"""untrusted.py's readers, value by value: what another process wrote is parsed as JSON of our shape and size, or
refused with ValueError in a few words; text from it is made printable. (Whole processes sending such values:
test_untrusted.py.)"""

import json

import pytest

from mnist_ddp.common import untrusted


@pytest.mark.parametrize(("text", "shown"), [
    ("plain words", "plain words"), ("\x1b[2J", "\\x1b[2J"), ("a\nb\rc\td", "a\\nb\\rc\\td"),
    ("bidi\u202eevil", "bidi\\u202eevil"), ("line\u2028sep\u2029para", "line\\u2028sep\\u2029para"),
    ("café ✓", "café ✓"),
])
def test_printable_escapes_control_and_format_characters(text: str, shown: str) -> None:
    assert untrusted.printable(text) == shown


def test_printable_cuts_at_its_limit() -> None:
    assert untrusted.printable("x" * 10, limit=10) == "x" * 10
    assert untrusted.printable("x" * 11, limit=10) == "x" * 10 + "…"
    assert untrusted.printable("\x1b" * 5, limit=2) == "\\x1b\\x1b…"


def test_text_decodes_what_is_utf8_and_escapes_what_is_not() -> None:
    assert untrusted.text("é\x1b".encode() + b"\xff") == "é\\x1b\\xff"
    assert untrusted.text(b"y" * 50, limit=40) == "y" * 40 + "…"


def test_parse() -> None:
    assert untrusted.parse(b'{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ValueError, match=r"^not JSON: '\{nope'$"):
        untrusted.parse(b"{nope")
    with pytest.raises(ValueError, match="not JSON"):
        untrusted.parse(b"\xff\xfe")
    with pytest.raises(ValueError, match="nested deeper than Python can read"):
        untrusted.parse(b"[" * 100_000)


FIELDS = {"name": str, "n": int, "on": bool, "either": (int, str)}
GOOD = {"name": "x\x1bz", "n": 3, "on": True, "either": "s", "extra": "\x07"}


def test_record_reads_fields_of_their_types_and_shows_text_printably() -> None:
    got = untrusted.record(json.dumps(GOOD).encode(), FIELDS)
    assert got == {"name": "x\\x1bz", "n": 3, "on": True, "either": "s", "extra": "\\x07"}
    assert untrusted.record(json.dumps(GOOD | {"name": "y" * 20}).encode(), FIELDS, limit=5)["name"] == "yyyyy…"


@pytest.mark.parametrize(("raw", "said"), [
    (json.dumps(GOOD | {"pad": "p" * 100}).encode(), "bytes, more than any value of ours"),
    (b"[1]", "JSON list, not an object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "n"}).encode(), "no 'n'"),
    (json.dumps(GOOD | {"n": "3"}).encode(), "'n' is a str"),
    (json.dumps(GOOD | {"n": True}).encode(), "'n' is a bool"),  # JSON's true is no count
    (json.dumps(GOOD | {"on": 1}).encode(), "'on' is a int"),
    (json.dumps(GOOD | {"either": 1.5}).encode(), "'either' is a float"),
])
def test_record_refuses_what_is_not_of_our_shape(raw: bytes, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        untrusted.record(raw, FIELDS, most=100)


def test_a_record_exactly_at_its_size_limit_is_read() -> None:
    raw = json.dumps(GOOD).encode()
    assert untrusted.record(raw, FIELDS, most=len(raw))["n"] == 3


@pytest.mark.parametrize(("raw", "n"), [(b"0", 0), (b"42", 42), (b"999999999", 999_999_999)])
def test_count(raw: bytes, n: int) -> None:
    assert untrusted.count(raw, "the beat") == n


@pytest.mark.parametrize("raw", [b"", b"-1", b"1e3", b"1000000000", b" 1", "٣".encode(), b"\x1b"])
def test_count_refuses_what_is_not_a_small_decimal(raw: bytes) -> None:
    with pytest.raises(ValueError, match=r"^the beat is unreadable: '.*' is not a number of ours$"):
        untrusted.count(raw, "the beat")


def test_the_default_limits() -> None:
    """printable, text and record cut text at 300 characters unless told otherwise."""
    assert untrusted.printable("x" * 300) == "x" * 300 and untrusted.printable("x" * 301) == "x" * 300 + "…"
    assert untrusted.text(b"x" * 301) == "x" * 300 + "…"
    long = json.dumps(GOOD | {"name": "n" * 301}).encode()
    assert untrusted.record(long, FIELDS)["name"] == "n" * 300 + "…"


def test_what_the_refusals_quote() -> None:
    """Forty characters of what was refused, printably."""
    with pytest.raises(ValueError) as refused:
        untrusted.parse(b"{" + b"x" * 100)
    assert str(refused.value) == "not JSON: '{" + "x" * 39 + "…'"
    with pytest.raises(ValueError) as refused:
        untrusted.count(b"1" * 50, "n")
    assert str(refused.value) == "n is unreadable: '" + "1" * 40 + "…' is not a number of ours"
    with pytest.raises(ValueError) as refused:
        untrusted.parse(b"[" * 100_000)
    assert str(refused.value) == "JSON nested deeper than Python can read"


def test_a_field_of_several_types_may_be_a_bool_where_bool_is_one() -> None:
    assert untrusted.record(b'{"x": true}', {"x": (bool, int)})["x"] is True
    with pytest.raises(ValueError, match="'x' is a bool"):
        untrusted.record(b'{"x": true}', {"x": (int, str)})
