"""sao_core.jsontext.json_object: the one reader of a JSON object from user text (environment variables, lines of
labelled sets), whose errors name the source."""

import pytest

from sao_core.jsontext import json_object


def test_an_object_is_returned_as_it_is():
    assert json_object('{"a": [1, 2], "b": {"c": null}}', "X") == {"a": [1, 2], "b": {"c": None}}


@pytest.mark.parametrize("text, message", [
    ("{not json", r"^SRC:3 is not valid JSON \(Expecting property name"),
    ("", r"^SRC:3 is not valid JSON \(Expecting value"),
    ("[1, 2]", r"^SRC:3 must be a JSON object, got list$"),
    ('"text"', r"^SRC:3 must be a JSON object, got str$"),
    ("null", r"^SRC:3 must be a JSON object, got NoneType$"),
])
def test_what_is_not_an_object_is_refused_naming_the_source(text, message):
    with pytest.raises(ValueError, match=message):
        json_object(text, "SRC:3")
