"""format/strict_json: an untrusted manifest's JSON is read strictly, errors naming source and field."""

import pytest

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.strict_json import Fields, load_object


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"a": NaN}', "NaN is not allowed"),
        ('{"a": Infinity}', "Infinity is not allowed"),
        ("{", "not a valid JSON manifest"),
        (b"\xff", "not a valid JSON manifest"),
        ("[1]", "must be a JSON object, got list"),
    ],
)
def test_load_object_refuses_what_no_writer_writes(text, problem):
    with pytest.raises(ManifestError, match=f"^/ckpt/m.json: .*{problem}"):
        load_object(text, "/ckpt/m.json", 1000)


def test_load_object_refuses_a_document_over_its_bound_before_parsing():
    with pytest.raises(ManifestError, match="manifest is 11 bytes, over the 10 limit"):
        load_object('{"a": "xx"}', "m", 10)
    assert load_object('{"a": [1, 2.5, null]}', "m", 100) == {"a": [1, 2.5, None]}


def test_fields_check_each_type_and_name_the_field():
    fields = Fields({"n": 3, "b": True, "x": -1.5, "s": "v", "l": [1, "2"]}, "src", "shards[0].")
    assert fields.integer("n", minimum=0) == 3
    assert fields.string("s") == "v"
    cases = [
        (lambda: fields.integer("b", minimum=0), "'shards[0].b': expected an integer, got bool True"),
        (lambda: fields.integer("n", minimum=4), "'shards[0].n': must be >= 4, got 3"),
        (lambda: fields.number("x"), "'shards[0].x': must be a finite number >= 0"),
        (lambda: fields.number("s"), "'shards[0].s': expected a number, got str 'v'"),
        (lambda: fields.string("missing"), "'shards[0].missing': missing"),
        (lambda: fields.list_of("l", int), "'shards[0].l[1]': expected int, got str '2'"),
        (lambda: fields.reject_unknown({"n", "b", "x", "s"}), "'shards[0].l': unknown field"),
    ]
    for call, message in cases:
        with pytest.raises(ManifestError) as caught:
            call()
        assert str(caught.value).startswith(f"src: field {message}")
