"""`prefixroute demo --record DIR` writes each policy's recording to a directory of its own."""

from prefixroute.edges.cli.demo import _slugs


def test_a_policy_spec_becomes_a_directory_name():
    assert _slugs(["prefixroute:alpha=2", "round_robin"]) == {
        "prefixroute:alpha=2": "prefixroute_alpha_2", "round_robin": "round_robin"}


def test_specs_that_differ_only_in_punctuation_get_distinct_directories():
    assert _slugs(["a:b=1", "a_b_1", "a b 1"]) == {
        "a:b=1": "a_b_1", "a_b_1": "a_b_1-2", "a b 1": "a_b_1-3"}


def test_a_spec_of_punctuation_only_still_has_a_name():
    assert _slugs([":::"]) == {":::": "policy"}
