"""The profile files the repository keeps load and write back what they hold.

tests/profiles/ holds profiles as the code wrote them before their optional fields were declared once (`Profile`'s
field list): one `planner profile` measured on two emulated hosts (hosts, compression errors, unused parameters and
every kept sample), a synthetic one with K-FAC, fp16 and PowerSGD timed and marked --quick, the same without its top-k
timings, left out for plans that send none (`planner demo`'s), and one without any optional field (a profile written
before they existed). Every profile file git tracks is read, wherever it is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner.contracts.profile import PROFILE_KIND, Profile
from tests.shipped import shipped

#: The stored profiles written before any optional field existed: reading them adds each as its default.
WITHOUT_OPTIONAL_FIELDS = {"mlp-before-optional-fields.json"}
#: The optional fields a profile without them leaves out of its file (the others are written as null).
LEFT_OUT = {"quick", "unused_params", "errors", "topk_left_out"}


def stored_profiles() -> list[Path]:
    """Every JSON file git tracks that is a profile."""
    found = [path for path in shipped("*.json")
             if isinstance(doc := json.loads(path.read_text(encoding="utf-8")), dict)
             and doc.get("kind") == PROFILE_KIND]
    assert {p.name for p in found} >= {"mlp-two-hosts.json", "mlp-kfac-compress-quick.json",
                                       "mlp-topk-left-out.json", *WITHOUT_OPTIONAL_FIELDS}
    return found


@pytest.mark.parametrize("path", stored_profiles(), ids=lambda p: p.name)
def test_a_stored_profile_writes_back_what_it_holds(path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    again = Profile.from_dict(doc).to_dict()
    assert Profile.from_dict(again).to_dict() == again  # stable
    assert {key: again[key] for key in doc} == doc  # no key lost, every value as it was
    added = {key: value for key, value in again.items() if key not in doc}
    if path.name in WITHOUT_OPTIONAL_FIELDS:
        optional = {f.name for f in dataclasses.fields(Profile) if f.metadata}
        assert added == dict.fromkeys(optional - LEFT_OUT)  # each written as null
    else:
        assert added == {}
        assert path.read_text(encoding="utf-8") == json.dumps(again, indent=2) + "\n"  # key for key, as written


def test_the_stored_profiles_set_every_optional_field() -> None:
    optional = {f.name: f.default for f in dataclasses.fields(Profile) if f.metadata}
    held = {key for path in stored_profiles() for key, value in json.loads(path.read_text(encoding="utf-8")).items()
            if key in optional and value != optional[key]}
    assert held == set(optional)
