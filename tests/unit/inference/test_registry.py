"""Who may take a name: `plan_register`, pure, over every pair of origins."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_inference import errors
from lora_inference.adapters.registry import AdapterRecord, Origin, plan_register

OLD, NEW = Path("/adapters/old"), Path("/adapters/new")


def held(origin: Origin, path: Path = OLD) -> AdapterRecord:
    return AdapterRecord(
        name="x",
        path=path,
        weights_file=path / "w.safetensors",
        sha256="0" * 64,
        size_bytes=1,
        rank=4,
        pinned=False,
        origin=origin,
        version=1,
    )


@pytest.mark.parametrize("origin", ["static", "api", "resolver", "request"])
def test_a_free_name_is_added(origin: Origin) -> None:
    assert plan_register(None, origin, NEW) == "add"


@pytest.mark.parametrize(
    ("origin", "inplace"),
    [
        pytest.param("api", False, id="admin-load"),
        pytest.param("api", True, id="admin-load-inplace"),
        pytest.param("resolver", False, id="resolver-hit"),
    ],
)
def test_managed_registrations_replace_a_request_registration(
    origin: Origin, inplace: bool
) -> None:
    assert plan_register(held("request"), origin, NEW, load_inplace=inplace) == "replace"


@pytest.mark.parametrize("existing", ["static", "api", "resolver"])
@pytest.mark.parametrize("inplace", [False, True], ids=["plain", "inplace"])
def test_a_request_never_takes_a_managed_name(existing: Origin, inplace: bool) -> None:
    with pytest.raises(errors.AdapterConflict, match="a request cannot replace it") as e:
        plan_register(held(existing), "request", NEW, load_inplace=inplace)
    assert e.value.param == "lora.name"


@pytest.mark.parametrize("existing", ["static", "api", "resolver", "request"])
def test_a_request_naming_the_same_file_reuses_the_record(existing: Origin) -> None:
    assert plan_register(held(existing), "request", OLD) == "reuse"


def test_a_request_cannot_repoint_another_requests_name() -> None:
    with pytest.raises(errors.AdapterConflict, match="load_inplace"):
        plan_register(held("request"), "request", NEW)


def test_an_admin_load_over_another_admin_load_needs_load_inplace() -> None:
    with pytest.raises(errors.AdapterConflict, match="load_inplace: true") as e:
        plan_register(held("api"), "api", NEW)
    assert e.value.param == "lora_name"
    assert plan_register(held("api"), "api", NEW, load_inplace=True) == "replace"


@pytest.mark.parametrize("inplace", [False, True], ids=["plain", "inplace"])
def test_an_admin_load_replaces_what_a_request_resolved(inplace: bool) -> None:
    """A request may resolve the name between the operator's read of the pod and its load."""
    for path in (OLD, NEW):
        assert plan_register(held("resolver"), "api", path, load_inplace=inplace) == "replace"


def test_an_admin_load_repeated_changes_nothing() -> None:
    """A retry whose first answer was lost: the same path, pin and scale."""
    assert plan_register(held("api"), "api", OLD) == "reuse"
    assert plan_register(held("api"), "api", OLD, load_inplace=True) == "replace"


@pytest.mark.parametrize(
    ("pinned", "scale"), [(True, 1.0), (False, 0.5)], ids=["another-pin", "another-scale"]
)
def test_an_admin_load_of_the_same_path_with_other_settings_needs_load_inplace(
    pinned: bool, scale: float
) -> None:
    with pytest.raises(errors.AdapterConflict, match="load_inplace: true"):
        plan_register(held("api"), "api", OLD, pinned=pinned, scale=scale)
    assert (
        plan_register(held("api"), "api", OLD, load_inplace=True, pinned=pinned, scale=scale)
        == "replace"
    )


@pytest.mark.parametrize("origin", ["api", "resolver"])
@pytest.mark.parametrize("inplace", [False, True], ids=["plain", "inplace"])
def test_static_names_are_never_replaced(origin: Origin, inplace: bool) -> None:
    with pytest.raises(errors.AdapterConflict, match="command line"):
        plan_register(held("static"), origin, NEW, load_inplace=inplace)


@pytest.mark.parametrize("existing", ["api", "resolver"])
def test_a_resolver_hit_keeps_what_another_resolved_or_loaded(existing: Origin) -> None:
    assert plan_register(held(existing), "resolver", NEW) == "reuse"
